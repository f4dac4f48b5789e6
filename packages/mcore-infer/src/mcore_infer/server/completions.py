"""``POST /v1/completions``: OpenAI's completions API (string, strings or token-id prompts; ``n``; ``echo``;
``logprobs``; ``stream`` with ``stream_options.include_usage``)."""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request) at runtime

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request

from mcore_infer.engine import RequestOutput
from mcore_infer.errors import InvalidRequestError
from mcore_infer.protocol import sampling_from_request
from mcore_infer.sampling import SamplingParams
from mcore_infer.server import streaming
from mcore_infer.server.context import Route, ServingContext, serving
from mcore_infer.server.responses import EventStreamResponse

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
    """One parsed request: what its choices are built from. ``score_only`` (``echo`` with ``max_tokens: 0``): the
    engine generates one token, which no choice shows; each choice is its prompt with the prompt's logprobs."""

    ctx: ServingContext
    params: SamplingParams
    n: int
    texts: list[str | None]
    prompts: list[list[int]]
    id: str
    created: int
    score_only: bool = False

    def prompt_text(self, pi: int) -> str:
        t = self.texts[pi]
        return t if t is not None else self.ctx.tokenizer.decode(self.prompts[pi])

    def header(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.ctx.model_name}

    def completion_tokens(self, results: list[RequestOutput] | int) -> int:
        if self.score_only:
            return 0
        return results if isinstance(results, int) else sum(o.num_output_tokens for o in results)

    def choice(self, idx: int, out: RequestOutput, text: str, echo: bool, offset0: int = 0) -> dict[str, Any]:
        """Choice ``idx``: ``text`` after the prompt when ``echo``, the logprobs of the prompt when ``echo``; text
        offsets counted from ``offset0`` (where this part of a streamed choice starts)."""
        pi = idx // self.n
        if self.score_only:
            text, out = "", replace(out, new_token_ids=[], new_logprobs=[], new_top_logprobs=[])
        lp = None
        if self.params.logprobs is not None:
            lp = streaming.completion_logprobs(out, self.prompts[pi] if echo else None, self.ctx.tok_str, offset0)
        if echo:
            text = self.prompt_text(pi) + text
        choice = {"index": idx, "text": text, "logprobs": lp, "finish_reason": out.finish_reason}
        if out.finished and out.stop_reason is not None and not self.score_only:
            choice["stop_reason"] = out.stop_reason
        return choice

    def stream_chunk(self) -> Callable[[int, RequestOutput], dict[str, Any] | str]:
        """The event of one streamed output; each choice's first one carries the echoed prompt, and its text offsets
        continue where the choice's previous event's ended (as in one non-streamed choice). An event with neither
        logprobs nor the echo is written from a template (the JSON ``json.dumps`` would write of the same object)."""
        offsets: dict[int, int] = {}
        prefix = streaming.chunk_prefix(self.header())
        q = streaming.json_value
        plain = self.params.logprobs is None and not self.score_only

        def chunk(idx: int, out: RequestOutput) -> dict[str, Any] | str:
            echo = self.params.echo and idx not in offsets
            if plain and not echo:
                stop = ""
                if out.finished and out.stop_reason is not None:
                    stop = f', "stop_reason": {q(out.stop_reason)}'
                return (f'{prefix}{idx}, "text": {q(out.new_text)}, "logprobs": null, '
                        f'"finish_reason": {q(out.finish_reason)}{stop}}}]}}')  # fmt: skip
            c = self.choice(idx, out, out.new_text, echo, offsets.get(idx, 0))
            lp = c["logprobs"]
            offsets[idx] = lp["text_offset"][-1] + len(lp["tokens"][-1]) if lp and lp["tokens"] else offsets.get(idx, 0)
            return {**self.header(), "choices": [c]}

        return chunk


def _parse(request: Request, body: dict[str, Any]) -> _Completion:
    ctx = serving(request)
    ctx.check_model(body)
    params, n, _ = sampling_from_request(body, chat=False)
    score_only = params.echo and params.max_tokens == 0
    if score_only:  # the engine generates at least one token: it is dropped from every choice
        params.max_tokens = 1
    texts, prompts = parse_prompts(body, ctx.tokenizer)
    ctx.check_capacity(prompts, params, n, "prompt")
    return _Completion(ctx, params, n, texts, prompts, f"cmpl-{uuid.uuid4().hex}", int(time.time()), score_only)


# POST /v1/completions (no docstring: FastAPI would publish it in the OpenAPI schema)
async def completions(request: Request) -> Any:
    ctx = serving(request)
    ctx.check_alive()
    body = await streaming.read_json(request, ctx.max_body_bytes)
    req = _parse(request, body)
    jobs = streaming.fan_out(req.prompts, req.params, req.n)
    prompt_tokens = sum(len(p) for p in req.prompts)

    if body.get("stream"):
        tail = None
        if streaming.include_usage(body):

            def tail(completion_tokens: int) -> dict[str, Any]:
                usage = streaming.usage(prompt_tokens, req.completion_tokens(completion_tokens))
                return {**req.header(), "choices": [], "usage": usage}

        events = streaming.event_stream(ctx.engine, jobs, req.stream_chunk(), tail=tail)
        return EventStreamResponse(events)

    results = await streaming.run_all(request, ctx.engine, jobs)
    choices = [req.choice(idx, out, out.text, req.params.echo) for (idx, _, _), out in zip(jobs, results)]
    return {**req.header(), "choices": choices, "usage": streaming.usage(prompt_tokens, req.completion_tokens(results))}


ROUTES: list[Route] = [("/v1/completions", completions, "POST")]
