"""The streamed responses themselves: every event is the JSON ``json.dumps`` writes of it (the templates of the
common chunks included, across texts that need escaping, finish and stop reasons), the headers a proxy needs, and a
client that hangs up while its request still waits in the queue has it aborted. uvicorn in a thread, on CPU."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.infer.test_server_robust import Server

# one running request at a time: a second one waits in the queue
CFG = dict(block_size=16, num_blocks=64, max_num_seqs=1, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = Server(CFG)
    yield s
    s.close()


def events(srv: Server, route: str, body: dict[str, Any]) -> tuple[httpx.Headers, list[str]]:
    with srv.http.stream("POST", route, json={"model": "tiny", "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return r.headers, lines[:-1]


def assert_canonical(lines: list[str]) -> list[dict[str, Any]]:
    objs = [json.loads(line) for line in lines]
    for line, obj in zip(lines, objs):
        assert json.dumps(obj) == line  # byte for byte what json.dumps writes of the object
    return objs


@pytest.mark.parametrize(
    "extra",
    [
        {"max_tokens": 12, "temperature": 0, "ignore_eos": True},
        {"max_tokens": 12, "temperature": 0.9, "seed": 3, "ignore_eos": True},  # bytes that need \\u escapes
        {"max_tokens": 20, "temperature": 0, "stop": ["e"]},  # a stop string: stop_reason "e"
        {"max_tokens": 20, "temperature": 0, "logprobs": 2, "echo": True},  # the path without a template
    ],
)
def test_completion_events_are_canonical_json(srv: Server, extra: dict[str, Any]) -> None:
    headers, lines = events(srv, "/v1/completions", {"prompt": 'Hello é\n"x"', **extra})
    assert headers["content-type"] == "text/event-stream; charset=utf-8"
    assert headers["cache-control"] == "no-cache" and headers["x-accel-buffering"] == "no"
    objs = assert_canonical(lines)
    assert [list(o) for o in objs] == [["id", "object", "created", "model", "choices"]] * len(objs)
    last = objs[-1]["choices"][0]
    assert last["finish_reason"] in ("stop", "length")
    if "stop" in extra and last["finish_reason"] == "stop":
        assert last["stop_reason"] == "e"
    want = srv.http.post("/v1/completions", json={"model": "tiny", "prompt": 'Hello é\n"x"', **extra}).json()
    assert "".join(o["choices"][0]["text"] for o in objs) == want["choices"][0]["text"]


def test_completion_stop_token_id_is_an_integer_stop_reason(srv: Server) -> None:
    from mcore_infer import SamplingParams

    ids = srv.ref("Hi", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)).token_ids
    stop_id = ids[2]
    body = {"prompt": "Hi", "max_tokens": 8, "temperature": 0, "stop_token_ids": [stop_id], "ignore_eos": True}
    objs = assert_canonical(events(srv, "/v1/completions", body)[1])
    last = objs[-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == stop_id


@pytest.mark.parametrize("extra", [{}, {"logprobs": True, "top_logprobs": 2}, {"n": 2, "seed": 1, "temperature": 1}])
def test_chat_events_are_canonical_json(srv: Server, extra: dict[str, Any]) -> None:
    body = {"messages": [{"role": "user", "content": 'Say "é"\n'}], "max_tokens": 10, "temperature": 0, **extra}
    objs = assert_canonical(events(srv, "/v1/chat/completions", body)[1])
    deltas = [c for o in objs for c in o["choices"]]
    assert all(list(c) == ["index", "delta", "logprobs", "finish_reason"] for c in deltas)
    assert {c["index"] for c in deltas if c["finish_reason"] is not None} == set(range(extra.get("n", 1)))


def test_a_client_that_hangs_up_while_queued_is_aborted(srv: Server) -> None:
    engine = srv.llm.engine
    aborted = engine.num_aborted
    long = {"model": "tiny", "prompt": "a long one", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with srv.http.stream("POST", "/v1/completions", json=long) as first:
        lines = first.iter_lines()  # (held: a dropped iterator closes the response)
        next(lines)  # running now: the one slot is taken
        with srv.http.stream("POST", "/v1/completions", json={**long, "prompt": "queued"}) as second:
            assert second.status_code == 200  # the headers are out; the request waits for the slot
            deadline = time.monotonic() + 5
            while engine.num_waiting < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engine.num_waiting == 1
        # the second client is gone before its first token: its request leaves the queue at once
        deadline = time.monotonic() + 5
        while engine.num_aborted < aborted + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (engine.num_aborted, engine.num_waiting, engine.num_running) == (aborted + 1, 0, 1)
    assert srv.idle() and engine.num_aborted == aborted + 2
    srv.still_serves()
