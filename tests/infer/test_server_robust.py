"""No request can break the server: every bad request gets a 4xx (a bug a 500) with an OpenAI error body, and the
server answers the next normal request as before. Also the streamed shapes that must equal the non-streamed ones
(text offsets, stop strings), prompt scoring, ``/metrics`` and ``models.retrieve``. uvicorn in a thread, on CPU."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient

from mcore_infer import LLM, EngineConfig, SamplingParams
from mcore_infer.async_engine import AsyncEngine
from mcore_infer.protocol import CHAT_STOP, apply_chat_template
from mcore_infer.server import build_app, server_config
from mcore_infer.server.protocols import bad_request_bytes
from mcore_infer.stop_strings import held_back
from tests.infer._tiny import tiny_model

CFG = dict(block_size=16, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=128)
GREEDY = {"model": "tiny", "prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


class Server:
    """The app under ``serve``'s uvicorn config (its HTTP protocol included), and a reference engine."""

    def __init__(self, cfg: dict[str, Any] = CFG) -> None:
        model = tiny_model(max_position_embeddings=256)
        self.reference = LLM(model=model, config=EngineConfig(**cfg))
        self.llm = LLM(model=model, config=EngineConfig(**cfg))
        self.app = build_app(AsyncEngine(self.llm.engine), self.llm.tokenizer, "tiny", shutdown_timeout=2.0)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(server_config(self.app, "127.0.0.1", self.port, "critical"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=30)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)
        self.want = self.ref("Hello", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)).text

    def ref(self, prompt: str, params: SamplingParams) -> Any:
        return self.reference.generate(prompt, params)[0].outputs[0]

    def still_serves(self) -> None:
        r = self.http.post("/v1/completions", json=GREEDY)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == self.want

    def idle(self, timeout: float = 5.0) -> bool:
        end, blocks = time.monotonic() + timeout, self.llm.runner.blocks
        while time.monotonic() < end:
            if blocks.num_free == blocks.capacity and not self.llm.engine.has_work():
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        self.http.close()
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param
    return err


