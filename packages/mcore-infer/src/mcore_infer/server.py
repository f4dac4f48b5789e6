"""The HTTP server: a thin FastAPI layer over :class:`~mcore_infer.async_engine.AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (OpenAI schemas, ``stream`` as server-sent events,
``n``, ``logprobs``, ``usage``), ``GET /v1/models``, ``GET /health`` and Megatron's ``PUT /api``. Errors carry an
OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``: 400 for bad parameters and prompts over the
context length, 404 for an unknown model, 413 for an oversized body, 503 when overloaded or shutting down.

fastapi and uvicorn are imported only when the app is built (``pip install mcore-infer[server]``).
"""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request) at runtime

import asyncio
import contextlib
import importlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from mcore_infer.async_engine import AsyncEngine
from mcore_infer.engine import RequestOutput
from mcore_infer.errors import (
    ContextLengthError,
    EngineDeadError,
    InvalidRequestError,
    MissingDependencyError,
    OverloadedError,
)
from mcore_infer.protocol import apply_chat_template, error_body, sampling_from_request
from mcore_infer.sampling import SamplingParams

__all__ = ["build_app", "serve"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20


def _require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(module, "server") from e


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, kind, param, code)


class _ClientGone(Exception):
    pass


def build_app(engine: AsyncEngine, tokenizer: Any, model_name: str, shutdown_timeout: float = 30.0) -> Any:
    """The FastAPI app; starting it starts the engine loop, stopping it drains and stops the engine."""
    _require("fastapi")
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown, shutdown_timeout)

    app = FastAPI(title="mcore-infer", lifespan=lifespan)
    created = int(time.time())
    max_len = engine.engine.max_model_len
    token_text_cache: dict[int, str] = {}

    def tok_str(t: int) -> str:
        s = token_text_cache.get(t)
        if s is None:
            s = token_text_cache[t] = tokenizer.decode([t])
        return s

    # ------------------------------------------------------------------------------------------------ errors
    def err(status: int, body: dict[str, Any]) -> Any:
        return JSONResponse(body, status_code=status)

    @app.exception_handler(_HTTPError)
    async def _http_error(_: Request, e: _HTTPError) -> Any:
        return err(e.status, e.body)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, e: InvalidRequestError) -> Any:
        return err(400, error_body(e.message, "invalid_request_error", e.param, e.code))

    @app.exception_handler(OverloadedError)
    async def _overloaded(_: Request, e: OverloadedError) -> Any:
        return err(503, error_body(str(e), "server_error", None, "overloaded"))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, e: EngineDeadError) -> Any:
        return err(503, error_body(str(e), "server_error", None, "engine_unavailable"))

    async def read_json(request: Request) -> dict[str, Any]:
        size = request.headers.get("content-length")
        if size is not None and int(size) > MAX_BODY_BYTES:
            raise _HTTPError(413, f"request body over {MAX_BODY_BYTES} bytes", "invalid_request_error")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise _HTTPError(413, f"request body over {MAX_BODY_BYTES} bytes", "invalid_request_error")
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as e:
            raise _HTTPError(400, f"the body is not valid JSON: {e}", "invalid_request_error") from e
        if not isinstance(body, dict):
            raise _HTTPError(400, "the body must be a JSON object", "invalid_request_error")
        return body

    def check_model(body: dict[str, Any]) -> None:
        name = body.get("model")
        if name is not None and name != model_name:
            raise _HTTPError(
                404,
                f"The model '{name}' does not exist; this server serves '{model_name}'",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def check_capacity(prompts: list[list[int]], params: SamplingParams, n: int, param: str) -> None:
        for ids in prompts:
            try:
                engine.engine.check_request(ids, params, param=param)
            except ContextLengthError as e:
                if len(ids) > 4 * max_len:  # far over: the payload itself is too large
                    raise _HTTPError(413, e.message, "invalid_request_error", e.param, e.code) from e
                raise
        if engine.engine.num_waiting + n * len(prompts) > engine.engine.max_queue:
            raise OverloadedError("the server is overloaded; try again later")

    async def run_one(ids: list[int], p: SamplingParams) -> RequestOutput:
        last = None
        async for out in engine.generate(ids, p, stream=False):
            last = out
        assert last is not None
        return last

    async def until_disconnect(request: Request, coro: Any) -> Any:
        task = asyncio.ensure_future(coro)
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                raise _ClientGone

    def fan_out(
        prompts: list[list[int]], params: SamplingParams, n: int
    ) -> list[tuple[int, list[int], SamplingParams]]:
        jobs = []
        for pi, ids in enumerate(prompts):
            for i in range(n):
                p = params
                if params.seed is not None and i > 0:
                    p = SamplingParams(**{**params.__dict__, "seed": params.seed + i})
                jobs.append((pi * n + i, ids, p))
        return jobs

    async def merged(
        jobs: list[tuple[int, list[int], SamplingParams]],
    ) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """Every job's streamed outputs, in batches of what arrived since the last one (one client write each), each
        job's outputs in a batch combined into one (one event per choice, however many tokens it carries)."""
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

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    # ------------------------------------------------------------------------------------------ info routes
    @app.get("/health")
    async def health() -> Any:
        if not engine.healthy:
            return err(503, error_body("engine not running", "server_error", None, "engine_unavailable"))
        return {"status": "ok", "running": engine.engine.num_running, "waiting": engine.engine.num_waiting}

    @app.get("/v1/models")
    async def models() -> Any:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "mcore", "max_model_len": max_len}
        return {"object": "list", "data": [card]}

    # ----------------------------------------------------------------------------------------- completions
    def completion_logprobs(outs: RequestOutput, echo_ids: list[int] | None, offset0: int) -> dict[str, Any]:
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        if echo_ids is not None:
            plp = outs.prompt_logprobs or [None] * len(echo_ids)
            ptop = outs.prompt_top_logprobs or [None] * len(echo_ids)
            for t, lp, top in zip(echo_ids, plp, ptop):
                tokens.append(tok_str(t))
                token_lps.append(lp)
                tops.append(None if top is None else {tok_str(a): b for a, b in top})
        # new_* hold the tokens since the previous output: all of them for a non-streamed request
        ids, lps, tl = outs.new_token_ids, outs.new_logprobs or [], outs.new_top_logprobs or []
        for t, lp, top in zip(ids, lps, tl):
            tokens.append(tok_str(t))
            token_lps.append(lp)
            tops.append({tok_str(a): b for a, b in top})
        offsets, pos = [], offset0
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def parse_prompts(body: dict[str, Any]) -> tuple[list[str | None], list[list[int]]]:
        p = body.get("prompt")
        if isinstance(p, str):
            items: list[Any] = [p]
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
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
            elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
                texts.append(None)
                ids.append(list(item))
            else:
                raise InvalidRequestError("prompt items must be strings or lists of token ids", param="prompt")
        return texts, ids

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await read_json(request)
        check_model(body)
        params, n, stream = sampling_from_request(body, chat=False)
        texts, prompts = parse_prompts(body)
        check_capacity(prompts, params, n, "prompt")
        jobs = fan_out(prompts, params, n)
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_tokens = sum(len(p) for p in prompts)

        def prompt_text(pi: int) -> str:
            t = texts[pi]
            return t if t is not None else tokenizer.decode(prompts[pi])

        if stream:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

            async def events() -> AsyncIterator[str]:
                completion_tokens = 0
                started: set[int] = set()
                try:
                    async for batch in merged(jobs):
                        events_now = []
                        for idx, out in batch:
                            pi = idx // n
                            text = out.new_text
                            if params.echo and idx not in started:
                                text = prompt_text(pi) + text
                            lp = None
                            if params.logprobs is not None:
                                echo_ids = prompts[pi] if params.echo and idx not in started else None
                                lp = completion_logprobs(out, echo_ids, 0)
                            started.add(idx)
                            if out.finished:
                                completion_tokens += out.num_output_tokens
                            choice = {"index": idx, "text": text, "logprobs": lp, "finish_reason": out.finish_reason}
                            if out.finished and out.stop_reason is not None:
                                choice["stop_reason"] = out.stop_reason
                            chunk = {"id": rid, "object": "text_completion", "created": now, "model": model_name}
                            events_now.append(sse({**chunk, "choices": [choice]}))
                        yield "".join(events_now)  # every event that is ready, in one write
                    if include_usage:
                        chunk = {"id": rid, "object": "text_completion", "created": now, "model": model_name}
                        yield sse({**chunk, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
                except Exception as e:  # after the headers went out: report in-stream
                    yield sse(error_body(str(e), "server_error"))
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        try:
            results = await until_disconnect(request, asyncio.gather(*(run_one(ids, p) for _, ids, p in jobs)))
        except _ClientGone:
            return Response(status_code=499)
        choices = []
        for (idx, _, _), out in zip(jobs, results):
            pi = idx // n
            text = out.text
            lp = None
            if params.logprobs is not None:
                lp = completion_logprobs(out, prompts[pi] if params.echo else None, 0)
            if params.echo:
                text = prompt_text(pi) + text
            choice = {"index": idx, "text": text, "logprobs": lp, "finish_reason": out.finish_reason}
            if out.stop_reason is not None:
                choice["stop_reason"] = out.stop_reason
            choices.append(choice)
        completion_tokens = sum(o.num_output_tokens for o in results)
        return {
            "id": rid,
            "object": "text_completion",
            "created": now,
            "model": model_name,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        }

    # ------------------------------------------------------------------------------------------------ chat
    def chat_logprobs(ids: list[int], lps: list[float] | None, tops: list[Any] | None) -> dict[str, Any] | None:
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

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await read_json(request)
        check_model(body)
        params, n, stream = sampling_from_request(body, chat=True)
        prompt = apply_chat_template(body.get("messages"))
        ids = tokenizer.encode(prompt)
        check_capacity([ids], params, n, "messages")
        jobs = fan_out([ids], params, n)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name}

        if stream:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

            async def events() -> AsyncIterator[str]:
                completion_tokens = 0
                try:
                    for idx, _, _ in jobs:
                        delta = {"role": "assistant", "content": ""}
                        yield sse({**base, "choices": [{"index": idx, "delta": delta, "finish_reason": None}]})
                    async for batch in merged(jobs):
                        events_now = []
                        for idx, out in batch:
                            lp = chat_logprobs(out.new_token_ids, out.new_logprobs, out.new_top_logprobs)
                            if out.finished:
                                completion_tokens += out.num_output_tokens
                            delta = {"content": out.new_text} if out.new_text else {}
                            choice = {"index": idx, "delta": delta, "logprobs": lp, "finish_reason": out.finish_reason}
                            events_now.append(sse({**base, "choices": [choice]}))
                        yield "".join(events_now)  # every event that is ready, in one write
                    if include_usage:
                        yield sse({**base, "choices": [], "usage": usage(len(ids), completion_tokens)})
                except Exception as e:
                    yield sse(error_body(str(e), "server_error"))
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        try:
            results = await until_disconnect(request, asyncio.gather(*(run_one(i, p) for _, i, p in jobs)))
        except _ClientGone:
            return Response(status_code=499)
        choices = [
            {
                "index": idx,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": chat_logprobs(out.token_ids, out.logprobs, out.top_logprobs),
                "finish_reason": out.finish_reason,
            }
            for (idx, _, _), out in zip(jobs, results)
        ]
        return {
            "id": rid,
            "object": "chat.completion",
            "created": now,
            "model": model_name,
            "choices": choices,
            "usage": usage(len(ids), sum(o.num_output_tokens for o in results)),
        }

    # ------------------------------------------------------------------------------------- Megatron PUT /api
    @app.put("/api")
    async def megatron(request: Request) -> Any:
        body = await read_json(request)
        prompts = body.get("prompts")
        if not (isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts)):
            raise InvalidRequestError("prompts must be a non-empty list of strings", param="prompts")
        n_gen = body.get("tokens_to_generate", 64)
        if not isinstance(n_gen, int) or n_gen < 0:
            raise InvalidRequestError("tokens_to_generate must be a non-negative integer", param="tokens_to_generate")
        want_lp = bool(body.get("logprobs", False))
        if n_gen == 0 and not want_lp:
            raise InvalidRequestError("tokens_to_generate=0 only makes sense with logprobs", param="logprobs")
        seed = body.get("random_seed")
        top_p = float(body.get("top_p", 0.0) or 0.0)
        params = SamplingParams(
            max_tokens=max(n_gen, 1),
            temperature=float(body.get("temperature", 1.0)),
            top_k=int(body.get("top_k", 0) or 0),
            top_p=top_p if 0.0 < top_p <= 1.0 else 1.0,
            seed=int(seed) if seed is not None and int(seed) >= 0 else None,
            logprobs=0 if want_lp else None,
            echo=want_lp,
            ignore_eos=bool(body.get("ignore_eos", False)),
        )
        ids_list = []
        for p in prompts:
            ids = tokenizer.encode(p)
            if body.get("add_BOS") and getattr(tokenizer, "bos", None) is not None:
                ids = [tokenizer.bos, *ids]
            ids_list.append(ids)
        check_capacity(ids_list, params, 1, "prompts")
        try:
            results = await until_disconnect(request, asyncio.gather(*(run_one(i, params) for i in ids_list)))
        except _ClientGone:
            return Response(status_code=499)
        texts, segments, logprobs = [], [], []
        for prompt, ids, out in zip(prompts, ids_list, results):
            gen_ids = out.token_ids if n_gen > 0 else []
            gen_text = out.text if n_gen > 0 else ""
            texts.append(prompt + gen_text)
            segments.append([tok_str(t) for t in ids + gen_ids])
            if want_lp:
                plp = [lp for lp in (out.prompt_logprobs or [])[1:]]
                logprobs.append(plp + (list(out.logprobs or []) if n_gen > 0 else []))
        resp: dict[str, Any] = {"text": texts, "segments": segments}
        if want_lp:
            resp["logprobs"] = logprobs
        return resp

    return app


def serve(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run ``app`` with uvicorn until SIGINT/SIGTERM (then in-flight requests drain; see ``build_app``)."""
    uvicorn = _require("uvicorn")
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30)
    uvicorn.Server(config).run()
