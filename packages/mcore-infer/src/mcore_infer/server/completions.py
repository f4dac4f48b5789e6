"""``POST /v1/completions``: OpenAI's completions API (string, strings or token-id prompts; ``n``; ``echo``;
``logprobs``; ``stream`` with ``stream_options.include_usage``)."""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request) at runtime

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from mcore_infer.engine import RequestOutput
from mcore_infer.errors import InvalidRequestError
from mcore_infer.protocol import sampling_from_request
from mcore_infer.sampling import SamplingParams
from mcore_infer.server import streaming
from mcore_infer.server.context import Route, ServingContext, serving

__all__ = ["ROUTES", "parse_prompts"]


def _is_token_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_prompts(body: dict[str, Any], tokenizer: Any) -> tuple[list[str | None], list[list[int]]]:
    """``(texts, token_ids)`` per prompt of ``body["prompt"]``; a prompt given as token ids has no text."""
    p = body.get("prompt")
    if isinstance(p, str):
        items: list[Any] = [p]
    elif isinstance(p, list) and p and _is_token_ids(p):
        items = [p]
    elif isinstance(p, list) and p:
        items = p
    else:
        raise InvalidRequestError("prompt must be a string, a list of strings or token ids", param="prompt")
    texts: list[str | None] = []
    ids: list[list[int]] = []
    for item in items:
        if isinstance(item, str):
            texts.append(item)
            ids.append(tokenizer.encode(item))
        elif _is_token_ids(item):
            texts.append(None)
            ids.append(list(item))
        else:
            raise InvalidRequestError("prompt items must be strings or lists of token ids", param="prompt")
    return texts, ids


@dataclass
class _Completion:
    """One parsed request: what its choices are built from."""

    ctx: ServingContext
    params: SamplingParams
    n: int
    texts: list[str | None]
    prompts: list[list[int]]
    id: str
    created: int

    def prompt_text(self, pi: int) -> str:
        t = self.texts[pi]
        return t if t is not None else self.ctx.tokenizer.decode(self.prompts[pi])

    def header(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.ctx.model_name}

    def choice(self, idx: int, out: RequestOutput, text: str, echo: bool) -> dict[str, Any]:
        """Choice ``idx``: ``text`` after the prompt when ``echo``, the logprobs of the prompt when ``echo``."""
        pi = idx // self.n
        lp = None
        if self.params.logprobs is not None:
            lp = streaming.completion_logprobs(out, self.prompts[pi] if echo else None, self.ctx.tok_str)
        if echo:
            text = self.prompt_text(pi) + text
        choice = {"index": idx, "text": text, "logprobs": lp, "finish_reason": out.finish_reason}
        if out.finished and out.stop_reason is not None:
            choice["stop_reason"] = out.stop_reason
        return choice

    def stream_chunk(self) -> Callable[[int, RequestOutput], dict[str, Any]]:
        """The event of one streamed output; each choice's first one carries the echoed prompt."""
        started: set[int] = set()

        def chunk(idx: int, out: RequestOutput) -> dict[str, Any]:
            echo = self.params.echo and idx not in started
            started.add(idx)
            return {**self.header(), "choices": [self.choice(idx, out, out.new_text, echo)]}

        return chunk


# POST /v1/completions (no docstring: FastAPI would publish it in the OpenAPI schema)
async def completions(request: Request) -> Any:
    ctx = serving(request)
    body = await streaming.read_json(request, ctx.max_body_bytes)
    ctx.check_model(body)
    params, n, stream = sampling_from_request(body, chat=False)
    texts, prompts = parse_prompts(body, ctx.tokenizer)
    ctx.check_capacity(prompts, params, n, "prompt")
    jobs = streaming.fan_out(prompts, params, n)
    req = _Completion(ctx, params, n, texts, prompts, f"cmpl-{uuid.uuid4().hex}", int(time.time()))
    prompt_tokens = sum(len(p) for p in prompts)

    if stream:
        tail = None
        if streaming.include_usage(body):

            def tail(completion_tokens: int) -> dict[str, Any]:
                return {**req.header(), "choices": [], "usage": streaming.usage(prompt_tokens, completion_tokens)}

        events = streaming.event_stream(ctx.engine, jobs, req.stream_chunk(), tail=tail)
        return StreamingResponse(events, media_type="text/event-stream")

    results = await streaming.run_all(request, ctx.engine, jobs)
    choices = [req.choice(idx, out, out.text, params.echo) for (idx, _, _), out in zip(jobs, results)]
    completion_tokens = sum(o.num_output_tokens for o in results)
    return {**req.header(), "choices": choices, "usage": streaming.usage(prompt_tokens, completion_tokens)}


ROUTES: list[Route] = [("/v1/completions", completions, "POST")]
