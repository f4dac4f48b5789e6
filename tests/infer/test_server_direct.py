"""The completion routes dispatched without FastAPI's middleware (:class:`mcore_infer.server.app.ServingApp`) answer
exactly as the routed path does: the same statuses, headers and bodies for good requests, streams, bad requests and
a bug in a handler; every other route still goes through the middleware."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from mcore_infer import LLM, EngineConfig
from mcore_infer.async_engine import AsyncEngine
from mcore_infer.server import build_app, completions
from tests.infer._tiny import tiny_model

GREEDY = {"model": "tiny", "prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
CASES: list[tuple[str, Any]] = [
    ("/v1/completions", GREEDY),
    ("/v1/completions", {**GREEDY, "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/v1/completions", {**GREEDY, "temperature": 3.0}),  # 400, param named
    ("/v1/completions", {**GREEDY, "model": "other"}),  # 404 unknown model
    ("/v1/completions", b"{not json"),  # 400 body
    ("/v1/chat/completions", {"model": "tiny", "messages": "nope"}),  # 400
]


class Counting:
    """ASGI middleware counting the HTTP requests that pass through FastAPI's middleware stack."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            COUNTED.append(scope["path"])
        await self.app(scope, receive, send)


COUNTED: list[str] = []


@pytest.fixture(scope="module")
def client() -> Iterator[tuple[TestClient, Any]]:
    llm = LLM(model=tiny_model(max_position_embeddings=256),
              config=EngineConfig(block_size=16, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=128))  # fmt: skip
    app = build_app(AsyncEngine(llm.engine), llm.tokenizer, "tiny", shutdown_timeout=2.0)
    app.add_middleware(Counting)
    with TestClient(app) as c:
        yield c, app


def _normal(text: str) -> Any:
    """A body without what differs between two answers to one request (ids, timestamps)."""

    def strip(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k not in ("id", "created", "system_fingerprint")}
        return [strip(x) for x in v] if isinstance(v, list) else v

    if text.startswith("data: "):  # a stream: how tokens fall into events depends on timing, the text does not
        events = [e for e in text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        texts: dict[int, str] = {}
        ends: dict[int, Any] = {}
        for ch in chunks:
            for choice in ch["choices"]:
                piece = choice.get("text", choice.get("delta", {}).get("content")) or ""
                texts[choice["index"]] = texts.get(choice["index"], "") + piece
                ends[choice["index"]] = choice["finish_reason"] or ends.get(choice["index"])
        return {ch["object"] for ch in chunks}, texts, ends, [ch.get("usage") for ch in chunks if ch.get("usage")]
    return strip(json.loads(text))


def _post(c: TestClient, path: str, body: Any) -> tuple[int, str, str, str]:
    r = c.post(path, content=body) if isinstance(body, bytes) else c.post(path, json=body)
    return r.status_code, r.headers["content-type"], r.headers.get("connection", ""), r.text


@pytest.mark.parametrize("path,body", CASES)
def test_direct_dispatch_answers_as_the_routed_path(client: tuple[TestClient, Any], path: str, body: Any) -> None:
    c, app = client
    assert set(app.direct_routes) == {"/v1/completions", "/v1/chat/completions"}
    COUNTED.clear()
    direct = _post(c, path, body)
    assert COUNTED == []  # no middleware crossed
    saved, app.direct_routes = app.direct_routes, {}
    try:
        routed = _post(c, path, body)
    finally:
        app.direct_routes = saved
    assert [path] == COUNTED
    assert direct[:3] == routed[:3]
    assert _normal(direct[3]) == _normal(routed[3])


def test_a_bug_in_a_direct_handler_is_a_json_500_that_closes_the_connection(
    client: tuple[TestClient, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    c, _ = client

    def broken(*_: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(completions, "_parse", broken)
    status, kind, connection, text = _post(c, "/v1/completions", GREEDY)
    assert (status, kind, connection) == (500, "application/json", "close")
    assert json.loads(text)["error"]["code"] == "internal_error" and "RuntimeError" in text
    assert any("exception in POST /v1/completions" in r.message for r in caplog.records)
    monkeypatch.undo()
    assert _post(c, "/v1/completions", GREEDY)[0] == 200  # and serves on


def test_other_routes_and_methods_go_through_fastapi(client: tuple[TestClient, Any]) -> None:
    c, _ = client
    COUNTED.clear()
    assert c.get("/v1/models").status_code == 200
    r = c.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert COUNTED == ["/v1/models", "/v1/completions"]
