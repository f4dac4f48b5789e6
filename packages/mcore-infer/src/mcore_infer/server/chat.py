"""``POST /v1/chat/completions``: OpenAI's chat completions API over the simple chat template
(:func:`~mcore_infer.protocol.apply_chat_template`; ``n``; ``logprobs``/``top_logprobs``; ``stream``; ``image_url``
content parts for vision-language models, :mod:`mcore_infer.server.images`)."""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request) at runtime

import time
import uuid
from typing import Any

from fastapi import Request

from mcore_data.chat import apply_chat_template as chat_prompt
from mcore_infer.engine import RequestOutput
from mcore_infer.protocol import chat_messages, sampling_from_request
from mcore_infer.server import streaming
from mcore_infer.server.context import Route, ServingContext, serving
from mcore_infer.server.images import prepare_images
from mcore_infer.server.responses import EventStreamResponse

__all__ = ["ROUTES"]


def _stream(
    ctx: ServingContext, jobs: list[streaming.Job], base: dict[str, Any], prompt_tokens: int, with_usage: bool
) -> EventStreamResponse:
    """A role event per choice, then the content deltas, then the usage when asked for. A delta without logprobs is
    written from a template (the JSON ``json.dumps`` would write of the same object)."""
    head = [
        {
            **base,
            "choices": [
                {"index": idx, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ],
        }
        for idx, _, _ in jobs
    ]

    prefix, q = streaming.chunk_prefix(base), streaming.json_value

    def chunk(idx: int, out: RequestOutput) -> dict[str, Any] | str:
        if out.new_logprobs is None:
            text = f'{{"content": {q(out.new_text)}}}' if out.new_text else "{}"
            return f'{prefix}{idx}, "delta": {text}, "logprobs": null, "finish_reason": {q(out.finish_reason)}}}]}}'
        lp = streaming.chat_logprobs(out.new_token_ids, out.new_logprobs, out.new_top_logprobs, ctx.tok_str)
        delta = {"content": out.new_text} if out.new_text else {}
        return {**base, "choices": [{"index": idx, "delta": delta, "logprobs": lp, "finish_reason": out.finish_reason}]}

    def tail(completion_tokens: int) -> dict[str, Any]:
        return {**base, "choices": [], "usage": streaming.usage(prompt_tokens, completion_tokens)}

    events = streaming.event_stream(ctx.engine, jobs, chunk, head=head, tail=tail if with_usage else None)
    return EventStreamResponse(events)


# POST /v1/chat/completions (no docstring: FastAPI would publish it in the OpenAPI schema)
async def chat(request: Request) -> Any:
    ctx = serving(request)
    ctx.check_alive()
    body = await streaming.read_json(request, ctx.max_body_bytes)
    ctx.check_model(body)
    params, n, stream = sampling_from_request(body, chat=True)
    messages = chat_messages(body.get("messages"))
    if messages.images:  # a VLM's prompt with its image tokens, carrying the decoded pixels
        ids: list[int] = await prepare_images(ctx.tokenizer, messages, ctx.vision, ctx.model_name)
    else:
        ids = ctx.tokenizer.encode(chat_prompt(messages.turns))
    ctx.check_capacity([ids], params, n, "messages")
    jobs = streaming.fan_out([ids], params, n)
    rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if stream:
        base = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": ctx.model_name}
        return _stream(ctx, jobs, base, len(ids), streaming.include_usage(body))

    results = await streaming.run_all(request, ctx.engine, jobs)
    choices = [
        {
            "index": idx,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": streaming.chat_logprobs(out.token_ids, out.logprobs, out.top_logprobs, ctx.tok_str),
            "finish_reason": out.finish_reason,
        }
        for (idx, _, _), out in zip(jobs, results)
    ]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": now,
        "model": ctx.model_name,
        "choices": choices,
        "usage": streaming.usage(len(ids), sum(o.num_output_tokens for o in results)),
    }


ROUTES: list[Route] = [("/v1/chat/completions", chat, "POST")]
