"""The server under load: 64 concurrent streaming clients, completions and chat mixed, a third of them hanging up
mid-stream, on a KV cache small enough that requests queue and get preempted. Every client that stays gets a
whole, well-formed stream with exactly the greedy text the reference engine gives; nothing is a 5xx; afterwards
every KV block is free, ``/metrics`` says so and a normal request gets the text it got before. uvicorn in a
thread, on CPU."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from mcore_infer import SamplingParams
from mcore_infer.protocol import CHAT_STOP, apply_chat_template
from tests.infer.test_engine_process import Server as EngineProcessServer
from tests.infer.test_server_robust import Server, parse_prometheus

# 11 usable blocks of 16 tokens, up to 16 running: 64 requests of 1-3 blocks each queue and preempt each other
CFG = dict(block_size=16, num_blocks=12, max_num_seqs=16, max_num_batched_tokens=128)
CLIENTS = 64
FIXED = {"model": "tiny", "prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


class LoadServer(Server):
    """``Server`` (the app under ``serve``'s uvicorn config and a reference engine) over a small cache."""

    def __init__(self) -> None:
        super().__init__(CFG)

    def fixed_text(self) -> str:
        r = self.http.post("/v1/completions", json=FIXED)
        assert r.status_code == 200, r.text
        text: str = r.json()["choices"][0]["text"]
        return text

    def used_blocks(self) -> int:
        blocks = self.llm.runner.blocks
        return blocks.capacity - blocks.num_free

    def idle(self, timeout: float = 10.0) -> bool:
        return super().idle(timeout)


@pytest.fixture(scope="module")
def srv() -> Iterator[LoadServer]:
    s = LoadServer()
    yield s
    s.close()


@contextmanager
def held_until_all_arrive(engine: Any, n: int, timeout: float = 30.0) -> Iterator[None]:
    """Hold the engine's steps until ``n`` requests have been added (or ``timeout`` s have passed), so that the load
    meets the small cache all at once and queues and preempts, however fast the front end hands requests over on
    a loaded machine (a trickle of requests each finishing before the next arrives would preempt nothing)."""
    arrived = threading.Semaphore(0)
    add_request, step = engine.add_request, engine.step
    held = [True]

    def counting_add_request(*args: Any, **kwargs: Any) -> Any:
        arrived.release()
        return add_request(*args, **kwargs)

    def held_step() -> Any:
        if held[0]:
            deadline = time.monotonic() + timeout
            for _ in range(n):
                arrived.acquire(timeout=max(0.0, deadline - time.monotonic()))
            held[0] = False
        return step()

    engine.add_request, engine.step = counting_add_request, held_step
    try:
        yield
    finally:
        del engine.add_request, engine.step


@dataclass
class Client:
    """One client's request, what the reference engine says it must get, and what it got."""

    route: str
    body: dict[str, Any]
    want_text: str
    want_tokens: int
    hang_up_after: int | None  # events to read before closing the response; None: read it all
    status: int | None = None
    events: list[Any] = field(default_factory=list)
    done: bool = False


WORDS = ["alpha", "beta", "gamma", "delta", "omega", "zeta", "kappa", "sigma"]


def _hang_up_after(i: int) -> int | None:
    """A third of the clients hang up after 1, 2 or 3 events."""
    return 1 + i // 3 % 3 if i % 3 == 1 else None


def make_clients(srv: LoadServer) -> list[Client]:
    """64 requests, completions and chat alternating, each with its own prompt and max_tokens, their references
    generated in one batch by the reference engine."""
    specs: list[tuple[str, dict[str, Any], str, SamplingParams]] = []
    for i in range(CLIENTS):
        # 4..12; a client that hangs up asks for many more, so that its request still runs when it hangs up (its
        # abort is then certain, however fast the engine runs compared with the front end)
        max_tokens = 120 if _hang_up_after(i) is not None else 4 + i % 9
        word = f"{WORDS[i % len(WORDS)]} {i}"
        usage = {"stream_options": {"include_usage": True}} if i % 4 < 2 else {}
        common = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0, "stream": True, **usage}
        if i % 2 == 0:
            body = {**common, "prompt": f"{word}:", "ignore_eos": i % 3 != 0}
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=i % 3 != 0)
            specs.append(("/v1/completions", body, f"{word}:", params))
        else:
            msgs = [{"role": "user", "content": word}]
            body = {**common, "messages": msgs, "ignore_eos": True}
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop=list(CHAT_STOP))
            specs.append(("/v1/chat/completions", body, apply_chat_template(msgs), params))
    refs = srv.reference.generate([s[2] for s in specs], [s[3] for s in specs])
    return [
        Client(route, body, ref.outputs[0].text, ref.outputs[0].num_output_tokens, _hang_up_after(i))
        for i, ((route, body, _, _), ref) in enumerate(zip(specs, refs))
    ]


async def run_client(http: httpx.AsyncClient, c: Client, start: asyncio.Event) -> None:
    await start.wait()
    async with http.stream("POST", c.route, json=c.body) as r:
        c.status = r.status_code
        if r.status_code != 200:
            c.events.append((await r.aread()).decode())
            return
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                c.done = True
                continue
            assert not c.done, "an event after [DONE]"
            c.events.append(json.loads(line[6:]))
            if c.hang_up_after is not None and len(c.events) >= c.hang_up_after:
                return  # leaving the context closes the response (and its connection) mid-stream


async def run_all(srv: LoadServer, clients: list[Client]) -> None:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=srv.url, timeout=60, limits=limits) as http:
        start = asyncio.Event()
        tasks = [asyncio.create_task(run_client(http, c, start)) for c in clients]
        await asyncio.sleep(0)
        start.set()
        await asyncio.gather(*tasks)


