"""The server's shared helpers and error handlers, called directly with a scripted engine and fake requests."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from mcore_infer.engine import RequestOutput
from mcore_infer.errors import (
    ContextLengthError,
    EngineDeadError,
    InvalidRequestError,
    MissingDependencyError,
    OverloadedError,
)
from mcore_infer.sampling import SamplingParams
from mcore_infer.server import build_app, serve
from mcore_infer.server.context import ServingContext
from mcore_infer.server.errors import ClientGone, HTTPError, exception_handlers
from mcore_infer.server.streaming import (
    DONE,
    chat_logprobs,
    completion_logprobs,
    event_stream,
    fan_out,
    include_usage,
    merged,
    read_json,
    run_all,
    sse,
    until_disconnect,
    usage,
)

VOCAB = {0: "a", 1: "bb", 2: "ccc"}


def out(rid: str, ids: list[int], text: str, finished: bool = False, **kw: Any) -> RequestOutput:
    return RequestOutput(rid, ids, text, None, None, finished, num_output_tokens=kw.pop("n_out", len(ids)), **kw)


class Engine:
    """Plays a script per request, keyed by the prompt's first token: lists of outputs to yield, events to wait
    for, exceptions to raise. Records which requests were closed (finished, failed or cancelled)."""

    def __init__(self, scripts: dict[int, list[Any]]) -> None:
        self.scripts, self.closed = scripts, []

    async def generate_batches(self, ids: list[int], params: SamplingParams, stream: bool = True) -> AsyncIterator:
        try:
            for step in self.scripts[ids[0]]:
                if isinstance(step, asyncio.Event):
                    await step.wait()
                elif isinstance(step, BaseException):
                    raise step
                else:
                    yield step
        finally:
            self.closed.append(ids[0])

    async def generate(self, ids: list[int], params: SamplingParams, stream: bool = True) -> AsyncIterator:
        async for batch in self.generate_batches(ids, params, stream):
            for o in batch:
                yield o


class FakeRequest:
    def __init__(self, body: bytes = b"", headers: dict[str, str] | None = None, gone: bool = False) -> None:
        self.raw, self.headers, self.gone, self.read = body, headers or {}, gone, False

    async def body(self) -> bytes:
        self.read = True
        return self.raw

    async def is_disconnected(self) -> bool:
        return self.gone


async def collect(it: AsyncIterator[Any]) -> list[Any]:
    return [x async for x in it]


def test_sse_usage_and_include_usage() -> None:
    assert sse({"a": [1, "é"], "b": None}) == 'data: {"a": [1, "\\u00e9"], "b": null}\n\n'
    assert DONE == "data: [DONE]\n\n"
    assert list(usage(5, 8).items()) == [("prompt_tokens", 5), ("completion_tokens", 8), ("total_tokens", 13)]
    assert not include_usage({}) and not include_usage({"stream_options": None})
    assert include_usage({"stream_options": {"include_usage": True}})


def test_read_json_limits_and_shapes() -> None:
    at_limit = FakeRequest(b'{"a": 1}'.ljust(100), {"content-length": "100"})
    assert asyncio.run(read_json(at_limit, 100)) == {"a": 1}
    req = FakeRequest(b"{}", {"content-length": "101"})
    with pytest.raises(HTTPError) as e:
        asyncio.run(read_json(req, 100))
    assert not req.read  # refused by its header, before reading
    want = {"message": "request body over 100 bytes", "type": "invalid_request_error", "param": None, "code": None}
    assert e.value.status == 413 and e.value.body == {"error": want}
    with pytest.raises(HTTPError) as e:
        asyncio.run(read_json(FakeRequest(b" " * 101), 100))  # no header: counted
    assert e.value.status == 413
    with pytest.raises(HTTPError) as e:
        asyncio.run(read_json(FakeRequest(b"{not json"), 100))
    assert e.value.status == 400 and e.value.body["error"]["message"].startswith("the body is not valid JSON: ")
    with pytest.raises(HTTPError) as e:
        asyncio.run(read_json(FakeRequest(b"[1]"), 100))
    assert (e.value.status, e.value.body["error"]["message"]) == (400, "the body must be a JSON object")


def test_fan_out_indices_and_seeds() -> None:
    params = SamplingParams(seed=7)
    jobs = fan_out([[1], [2, 3]], params, 3)
    assert [(i, ids) for i, ids, _ in jobs] == [(0, [1]), (1, [1]), (2, [1]), (3, [2, 3]), (4, [2, 3]), (5, [2, 3])]
    assert [p.seed for _, _, p in jobs] == [7, 8, 9, 7, 8, 9] and jobs[0][2] is params
    unseeded = SamplingParams()
    assert all(p is unseeded for _, _, p in fan_out([[1]], unseeded, 2))
    top = SamplingParams(seed=2**63 - 2)  # a valid seed: its later choices wrap instead of leaving the range
    assert [p.seed for _, _, p in fan_out([[1]], top, 3)] == [2**63 - 2, 2**63 - 1, -(2**63)]
    assert [p.seed for _, _, p in fan_out([[1]], SamplingParams(seed=-5), 2)] == [-5, -4]


def test_merged_single_job_combines_each_batch() -> None:
    eng = Engine({1: [[out("r", [5], "x"), out("r", [6], "y")], [out("r", [7], "z", finished=True)]]})
    batches = asyncio.run(collect(merged(eng, fan_out([[1]], SamplingParams(), 1))))  # type: ignore[arg-type]
    assert [[(i, o.new_token_ids, o.new_text, o.finished) for i, o in b] for b in batches] == [
        [(0, [5, 6], "xy", False)], [(0, [7], "z", True)]]  # fmt: skip


def test_merged_orders_a_batch_by_arrival_and_combines_each_job() -> None:
    async def main() -> tuple[list[Any], list[Any], list[int]]:
        g0, g1, g2 = asyncio.Event(), asyncio.Event(), asyncio.Event()
        eng = Engine({
            10: [g0, [out("a", [1], "a1"), out("a", [2], "a2", finished=True)]],
            11: [[out("b", [3], "b1")], g1, [out("b", [4], "b2", finished=True)]],
            12: [g2, [out("c", [5], "c1", finished=True)]],
        })  # fmt: skip
        jobs = [(0, [10], SamplingParams()), (1, [11], SamplingParams()), (2, [12], SamplingParams())]
        it = merged(eng, jobs)  # type: ignore[arg-type]
        first = await it.__anext__()  # only job 1 has output yet
        g2.set(), g0.set(), g1.set()  # then jobs 2, 0 and 1, in that order, before the merger wakes
        rest = await collect(it)
        return first, rest, eng.closed

    first, rest, closed = asyncio.run(main())
    assert [(i, o.new_text) for i, o in first] == [(1, "b1")]
    assert len(rest) == 1
    assert [(i, o.new_token_ids, o.new_text, o.finished) for i, o in rest[0]] == [
        (2, [5], "c1", True), (0, [1, 2], "a1a2", True), (1, [4], "b2", True)]  # fmt: skip
    assert sorted(closed) == [10, 11, 12]


def test_merged_raises_a_job_failure_and_stops_the_others() -> None:
    async def main() -> list[int]:
        never = asyncio.Event()
        eng = Engine({10: [never], 11: [[out("b", [3], "b1")], RuntimeError("job failed")]})
        jobs = [(0, [10], SamplingParams()), (1, [11], SamplingParams())]
        with pytest.raises(RuntimeError, match="job failed"):
            await collect(merged(eng, jobs))  # type: ignore[arg-type]
        return eng.closed

    assert sorted(asyncio.run(main())) == [10, 11]


def test_event_stream_framing_usage_and_in_stream_errors() -> None:
    eng = Engine({
        1: [[out("r", [5], "he")], [out("r", [6], "y", finished=True, n_out=3)]],
        2: [OverloadedError("the server is shutting down")],
    })  # fmt: skip

    def chunk(idx: int, o: RequestOutput) -> dict[str, Any]:
        return {"i": idx, "t": o.new_text}

    writes = asyncio.run(
        collect(event_stream(eng, [(0, [1], SamplingParams())], chunk, head=[{"h": 0}], tail=lambda c: {"u": c}))  # type: ignore[arg-type]
    )
    assert writes == ['data: {"h": 0}\n\n', 'data: {"i": 0, "t": "he"}\n\n', 'data: {"i": 0, "t": "y"}\n\n',
                      'data: {"u": 3}\n\n', DONE]  # fmt: skip
    writes = asyncio.run(collect(event_stream(eng, [(0, [2], SamplingParams())], chunk)))  # type: ignore[arg-type]
    err = {"message": "the server is shutting down", "type": "server_error", "param": None, "code": None}
    assert writes == [sse({"error": err}), DONE]
    # n > 1: every event of a batch in one write
    eng = Engine({3: [[out("a", [1], "x", finished=True)]], 4: [[out("b", [2], "y", finished=True)]]})
    jobs = [(0, [3], SamplingParams()), (1, [4], SamplingParams())]
    writes = asyncio.run(collect(event_stream(eng, jobs, chunk)))  # type: ignore[arg-type]
    assert writes == ['data: {"i": 0, "t": "x"}\n\ndata: {"i": 1, "t": "y"}\n\n', DONE]


def test_completion_logprobs_shape() -> None:
    o = out("r", [2, 0], "ccca", finished=True, prompt_logprobs=[None, -0.5], prompt_top_logprobs=[None, [(2, -0.1)]])
    o.new_logprobs, o.new_top_logprobs = [-1.0, -2.0], [[(2, -1.0), (1, -1.5)], [(0, -2.0)]]
    assert completion_logprobs(o, [0, 1], VOCAB.__getitem__) == {
        "tokens": ["a", "bb", "ccc", "a"],
        "token_logprobs": [None, -0.5, -1.0, -2.0],
        "top_logprobs": [None, {"ccc": -0.1}, {"ccc": -1.0, "bb": -1.5}, {"a": -2.0}],
        "text_offset": [0, 1, 3, 6],
    }
    assert completion_logprobs(o, None, VOCAB.__getitem__, offset0=4) == {
        "tokens": ["ccc", "a"], "token_logprobs": [-1.0, -2.0],
        "top_logprobs": [{"ccc": -1.0, "bb": -1.5}, {"a": -2.0}], "text_offset": [4, 7]}  # fmt: skip
    o.prompt_logprobs = o.prompt_top_logprobs = None  # echo without prompt scores: placeholders
    lp = completion_logprobs(o, [1], VOCAB.__getitem__)
    assert lp["tokens"][0] == "bb" and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None


def test_chat_logprobs_shape() -> None:
    assert chat_logprobs([1], None, None, VOCAB.__getitem__) is None
    tok = {0: "é", 1: "b"}.__getitem__
    assert chat_logprobs([0, 1], [-0.5, -1.0], [[(1, -0.2)], []], tok) == {
        "content": [
            {"token": "é", "logprob": -0.5, "bytes": [195, 169], "top_logprobs": [
                {"token": "b", "logprob": -0.2, "bytes": [98]}]},
            {"token": "b", "logprob": -1.0, "bytes": [98], "top_logprobs": []},
        ]
    }  # fmt: skip
    assert [c["top_logprobs"] for c in chat_logprobs([1], [-1.0], None, tok)["content"]] == [[]]  # type: ignore[index]


def test_until_disconnect_and_run_all() -> None:
    async def main() -> tuple[list[RequestOutput], bool]:
        assert await until_disconnect(FakeRequest(), asyncio.sleep(0, "done")) == "done"
        work = asyncio.get_running_loop().create_future()
        with pytest.raises(ClientGone):
            await until_disconnect(FakeRequest(gone=True), work)
        eng = Engine({1: [[out("a", [1], "x", finished=True)]], 2: [[out("b", [2], "y", finished=True)]]})
        jobs = [(0, [2], SamplingParams()), (1, [1], SamplingParams())]
        return await run_all(FakeRequest(), eng, jobs), work.cancelled()  # type: ignore[arg-type]

    results, cancelled = asyncio.run(main())
    assert [o.new_text for o in results] == ["y", "x"] and cancelled  # in the order of the jobs; the gone one stopped


def test_exception_handlers_statuses_and_bodies() -> None:
    handlers = exception_handlers()
    cases = [
        (HTTPError(404, "no such model", "invalid_request_error", "model", "model_not_found"), 404,
         {"message": "no such model", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}),
        (InvalidRequestError("bad n", param="n"), 400,
         {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": None}),
        (OverloadedError("full"), 503, {"message": "full", "type": "server_error", "param": None, "code": "overloaded"}),
        (EngineDeadError("dead"), 503,
         {"message": "dead", "type": "server_error", "param": None, "code": "engine_unavailable"}),
    ]  # fmt: skip
    for exc, status, err in cases:
        resp = asyncio.run(handlers[type(exc)](None, exc))  # type: ignore[arg-type]
        assert resp.status_code == status and json.loads(resp.body) == {"error": err}
    gone = asyncio.run(handlers[ClientGone](None, ClientGone()))  # type: ignore[arg-type]
    assert gone.status_code == 499 and gone.body == b""


class _Limits:
    max_model_len, max_queue, num_waiting = 10, 4, 0

    def check_request(self, ids: list[int], params: SamplingParams, param: str) -> None:
        if len(ids) > self.max_model_len:
            raise ContextLengthError("too long", param=param)


def test_serving_context_checks_and_token_cache() -> None:
    engine = SimpleNamespace(engine=_Limits())
    decoded: list[list[int]] = []
    tokenizer = SimpleNamespace(decode=lambda ids: decoded.append(ids) or VOCAB[ids[0]])
    ctx = ServingContext(engine, tokenizer, "tiny")  # type: ignore[arg-type]
    assert [ctx.tok_str(2), ctx.tok_str(2)] == ["ccc", "ccc"] and decoded == [[2]]  # decoded once
    ctx.check_model({"model": "tiny"})
    with pytest.raises(InvalidRequestError) as e400:  # OpenAI requires a model name
        ctx.check_model({})
    assert e400.value.param == "model"
    with pytest.raises(HTTPError) as e:
        ctx.check_model({"model": "gpt-4"})
    assert e.value.status == 404 and e.value.body["error"]["code"] == "model_not_found"
    with pytest.raises(ContextLengthError):
        ctx.check_capacity([[0] * 11], SamplingParams(), 1, "prompt")
    with pytest.raises(HTTPError) as e:
        ctx.check_capacity([[0] * 41], SamplingParams(), 1, "prompt")  # far over: the payload is too large
    assert e.value.status == 413 and e.value.body["error"]["code"] == "context_length_exceeded"
    ctx.check_capacity([[0], [1]], SamplingParams(), 2, "prompt")
    with pytest.raises(InvalidRequestError) as e400:  # more than the whole queue: never servable, so not a 503
        ctx.check_capacity([[0], [1]], SamplingParams(), 3, "prompt")
    assert e400.value.code == "too_many_completions" and e400.value.param == "n"
    engine.engine.num_waiting = 3
    with pytest.raises(OverloadedError):  # fits the queue, not now: retry later
        ctx.check_capacity([[0], [1]], SamplingParams(), 1, "prompt")


def test_build_app_routes_and_state() -> None:
    engine = SimpleNamespace(engine=_Limits())
    app = build_app(engine, SimpleNamespace(), "tiny", shutdown_timeout=2.0)  # type: ignore[arg-type]
    routes = {(r.path, m) for r in app.routes for m in getattr(r, "methods", ()) if m != "HEAD"}
    want = {("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/v1/models", "GET"), ("/health", "GET")}
    assert want | {("/api", "PUT")} <= routes
    assert app.state.serving.model_name == "tiny" and app.state.serving.shutdown_timeout == 2.0


def test_fastapi_is_imported_lazily_and_named_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    code = "import sys, mcore_infer, mcore_infer.server; print(sorted({'fastapi', 'uvicorn'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
    monkeypatch.setitem(sys.modules, "fastapi", None)
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    with pytest.raises(MissingDependencyError, match=r"mcore-infer\[server\]") as e:
        build_app(None, None, "tiny")  # type: ignore[arg-type]
    assert e.value.extra == "server"
    with pytest.raises(MissingDependencyError, match=r"mcore-infer\[server\]"):
        serve(None)