J = {"content-type": "application/json"}
BAD: list[tuple[str, str, str, dict[str, Any] | bytes, int, str | None]] = [
    ("non-utf8", "POST", "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None),
    ("lone-surrogate", "POST", "/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', 400, None),
    ("nan", "POST", "/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, None),
    ("seed>2^63", "POST", "/v1/completions", {**GREEDY, "seed": 2**64}, 400, "seed"),
    ("top_k>2^63", "POST", "/v1/completions", {**GREEDY, "top_k": 2**63}, 400, "top_k"),
    ("huge-float", "POST", "/v1/completions", {**GREEDY, "top_p": 10**400}, 400, "top_p"),
    ("stream_options-str", "POST", "/v1/completions", {**GREEDY, "stream": True, "stream_options": "yes"}, 400,
     "stream_options"),
    ("stream_options-list", "POST", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True, "stream_options": [1]}, 400,
     "stream_options"),
    ("include_usage-not-bool", "POST", "/v1/completions",
     {**GREEDY, "stream": True, "stream_options": {"include_usage": "yes"}}, 400, "include_usage"),
    ("temperature>2", "POST", "/v1/completions", {**GREEDY, "temperature": 2.5}, 400, "temperature"),
    ("no-model", "POST", "/v1/completions", {k: v for k, v in GREEDY.items() if k != "model"}, 400, "model"),
    ("no-model-chat", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ("min>max", "POST", "/v1/completions", {**GREEDY, "min_tokens": 7}, 400, "min_tokens"),
    ("chat-max0", "POST", "/v1/chat/completions",
     {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ("max0-no-echo", "POST", "/v1/completions", {**GREEDY, "max_tokens": 0}, 400, "max_tokens"),
    ("api-temperature", "PUT", "/api", {"prompts": ["a"], "temperature": "hot"}, 400, "temperature"),
    ("api-top_k", "PUT", "/api", {"prompts": ["a"], "top_k": "many"}, 400, "top_k"),
    ("api-seed", "PUT", "/api", {"prompts": ["a"], "random_seed": "abc"}, 400, "random_seed"),
    ("api-seed-huge", "PUT", "/api", {"prompts": ["a"], "random_seed": 2**70}, 400, "random_seed"),
    ("api-top_p-list", "PUT", "/api", {"prompts": ["a"], "top_p": [0.5]}, 400, "top_p"),
    ("unknown-route", "GET", "/v1/nope", b"", 404, None),
    ("unknown-route-post", "POST", "/v2/completions", {**GREEDY}, 404, None),
    ("wrong-method", "GET", "/v1/completions", b"", 405, None),
    ("wrong-method-api", "POST", "/api", {"prompts": ["a"]}, 405, None),
    ("unknown-model-card", "GET", "/v1/models/gpt-4", b"", 404, "model"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "body", "status", "param"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request_gets_an_openai_error_and_the_server_keeps_serving(
    srv: Server, method: str, path: str, body: dict[str, Any] | bytes, status: int, param: str | None
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = srv.http.request(method, path, content=content, headers=J)
    err = assert_openai_error(r, status, param)
    if status == 405:
        assert r.headers["allow"] and err["code"] == "method_not_allowed"
    srv.still_serves()


def test_unparsable_http_gets_a_json_400(srv: Server) -> None:
    """A bad Content-Length never reaches the app: the HTTP protocol answers it, with the same error body."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}")
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower()
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_http_request"
    framed = bad_request_bytes("bad", [(b"server", b"x")]).split(b"\r\n")
    assert framed[:2] == [b"HTTP/1.1 400 Bad Request", b"server: x"]
    assert int(framed[3].split(b": ")[1]) == len(framed[-1])  # content-length
    srv.still_serves()


def test_an_exception_in_a_handler_is_a_500_with_an_openai_body(srv: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = srv.app.state.serving
    real = ctx.tokenizer

    class Exploding:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def encode(self, text: str) -> list[int]:
            raise RuntimeError("tokenizer bug")

    monkeypatch.setattr(ctx, "tokenizer", Exploding())
    err = assert_openai_error(srv.http.post("/v1/completions", json=GREEDY), 500)
    assert err["type"] == "server_error" and "RuntimeError" in err["message"]
    monkeypatch.setattr(ctx, "tokenizer", real)
    srv.still_serves()


def test_engine_not_running_is_a_503(srv: Server) -> None:
    app = build_app(AsyncEngine(srv.llm.engine), srv.llm.tokenizer, "tiny")  # never started: no lifespan
    client = TestClient(app, raise_server_exceptions=False)
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("PUT", "/api")):
        err = assert_openai_error(client.request(method, path, json=GREEDY), 503)
        assert err["code"] == "engine_unavailable"
    assert assert_openai_error(client.get("/health"), 503)["code"] == "engine_unavailable"


def test_models_retrieve(srv: Server) -> None:
    card = srv.client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        srv.client.models.retrieve("org/other-model")
    assert e.value.code == "model_not_found"


def test_streamed_text_offsets_are_cumulative(srv: Server) -> None:
    kw: dict[str, Any] = dict(model="tiny", prompt="Hi there", max_tokens=8, temperature=0, logprobs=1, n=2,
                              extra_body={"ignore_eos": True})  # fmt: skip
    for echo in (False, True):
        whole = srv.client.completions.create(**kw, echo=echo)
        offsets: dict[int, list[int]] = {0: [], 1: []}
        for c in srv.client.completions.create(**kw, echo=echo, stream=True):
            for ch in c.choices:
                offsets[ch.index] += ch.logprobs.text_offset if ch.logprobs else []
        assert offsets == {c.index: c.logprobs.text_offset for c in whole.choices}
        assert all(a < b for a, b in zip(offsets[0], offsets[0][1:]))


def test_echo_with_max_tokens_0_scores_the_prompt(srv: Server) -> None:
    want = srv.ref("Hi there", SamplingParams(temperature=0.0, max_tokens=1, logprobs=0, echo=True))
    for stream in (False, True):
        r = srv.http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi there", "max_tokens": 0,
                                                    "echo": True, "logprobs": 0, "stream": stream})  # fmt: skip
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            choices = [c for e in events for c in e["choices"]]
            assert len(choices) == 1
            c = choices[0]
        else:
            c = r.json()["choices"][0]
            assert r.json()["usage"]["completion_tokens"] == 0
        assert c["text"] == "Hi there"
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(want.prompt_token_ids) and lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(want.prompt_logprobs[1:], abs=1e-4)
    assert srv.idle()


def test_streams_hold_back_only_a_possible_stop_prefix() -> None:
    assert held_back("abc<|us", ["<|user|>"]) == 4 and held_back("abc<", ["<|user|>", "<x"]) == 1
    assert held_back("abc", ["<|user|>"]) == 0 and held_back("", ["ab"]) == 0 and held_back("aab", ["aab"]) == 0
    assert held_back("a ST", ["STOP", "TOPS"]) == 2 and held_back("xTO", ["STOP", "TOPS"]) == 2


def test_chat_stream_sends_text_before_the_end_and_stops_like_the_engine(srv: Server) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    prompt = apply_chat_template(msgs)
    ref = srv.ref(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=CHAT_STOP)).text
    kw: dict[str, Any] = dict(
        model="tiny", messages=msgs, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    deltas = [c.choices[0].delta.content or "" for c in srv.client.chat.completions.create(**kw, stream=True)]
    assert "".join(deltas) == ref
    # the chat template's 8-character stop string held back 7 characters of every stream; now each engine step
    # emits all but what could still start a stop string (checked step by step on the engine: HTTP events may merge
    # steps when the client reads slower than the engine writes)
    eng = srv.reference.engine
    rid = eng.add_request(srv.reference.tokenizer.encode(prompt), SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, stop=CHAT_STOP), stream=True)  # fmt: skip
    sent, steps = "", 0
    while eng.has_work():
        for o in eng.step():
            if o.request_id == rid:
                sent += o.new_text
                if not o.finished:  # everything but the possible start of a stop string is out
                    text = eng._seqs[rid].text
                    assert sent == text[: len(text) - held_back(text, CHAT_STOP)]
                steps += bool(o.new_text)
    assert sent == ref and steps >= 2
    stop = next(ch for ch in ref[2:] if ch.isascii() and ch.isprintable())
    want = srv.ref(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=[stop, *CHAT_STOP]))
    chunks = list(srv.client.chat.completions.create(**kw, stop=[stop], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text == ref[: ref.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    r = srv.http.post("/v1/completions", json={**GREEDY, "prompt": prompt, "max_tokens": 10, "stop": [stop],
                                               "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["text"] for e in events for c in e["choices"]) == want.text
    assert [c.get("stop_reason") for e in events for c in e["choices"]][-1] == stop
    assert events[-1]["usage"]["completion_tokens"] == want.num_output_tokens
    assert srv.idle()  # the request ended at the stop string: its blocks are back


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*\})? (\S+)$')


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples by metric name, checking every line against the text format (HELP/TYPE comments or samples)."""
    samples: dict[str, float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in {"counter", "gauge", "histogram", "summary", "untyped"}
            types[name] = kind
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a Prometheus sample: {line!r}"
        assert m.group(1) in types, f"{m.group(1)} has no TYPE line"
        samples[m.group(1)] = float(m.group(4))
    return samples


def test_health_and_metrics_report_load_and_kv_blocks(srv: Server) -> None:
    srv.still_serves()
    assert srv.idle()
    r = srv.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    m = parse_prometheus(r.text)
    total = srv.llm.runner.blocks.capacity
    assert m["mcore_infer_kv_blocks_used"] == 0 and m["mcore_infer_kv_blocks_free"] == total
    assert m["mcore_infer_requests_running"] == m["mcore_infer_requests_waiting"] == 0
    assert m["mcore_infer_healthy"] == 1 and m["mcore_infer_engine_steps_total"] > 0
    h = srv.http.get("/health").json()
    assert h == {"status": "ok", "running": 0, "waiting": 0, "kv_blocks": {"total": total, "free": total, "used": 0}}
    # while a request runs, its blocks are counted as used: its third model call (after the prefill and one decode
    # step) waits until the metrics have shown it running
    gate, calls, real = threading.Event(), [], srv.llm.runner.execute

    def held(*a: Any, **k: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            gate.wait(30)
        return real(*a, **k)

    srv.llm.runner.execute = held  # type: ignore[method-assign]
    try:
        body = {**GREEDY, "max_tokens": 50, "stream": True, "ignore_eos": True}
        with srv.http.stream("POST", "/v1/completions", json=body) as s:  # (the headers come first)
            deadline = time.monotonic() + 20
            while True:  # from its admission until the held call, the request is running
                busy = parse_prometheus(srv.http.get("/metrics").text)
                if busy["mcore_infer_requests_running"] == 1 or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            gate.set()
            assert busy["mcore_infer_kv_blocks_used"] > 0 and busy["mcore_infer_requests_running"] == 1, busy
            assert any(line.startswith("data: {") for line in s.iter_lines())
    finally:
        gate.set()
        del srv.llm.runner.execute  # the instance attribute: the method again
    assert srv.idle() and parse_prometheus(srv.http.get("/metrics").text)["mcore_infer_kv_blocks_used"] == 0


@pytest.mark.parametrize("extreme", [{"temperature": 1e-45}, {"top_p": 5e-324, "temperature": 1.0},
                                     {"repetition_penalty": 1e-300, "temperature": 1.0}])  # fmt: skip
def test_extreme_sampling_values_are_served_and_the_engine_lives_on(srv: Server, extreme: dict[str, float]) -> None:
    """Values that once became 0 or inf in float32 and stopped the engine thread: a 200 with tokens, then /health
    is still healthy and a normal request gets its usual text."""
    r = srv.http.post("/v1/completions", json={**GREEDY, **extreme, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    assert srv.http.get("/health").status_code == 200
    srv.still_serves()
    assert srv.idle()


def test_a_request_that_fails_in_the_engine_gets_an_openai_500_and_the_others_are_served(
    srv: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = srv.llm.engine
    real = engine._append

    def append(seq: Any, *args: Any, **kw: Any) -> Any:
        if seq.params.presence_penalty == 0.125:  # the marked request
            raise RuntimeError("injected failure")
        return real(seq, *args, **kw)

    monkeypatch.setattr(engine, "_append", append)
    r = srv.http.post("/v1/completions", json={**GREEDY, "presence_penalty": 0.125})
    assert r.status_code == 500 and set(r.json()["error"]) >= {"message", "type", "code"}
    assert "injected failure" in r.json()["error"]["message"]
    r = srv.http.post("/v1/completions", json={**GREEDY, "presence_penalty": 0.125, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events and "error" in events[-1] and r.text.rstrip().endswith("data: [DONE]")
    srv.still_serves()
    assert srv.idle()