def check_stream(c: Client) -> None:
    """A whole stream: events of one id and object, text (or content deltas) equal to the reference, the last
    choice event with its finish_reason, the usage event last when asked for, then ``[DONE]``."""
    assert c.done, f"{c.route} {c.body}: no [DONE] (events: {c.events})"
    assert not any("error" in e for e in c.events), c.events
    chat = c.route == "/v1/chat/completions"
    obj = "chat.completion.chunk" if chat else "text_completion"
    assert {e["object"] for e in c.events} == {obj} and len({e["id"] for e in c.events}) == 1
    choices = [ch for e in c.events for ch in e["choices"]]
    assert all(ch["index"] == 0 for ch in choices)
    if chat:
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(ch["delta"].get("content", "") for ch in choices[1:])
    else:
        text = "".join(ch["text"] for ch in choices)
    assert text == c.want_text, (c.route, c.body)
    assert choices[-1]["finish_reason"] in {"length", "stop"}
    assert all(ch["finish_reason"] is None for ch in choices[:-1])
    if c.body.get("stream_options"):
        assert c.events[-1]["choices"] == [] and c.events[-1]["usage"]["completion_tokens"] == c.want_tokens
    else:
        assert all("usage" not in e or e["usage"] is None for e in c.events)


def test_64_streaming_clients_a_third_hanging_up(srv: LoadServer) -> None:
    before = srv.fixed_text()
    clients = make_clients(srv)
    preemptions0 = srv.llm.engine.scheduler.num_preemptions
    aborted0 = parse_prometheus(srv.http.get("/metrics").text)["mcore_infer_requests_aborted_total"]
    with held_until_all_arrive(srv.llm.engine, CLIENTS):
        asyncio.run(asyncio.wait_for(run_all(srv, clients), timeout=120))  # a hang fails, not a slow machine

    assert all(c.status == 200 for c in clients), [(c.status, c.events) for c in clients if c.status != 200]
    stayed = [c for c in clients if c.hang_up_after is None]
    assert len(stayed) == CLIENTS - CLIENTS // 3
    for c in stayed:
        check_stream(c)
    assert srv.idle(), f"{srv.used_blocks()} KV blocks still used after the load"
    m = parse_prometheus(srv.http.get("/metrics").text)
    assert m["mcore_infer_requests_running"] == m["mcore_infer_requests_waiting"] == 0
    assert m["mcore_infer_kv_blocks_used"] == 0 and m["mcore_infer_kv_blocks_free"] == srv.llm.runner.blocks.capacity
    assert m["mcore_infer_healthy"] == 1
    # the load did queue and preempt (else the small cache tested nothing), and hung-up streams were aborted
    assert srv.llm.engine.scheduler.num_preemptions > preemptions0
    assert m["mcore_infer_requests_aborted_total"] > aborted0
    assert srv.fixed_text() == before


def build_load_llm() -> Any:
    """The engine process's LLM: the same tiny model and small cache as ``LoadServer``'s (module level: ``spawn``
    pickles it by reference)."""
    from tests.infer._tiny import tiny_llm, tiny_model

    llm = tiny_llm(tiny_model(max_position_embeddings=256), **CFG)
    llm.name = "tiny"
    return llm


class ProcessLoadServer(EngineProcessServer):
    """The same load against ``serve``'s default layout: the engine in its own process (``EngineClient``), the
    front end detokenizing the streams; what the engine holds is read through ``/metrics``."""

    def __init__(self) -> None:
        from mcore_infer import LLM, EngineConfig
        from mcore_infer.engine_process import EngineClient, EngineSpec
        from tests.infer._tiny import tiny_model

        self.reference = LLM(model=tiny_model(max_position_embeddings=256), config=EngineConfig(**CFG))
        client = EngineClient(EngineSpec(build_load_llm)).launch()
        super().__init__(client, client.tokenizer)

    fixed_text = LoadServer.fixed_text

    def metrics(self) -> dict[str, float]:
        return parse_prometheus(self.http.get("/metrics").text)

    def idle(self, timeout: float = 10.0) -> bool:
        import time

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = self.metrics()
            if m["mcore_infer_kv_blocks_used"] == 0 and m["mcore_infer_requests_running"] == 0:
                return True
            time.sleep(0.05)
        return False


def test_64_streaming_clients_through_the_engine_process() -> None:
    """The load above against the engine process: every client that stays gets the reference text (made by the
    front end for the completions streams, by the engine for the chat streams with their stop strings), hung-up
    streams are aborted in the engine process, and afterwards no KV block is held there."""
    srv = ProcessLoadServer()
    try:
        before = srv.fixed_text()
        clients = make_clients(srv)  # type: ignore[arg-type]
        aborted0 = srv.metrics()["mcore_infer_requests_aborted_total"]
        asyncio.run(asyncio.wait_for(run_all(srv, clients), timeout=120))  # type: ignore[arg-type]
        assert all(c.status == 200 for c in clients), [(c.status, c.events) for c in clients if c.status != 200]
        stayed = [c for c in clients if c.hang_up_after is None]
        for c in stayed:
            check_stream(c)
        assert srv.idle(), "KV blocks still used in the engine process after the load"
        m = srv.metrics()
        assert m["mcore_infer_requests_waiting"] == 0 and m["mcore_infer_healthy"] == 1
        assert m["mcore_infer_kv_blocks_free"] == m["mcore_infer_kv_blocks_total"]
        assert m["mcore_infer_requests_aborted_total"] > aborted0
        assert srv.fixed_text() == before
    finally:
        srv.close()
