"""The server over :class:`~mcore_infer.engine_process.EngineClient` (the engine in a spawned process): the same
answers as the in-process server through the real ``openai`` client, errors as OpenAI bodies, concurrent streams,
503s once the engine process is killed, and no process left after shutdown. uvicorn in a thread, on CPU."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from mcore_infer import LLM, SamplingParams
from mcore_infer.async_engine import AsyncEngine
from mcore_infer.engine_process import EngineClient, EngineSpec
from mcore_infer.errors import EngineDeadError, InvalidRequestError
from mcore_infer.server import build_app, server_config
from tests.infer._tiny import tiny_llm, tiny_model

CFG = dict(block_size=16, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=128)
GREEDY = {"model": "tiny", "prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def complete(s: Server, stream: bool = False, **kw: Any) -> Any:
    """A greedy completion through the openai client (``ignore_eos`` is an extension: ``extra_body``)."""
    args: dict[str, Any] = {"model": "tiny", "prompt": "Hello", "max_tokens": 6, "temperature": 0, **kw}
    return s.client.completions.create(**args, stream=stream, extra_body={"ignore_eos": True})


def build_tiny_llm() -> LLM:
    """The engine process's factory (module level, so ``spawn`` pickles it by reference)."""
    llm: LLM = tiny_llm(tiny_model(max_position_embeddings=256), **CFG)
    llm.name = "tiny"
    return llm


class Server:
    """``app`` under ``serve``'s uvicorn config in a thread, with an openai client and an httpx one."""

    def __init__(self, engine: Any, tokenizer: Any) -> None:
        self.engine = engine
        self.app = build_app(engine, tokenizer, "tiny", shutdown_timeout=2.0)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.server = uvicorn.Server(server_config(self.app, "127.0.0.1", port, "critical"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.url = url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=url, timeout=60)
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    def close(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=20)


@pytest.fixture(scope="module")
def ref() -> Iterator[Server]:
    llm = build_tiny_llm()
    s = Server(AsyncEngine(llm.engine), llm.tokenizer)
    yield s
    s.close()


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    client = EngineClient(EngineSpec(build_tiny_llm)).launch()
    s = Server(client, client.tokenizer)
    yield s
    s.close()
    assert not client._proc.is_alive()


def assert_openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}
    return err


def test_completions_and_chat_match_in_process_server(srv: Server, ref: Server) -> None:
    assert srv.engine.model_name == "tiny"
    for s in (srv, ref):
        assert s.client.models.list().data[0].id == "tiny"
    got, want = complete(srv), complete(ref)
    assert got.choices[0].text == want.choices[0].text and got.usage == want.usage
    msgs = [{"role": "user", "content": "Hi there"}]
    kw: dict[str, Any] = dict(model="tiny", messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    got_c, want_c = srv.client.chat.completions.create(**kw), ref.client.chat.completions.create(**kw)
    assert got_c.choices[0].message.content == want_c.choices[0].message.content
    assert got_c.choices[0].logprobs == want_c.choices[0].logprobs
    body = {**GREEDY, "n": 3, "temperature": 0.8, "seed": 7}
    assert (
        srv.http.post("/v1/completions", json=body).json()["choices"]
        == ref.http.post("/v1/completions", json=body).json()["choices"]
    )


def test_streaming_adds_up_and_runs_concurrently(srv: Server, ref: Server) -> None:
    want = complete(ref, max_tokens=24).choices[0].text

    def one(_: int) -> str:
        stream = complete(srv, stream=True, max_tokens=24)
        return "".join(c.choices[0].text for c in stream if c.choices)

    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(one, range(6)))
    assert texts == [want] * 6
    kw: dict[str, Any] = dict(model="tiny", messages=[{"role": "user", "content": "Hey"}], max_tokens=8, temperature=0)
    chunks = srv.client.chat.completions.create(**kw, stream=True, n=2)
    by_choice = ["", ""]
    for c in chunks:
        for ch in c.choices:
            by_choice[ch.index] += ch.delta.content or ""
    assert by_choice == [ref.client.chat.completions.create(**kw).choices[0].message.content] * 2


