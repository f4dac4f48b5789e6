"""The pieces the routes share, as plain functions that run without a server: reading a JSON body under the size
limit, fanning a request out to one job per choice, awaiting results while watching for a client that hung up,
merging the streams of ``n`` > 1 jobs, server-sent-event framing, usage, and the OpenAI logprobs shapes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import TYPE_CHECKING, Any, TypeVar

from mcore_infer.async_engine import AsyncEngine
from mcore_infer.engine import RequestOutput
from mcore_infer.protocol import error_body
from mcore_infer.sampling import SamplingParams
from mcore_infer.server.errors import ClientGone, HTTPError

if TYPE_CHECKING:
    from fastapi import Request

__all__ = [
    "DONE",
    "Job",
    "chat_logprobs",
    "completion_logprobs",
    "event_stream",
    "fan_out",
    "chunk_prefix",
    "include_usage",
    "json_value",
    "merged",
    "read_json",
    "run_all",
    "run_one",
    "sse",
    "until_disconnect",
    "usage",
]

T = TypeVar("T")
Job = tuple[int, list[int], SamplingParams]
"""One completion to generate: its choice index, prompt token ids and sampling parameters."""

DONE = "data: [DONE]\n\n"
"""The event that ends every stream."""


# ------------------------------------------------------------------------------------------------- framing
def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as JSON (a ``str`` is taken as JSON text already)."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


_quote = encode_basestring_ascii  # json.dumps of a str, without its argument handling


def json_value(v: str | int | None) -> str:
    """``json.dumps(v)`` for the scalars of a streamed chunk (a string, an integer, None)."""
    if isinstance(v, str):
        return str(_quote(v))
    return "null" if v is None else json.dumps(v)


def chunk_prefix(header: dict[str, Any]) -> str:
    """The JSON text of ``{**header, "choices": [{"index": `` (up to the index), as ``json.dumps`` writes it: a
    streamed chunk is this, then its choice's fields (the events of a stream differ only there)."""
    return json.dumps(header)[:-1] + ', "choices": [{"index": '


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def include_usage(body: dict[str, Any]) -> bool:
    """Whether a streamed request asked for a last event with the usage (``stream_options.include_usage``; a
    ``stream_options`` that is not an object is refused when the request is parsed)."""
    opts = body.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("include_usage"))


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _body_size(request: Request) -> int | None:
    size = request.headers.get("content-length")
    if size is None:
        return None
    try:
        return int(size)
    except ValueError:
        raise HTTPError(400, f"invalid Content-Length header {size!r}", "invalid_request_error") from None


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object: 413 over ``limit`` bytes (by its header or its length), 400 when not UTF-8, not
    JSON (``NaN`` and ``Infinity`` included), not an object, or holding a lone UTF-16 surrogate (``"\\ud800"``, which
    no UTF-8 text can hold)."""
    size = _body_size(request)
    if size is not None and size > limit:
        raise HTTPError(413, f"request body over {limit} bytes", "invalid_request_error")
    raw = await request.body()
    if len(raw) > limit:
        raise HTTPError(413, f"request body over {limit} bytes", "invalid_request_error")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HTTPError(400, f"the body is not valid UTF-8: {e}", "invalid_request_error") from e
    try:
        body = json.loads(text, parse_constant=_no_constants)
    except ValueError as e:  # JSONDecodeError, or a NaN / Infinity constant
        raise HTTPError(400, f"the body is not valid JSON: {e}", "invalid_request_error") from e
    except RecursionError:
        raise HTTPError(400, "the body is not valid JSON: nested too deeply", "invalid_request_error") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the body must be a JSON object", "invalid_request_error")
    try:
        if _SURROGATE_ESCAPE.search(text):  # rare: only then is the parsed body walked
            json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        msg = "the body holds a lone UTF-16 surrogate escape, which is not valid Unicode text"
        raise HTTPError(400, msg, "invalid_request_error") from e
    return body


# ----------------------------------------------------------------------------------------------- requests
_SEED_HALF = 1 << 63
"""Seeds are signed 64-bit integers: ``[-2**63, 2**63)``."""


def fan_out(prompts: list[list[int]], params: SamplingParams, n: int) -> list[Job]:
    """``n`` jobs per prompt, choice ``prompt_index * n + i``; a seeded request's ``i``-th job gets ``seed + i``
    (wrapped around the signed 64-bit range, so a valid seed near its top stays valid for every choice)."""
    jobs = []
    for pi, ids in enumerate(prompts):
        for i in range(n):
            p = params
            if params.seed is not None and i > 0:
                p = SamplingParams(
                    **{**params.__dict__, "seed": (params.seed + i + _SEED_HALF) % (2 * _SEED_HALF) - _SEED_HALF}
                )
            jobs.append((pi * n + i, ids, p))
    return jobs


async def run_one(engine: AsyncEngine, ids: list[int], params: SamplingParams) -> RequestOutput:
    """The finished output of one non-streamed request."""
    last = None
    async for out in engine.generate(ids, params, stream=False):
        last = out
    assert last is not None
    return last


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """The result of ``work``; if the client disconnects first, ``work`` is cancelled and :class:`ClientGone`
    raised."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.1)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            raise ClientGone


async def run_all(request: Request, engine: AsyncEngine, jobs: Sequence[Job]) -> list[RequestOutput]:
    """Every job's finished output, in the order of ``jobs``, all aborted if the client disconnects."""
    return await until_disconnect(request, asyncio.gather(*(run_one(engine, ids, p) for _, ids, p in jobs)))


async def merged(engine: AsyncEngine, jobs: Sequence[Job]) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
    """Every job's streamed outputs, in batches of what arrived since the last one (one client write each), each
    job's outputs in a batch combined into one (one event per choice, however many tokens it carries), the jobs in
    the order their first output in the batch arrived. A job's failure is raised; closing this stops every job."""
    if len(jobs) == 1:  # the usual n=1 request: straight from the engine, no extra task and queue
        idx, ids, p = jobs[0]
        async for outs in engine.generate_batches(ids, p, stream=True):
            yield [(idx, RequestOutput.combine(outs))]
        return
    q: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()

    async def pump(idx: int, ids: list[int], p: SamplingParams) -> None:
        try:
            async for outs in engine.generate_batches(ids, p, stream=True):
                for o in outs:
                    q.put_nowait((idx, o))
        except Exception as e:
            q.put_nowait((idx, e))

    tasks = [asyncio.ensure_future(pump(*j)) for j in jobs]
    left = len(jobs)
    try:
        while left:
            items = [await q.get()]
            while not q.empty():
                items.append(q.get_nowait())
            by_job: dict[int, list[RequestOutput]] = {}
            for idx, item in items:
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    left -= 1
                by_job.setdefault(idx, []).append(item)
            yield [(idx, RequestOutput.combine(outs)) for idx, outs in by_job.items()]
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def event_stream(
    engine: AsyncEngine,
    jobs: Sequence[Job],
    chunk: Callable[[int, RequestOutput], dict[str, Any] | str],
    head: Sequence[dict[str, Any]] = (),
    tail: Callable[[int], dict[str, Any]] | None = None,
) -> AsyncIterator[str]:
    """The body of a streamed response: an event per ``head`` object, then per merged batch one write holding
    ``chunk(choice_index, output)`` (an object, or its JSON text) for each choice in it, then
    ``tail(completion_tokens)`` when given, then ``[DONE]``. The headers are out by then, so an error is reported as
    an event before ``[DONE]``. One job (``n`` = 1) streams straight from the engine, without :func:`merged`."""
    completion_tokens = 0
    try:
        for obj in head:
            yield sse(obj)
        if len(jobs) == 1:  # the usual n=1 request: each batch of outputs one event, straight from the engine
            idx, ids, p = jobs[0]
            batches: Any = engine.generate_batches(ids, p, stream=True)
            async with contextlib.aclosing(batches):
                async for outs in batches:
                    out = RequestOutput.combine(outs)
                    if out.finished:
                        completion_tokens += out.num_output_tokens
                    yield sse(chunk(idx, out))
        else:
            async for batch in merged(engine, jobs):
                events_now = []
                for idx, out in batch:
                    if out.finished:
                        completion_tokens += out.num_output_tokens
                    events_now.append(sse(chunk(idx, out)))
                yield "".join(events_now)  # every event that is ready, in one write
        if tail is not None:
            yield sse(tail(completion_tokens))
    except Exception as e:
        yield sse(error_body(str(e), "server_error"))
    yield DONE


# ----------------------------------------------------------------------------------------------- logprobs
def completion_logprobs(
    out: RequestOutput, echo_ids: list[int] | None, tok_str: Callable[[int], str], offset0: int = 0
) -> dict[str, Any]:
    """The completions API's ``logprobs``: the echoed prompt's tokens (when ``echo_ids``) then ``out``'s new ones,
    with their log-probabilities, top alternatives and text offsets counted from ``offset0``."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    if echo_ids is not None:
        plp = out.prompt_logprobs or [None] * len(echo_ids)
        ptop = out.prompt_top_logprobs or [None] * len(echo_ids)
        for t, lp, top in zip(echo_ids, plp, ptop):
            tokens.append(tok_str(t))
            token_lps.append(lp)
            tops.append(None if top is None else {tok_str(a): b for a, b in top})
    # new_* hold the tokens since the previous output: all of them for a non-streamed request
    ids, lps, tl = out.new_token_ids, out.new_logprobs or [], out.new_top_logprobs or []
    for t, lp, top in zip(ids, lps, tl):
        tokens.append(tok_str(t))
        token_lps.append(lp)
        tops.append({tok_str(a): b for a, b in top})
    offsets, pos = [], offset0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(
    ids: list[int], lps: list[float] | None, tops: list[Any] | None, tok_str: Callable[[int], str]
) -> dict[str, Any] | None:
    """The chat API's ``logprobs`` (``None`` when none were asked for): per token its text, log-probability, UTF-8
    bytes and top alternatives."""
    if lps is None:
        return None
    content = []
    for t, lp, top in zip(ids, lps, tops or [[]] * len(ids)):
        s = tok_str(t)
        content.append(
            {
                "token": s,
                "logprob": lp,
                "bytes": list(s.encode("utf-8")),
                "top_logprobs": [
                    {"token": tok_str(a), "logprob": b, "bytes": list(tok_str(a).encode("utf-8"))} for a, b in top
                ],
            }
        )
    return {"content": content}