def test_errors_are_openai_bodies(srv: Server) -> None:
    err = assert_openai_error(srv.http.post("/v1/completions", json={**GREEDY, "max_tokens": 10_000}), 400)
    assert err["code"] == "context_length_exceeded"
    assert assert_openai_error(srv.http.post("/v1/completions", json={**GREEDY, "top_p": 5}), 400)["param"]
    with pytest.raises(openai.BadRequestError):
        complete(srv, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        complete(srv, model="other")
    health = srv.http.get("/health").json()
    assert health["status"] == "ok" and health["kv_blocks"]["total"] > 0
    metrics = srv.http.get("/metrics").text
    assert 'mcore_infer_healthy{model="tiny"} 1' in metrics and "mcore_infer_engine_steps_total" in metrics


def test_engine_errors_reach_only_their_caller() -> None:
    """The engine's refusals come back as the same exceptions AsyncEngine raises (checked in the front end, and a
    refusal from the engine process itself decoded from its message)."""
    from mcore_infer.engine_process._worker import decode_error, encode_error
    from mcore_infer.errors import ContextLengthError, OverloadedError, RequestFailed

    e = decode_error("r", encode_error(ContextLengthError("too long", "max_tokens")))
    assert isinstance(e, ContextLengthError) and e.param == "max_tokens" and e.code == "context_length_exceeded"
    assert isinstance(decode_error("r", encode_error(OverloadedError("full"))), OverloadedError)
    e2 = decode_error("r", encode_error(InvalidRequestError("bad", "top_k")))
    assert type(e2) is InvalidRequestError and e2.param == "top_k"
    assert isinstance(decode_error("r", encode_error(ZeroDivisionError("x"))), RequestFailed)


def test_shutdown_leaves_no_process() -> None:
    client = EngineClient(EngineSpec(build_tiny_llm)).launch()
    pid = client.pid
    assert pid is not None and client.healthy

    async def run() -> str:
        text = ""
        async for out in client.generate([72, 105], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)):
            text += out.new_text
        with pytest.raises(InvalidRequestError):
            async for _ in client.generate([], SamplingParams(max_tokens=4)):
                pass
        return text

    assert len(asyncio.run(run())) > 0
    client.shutdown(timeout=2.0)
    assert not client.healthy and not client._proc.is_alive() and client._proc.exitcode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_killed_engine_answers_503(srv: Server) -> None:
    """Last in the module: it kills the shared engine process."""
    body = {**GREEDY, "max_tokens": 240}
    with ThreadPoolExecutor(2) as pool:
        waiting = pool.submit(srv.http.post, "/v1/completions", json=body)
        streaming = pool.submit(lambda: srv.http.post("/v1/completions", json={**body, "stream": True}).text)
        end = time.monotonic() + 10
        while srv.http.get("/health").json().get("running", 0) < 2 and time.monotonic() < end:
            time.sleep(0.01)
        os.kill(srv.engine.pid, signal.SIGKILL)
        assert_openai_error(waiting.result(timeout=30), 503)
        events = [e.removeprefix("data: ") for e in streaming.result(timeout=30).split("\n\n") if e]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    assert assert_openai_error(srv.http.post("/v1/completions", json=GREEDY), 503)["code"] == "engine_unavailable"
    assert assert_openai_error(srv.http.get("/health"), 503)["code"] == "engine_unavailable"
    with pytest.raises(openai.APIStatusError) as e:
        srv.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.status_code == 503
    with pytest.raises(EngineDeadError):
        asyncio.run(_first(srv.engine))
    srv.engine.shutdown(1.0)  # joins the dead process at once


async def _first(client: EngineClient) -> None:
    async for _ in client.generate([1, 2], SamplingParams(max_tokens=2)):
        pass


def test_cli_serves_from_an_engine_process_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    """``serve`` at --tp 1 builds its engine in an engine process: a bad checkpoint is reported from there as a user
    error (exit code 2, one line), not as a traceback."""
    from mcore_infer.cli import main

    assert main(["serve", "--checkpoint", "/nonexistent/run", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "the engine process could not start" in err and "/nonexistent/run" in err and "Traceback" not in err
