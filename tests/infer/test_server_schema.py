"""Property test of the request schema: bodies for ``/v1/completions`` and ``/v1/chat/completions`` drawn over every
field the server reads (valid and invalid types and values, extremes, unknown fields) and raw bodies that are not
JSON objects. Whatever comes in: no 5xx, every error an OpenAI error body, every 200 a valid completion object or
a valid event stream ending in ``[DONE]``, and the engine still serves its usual text with every KV block free.
uvicorn in a thread, on CPU (the server fixture of ``test_server_robust``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from tests.infer.test_server_robust import Server, parse_prometheus

SETTINGS = settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False
)


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


# ----------------------------------------------------------------------------------------------- strategies
HUGE = [2**63, -(2**63) - 1, 2**64, 10**30, -(10**30)]
NASTY = st.sampled_from(["", "NaN", "nan", "inf", "-Infinity", "1e309", "0x10", "null", "true", " 1", "\u0000"])
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(HUGE),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),  # NaN / Infinity are sent as JSON's invalid constants
    NASTY,
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.just({}),
    st.dictionaries(st.text(max_size=4), st.integers(-2, 2), max_size=2),
)


def short(v: Any) -> bool:
    """Not a valid max_tokens that would run long (chat's default, null, is the whole context: see ``body``)."""
    return not (isinstance(v, int) and not isinstance(v, bool) and 8 < v < 256)


MAX_TOKENS = (st.integers(1, 8), st.one_of(st.sampled_from([0, -1, 2**62, 10**6, 1.5, "4"]), JUNK.filter(short)))
TEXT = st.text(min_size=1, max_size=20)
IDS = st.lists(st.integers(0, 258), min_size=1, max_size=6)
BAD_IDS = st.lists(st.one_of(st.integers(0, 258), st.sampled_from([-1, 259, 2**70, 1.0, True, "a"])), max_size=6)
CONTENT = st.one_of(
    st.text(max_size=12),
    st.none(),
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2),
)
BAD_CONTENT = st.one_of(
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["image_url", "", "TEXT"]), "text": JUNK}), min_size=1),
    st.lists(JUNK, min_size=1, max_size=2),
    JUNK.filter(lambda v: v is not None and not isinstance(v, (str, list))),
)
ROLE = st.sampled_from(["system", "user", "assistant", "tool", "developer"])
MESSAGES = st.lists(
    st.fixed_dictionaries({"role": ROLE, "content": CONTENT}, optional={"name": TEXT}), min_size=1, max_size=3
)
BAD_MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["bot", "", "USER", "function"]), JUNK), "content": CONTENT}
    ),
    st.fixed_dictionaries({"role": ROLE, "content": BAD_CONTENT}),
    st.fixed_dictionaries({}, optional={"content": CONTENT}),
    JUNK,
)

# every field the server reads: (valid values, invalid values); invalid ones also draw from JUNK
COMMON: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "model": (st.just("tiny"), st.sampled_from(["", "gpt-4", "tiny ", "TINY"])),
    "temperature": (st.one_of(st.just(0), st.floats(0, 2), st.just(1e-45)), st.sampled_from([2.0000001, -1e-9, 1e300])),
    "top_p": (st.floats(0, 1, exclude_min=True), st.sampled_from([0.0, 1.0000001, -1.0, 5e-324 * -1])),
    "top_k": (st.one_of(st.integers(-1, 300), st.sampled_from([2**31, 2**62, 2**63 - 1])), st.integers(-(2**63), -2)),
    "min_p": (st.floats(0, 1), st.sampled_from([-0.1, 1.5])),
    "repetition_penalty": (st.one_of(st.floats(0, 3, exclude_min=True), st.sampled_from([1e-300, 1e300])),
                           st.sampled_from([0.0, -1.0, 0])),
    "presence_penalty": (st.floats(-2, 2), st.sampled_from([-2.0001, 3.0])),
    "frequency_penalty": (st.floats(-2, 2), st.sampled_from([-2.0001, 3.0])),
    "seed": (st.integers(-(2**63), 2**63 - 1), st.sampled_from([2**63, -(2**63) - 1, 1.0, "7"])),
    "n": (st.integers(1, 3), st.sampled_from([0, -1, 17, 2**63 - 1, 2.0])),
    "best_of": (st.just(1), st.integers(0, 3)),
    "stream": (st.booleans(), st.sampled_from([1, 0, "true", "false"])),
    "stream_options": (st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
                       st.one_of(st.sampled_from(["yes", [1], True]), st.fixed_dictionaries({"include_usage": JUNK}))),
    "stop": (st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=4)),
             st.one_of(st.lists(st.text(max_size=2), min_size=17, max_size=20), st.lists(JUNK, min_size=1, max_size=2))),
    "stop_token_ids": (st.lists(st.integers(0, 258), max_size=3), BAD_IDS),
    "ignore_eos": (st.booleans(), st.sampled_from([1, "yes"])),
    "min_tokens": (st.integers(0, 8), st.sampled_from([-1, 2**63 - 1])),
    "user": (st.text(max_size=5), JUNK),
    "logit_bias": (st.just({}), st.dictionaries(st.sampled_from(["1", "42"]), st.integers(-100, 100), min_size=1)),
    "response_format": (st.just({}), st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
    "tools": (st.just([]), st.just([{"type": "function", "function": {"name": "f"}}])),
    "functions": (st.just([]), st.just([{"name": "f"}])),
    "suffix": (st.just(""), st.text(min_size=1, max_size=3)),
}  # fmt: skip
COMPLETIONS = {
    **COMMON,
    "prompt": (st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=3), IDS, st.lists(IDS, min_size=1, max_size=2)),
               st.one_of(st.sampled_from(["", [], [[]], [""]]), st.text(alphabet="ab<|>", min_size=256, max_size=300),
                         BAD_IDS, st.lists(BAD_IDS, min_size=1, max_size=2), st.lists(JUNK, min_size=1, max_size=2))),
    "max_tokens": MAX_TOKENS,  # omitted: 16 (short enough)
    "echo": (st.booleans(), st.sampled_from([1, "no"])),
    "logprobs": (st.one_of(st.integers(0, 5), st.just(20)), st.sampled_from([21, -1, True, 1.5])),
}  # fmt: skip
CHAT = {
    **COMMON,
    "messages": (MESSAGES, st.one_of(st.just([]), st.lists(BAD_MESSAGE, min_size=1, max_size=2), JUNK)),
    "max_tokens": (MAX_TOKENS[0], MAX_TOKENS[1].filter(lambda v: v is not None)),  # chat's null: the whole context
    "max_completion_tokens": MAX_TOKENS,  # null: max_tokens is used
    "logprobs": (st.booleans(), st.sampled_from([1, "true"])),
    "top_logprobs": (st.integers(0, 5), st.sampled_from([-1, 21, 1.5])),
}
UNKNOWN = st.dictionaries(st.text(min_size=1, max_size=6).filter(lambda k: k not in CHAT and k not in COMPLETIONS),
                          JUNK, max_size=2)  # fmt: skip


@st.composite
def body(draw: st.DrawFn, chat: bool, corrupt: bool = True) -> dict[str, Any]:
    """A body of valid values for ``model``, the prompt or messages, ``stream``, ``max_tokens`` (chat) and some
    other fields; when ``corrupt``, in half the bodies one to three fields then get an invalid value or go missing,
    and there may be unknown fields."""
    fields = CHAT if chat else COMPLETIONS
    required = ["model", "messages", "max_tokens", "stream"] if chat else ["model", "prompt", "stream"]
    names = draw(st.lists(st.sampled_from(sorted(set(fields) - set(required))), max_size=6, unique=True))
    b = {k: draw(fields[k][0]) for k in [*required, *names]}
    bad = st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3)
    for k in draw(st.one_of(st.just([]), bad)) if corrupt else []:
        if k != "max_tokens" or not chat:
            b.pop(k, None)
        if draw(st.integers(0, 5)):  # else: the field goes missing
            b[k] = draw(st.one_of(fields[k][1], fields[k][1], JUNK.filter(short)))
    if chat and (b["max_tokens"] is None or not short(b["max_tokens"])):  # drawn as a corruption
        b["max_tokens"] = 4
    return {**draw(UNKNOWN), **b} if corrupt else b


RAW = st.one_of(
    st.binary(max_size=40),
    st.text(max_size=40).map(str.encode),
    st.sampled_from([b"", b"[]", b"null", b"1", b'"x"', b"{", b'{"model": "tiny",}', b"{'model': 'tiny'}",
                     b'{"model": "tiny", "prompt": "x", "max_tokens": Infinity}', b"\xef\xbb\xbf{}",
                     b'{"model": "tiny", "prompt": "x"}garbage', b'{"model": "tiny", "messages": [{"role": "user"']),
    st.lists(JUNK, max_size=3).map(lambda v: json.dumps(v).encode()),
)  # fmt: skip


# ------------------------------------------------------------------------------------------------- checks
def check_error(r: httpx.Response) -> None:
    assert r.headers["content-type"].startswith("application/json"), (r.status_code, r.text)
    doc = r.json()
    assert set(doc) == {"error"}, doc
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err


def check_choice(c: dict[str, Any], chat: bool, streamed: bool) -> None:
    assert isinstance(c["index"], int) and c["index"] >= 0
    if chat and streamed:
        assert isinstance(c["delta"], dict) and all(isinstance(v, str) for v in c["delta"].values())
    elif chat:
        assert c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
    else:
        assert isinstance(c["text"], str)
    assert c["finish_reason"] in ({None} if streamed else set()) | {"stop", "length"}, c
    lp = c.get("logprobs")
    assert lp is None or isinstance(lp, dict)


def check_usage(u: dict[str, Any]) -> None:
    assert all(isinstance(u[k], int) and u[k] >= 0 for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def check_ok(r: httpx.Response, chat: bool) -> None:
    obj = "chat.completion" if chat else "text_completion"
    if r.headers["content-type"].startswith("text/event-stream"):
        lines = [line for line in r.text.split("\n") if line]
        assert lines and lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines), r.text
        events = [json.loads(line[6:]) for line in lines[:-1]]
        assert events and not any("error" in e for e in events), events
        ends: dict[int, str] = {}
        for e in events:
            assert e["object"] == (obj + ".chunk" if chat else obj) and isinstance(e["id"], str)
            for c in e["choices"]:
                check_choice(c, chat, streamed=True)
                if c["finish_reason"] is not None:
                    assert c["index"] not in ends, "two finishing events for one choice"
                    ends[c["index"]] = c["finish_reason"]
            if e.get("usage") is not None:
                check_usage(e["usage"])
        assert ends and sorted(ends) == list(range(len(ends))), events  # every choice finished
        return
    doc = r.json()
    assert doc["object"] == obj and isinstance(doc["id"], str) and doc["model"] == "tiny", doc
    assert doc["choices"] and [c["index"] for c in doc["choices"]] == list(range(len(doc["choices"])))
    for c in doc["choices"]:
        check_choice(c, chat, streamed=False)
    check_usage(doc["usage"])


def post(srv: Server, path: str, content: bytes, count: bool = True) -> httpx.Response:
    r = srv.http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, content[:400], r.status_code, r.text[:400])
    if count:
        event(f"{r.status_code} {r.headers['content-type'].split(';')[0]}")
    if r.status_code == 200:
        check_ok(r, chat=path.endswith("chat/completions"))
    else:
        check_error(r)
        assert 400 <= r.status_code < 500
    return r


def after(srv: Server) -> None:
    """The engine lives on and is idle (checked after every example, so that a failure shrinks to its cause)."""
    assert srv.idle(), f"{srv.llm.runner.blocks.num_free} of {srv.llm.runner.blocks.capacity} KV blocks free"
    assert srv.http.get("/health").status_code == 200


# -------------------------------------------------------------------------------------------------- tests
@SETTINGS
@given(b=body(chat=False))
def test_completions_any_body(srv: Server, b: dict[str, Any]) -> None:
    post(srv, "/v1/completions", json.dumps(b).encode())
    after(srv)


@SETTINGS
@given(b=body(chat=True))
def test_chat_any_body(srv: Server, b: dict[str, Any]) -> None:
    post(srv, "/v1/chat/completions", json.dumps(b).encode())
    after(srv)


@settings(SETTINGS, max_examples=40)
@given(raw=RAW, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_raw_bodies(srv: Server, raw: bytes, path: str) -> None:
    r = post(srv, path, raw)
    assert r.status_code in (400, 404), r.text  # none of these is a whole valid request
    after(srv)


def merge_stream(r: httpx.Response, chat: bool) -> dict[str, Any]:
    """A streamed response as the non-streamed one it must equal: each choice's text (or content) and logprobs
    concatenated in event order, its finish reason, and the usage."""
    events = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
    choices: dict[int, dict[str, Any]] = {}
    for e in events:
        for c in e["choices"]:
            m = choices.setdefault(c["index"], {"index": c["index"], "text": "", "logprobs": None})
            m["text"] += c["delta"].get("content", "") if chat else c["text"]
            m["finish_reason"] = c["finish_reason"]
            if c.get("logprobs"):
                lp = m["logprobs"] = m["logprobs"] or {}
                for k, v in c["logprobs"].items():
                    lp[k] = lp.get(k, []) + v
    usage = next(e["usage"] for e in events if e.get("usage"))
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


@SETTINGS
@given(b=st.one_of(body(chat=False, corrupt=False), body(chat=True, corrupt=False)))
def test_a_stream_equals_the_whole_answer(srv: Server, b: dict[str, Any]) -> None:
    """Greedy: the streamed choices (text, logprobs, finish reason) and usage are the non-streamed ones."""
    chat = "messages" in b
    path = "/v1/chat/completions" if chat else "/v1/completions"
    assume(not (b.get("echo") and b.get("logprobs") is not None))  # test_streamed_echo_has_the_prompt_logprobs
    b = {**b, "temperature": 0, "stream": False}
    b.pop("stream_options", None)
    whole = post(srv, path, json.dumps(b).encode())
    streamed = post(srv, path, json.dumps({**b, "stream": True, "stream_options": {"include_usage": True}}).encode())
    assert streamed.status_code == whole.status_code
    if whole.status_code != 200:
        return
    want = whole.json()
    for c in want["choices"]:
        if chat:
            c["text"] = c.pop("message")["content"]
    got = merge_stream(streamed, chat)
    assert got["usage"] == want["usage"]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in got["choices"]] == [
        (c["index"], c["text"], c["finish_reason"]) for c in want["choices"]
    ]
    for g, w in zip(got["choices"], want["choices"]):
        assert (g["logprobs"] is None) == (w["logprobs"] is None)
        if w["logprobs"] is not None:
            assert json.loads(json.dumps(g["logprobs"]), parse_float=lambda x: round(float(x), 3)) == json.loads(
                json.dumps(w["logprobs"]), parse_float=lambda x: round(float(x), 3)
            )
    after(srv)


def test_streamed_echo_has_the_prompt_logprobs(srv: Server) -> None:
    b = {"model": "tiny", "prompt": "hi there", "max_tokens": 3, "logprobs": 1, "echo": True, "temperature": 0}
    want = post(srv, "/v1/completions", json.dumps(b).encode(), count=False).json()["choices"][0]["logprobs"]
    r = post(srv, "/v1/completions", json.dumps({**b, "stream": True}).encode(), count=False)
    got = merge_stream_lp(r)
    after(srv)
    assert want["token_logprobs"][1] is not None  # the non-streamed answer has them
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-4)
    assert got["top_logprobs"][1:] == [pytest.approx(t, abs=1e-4) for t in want["top_logprobs"][1:]]


def merge_stream_lp(r: httpx.Response) -> dict[str, list[Any]]:
    events = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: {")]
    lp: dict[str, list[Any]] = {}
    for c in (c for e in events for c in e["choices"]):
        for k, v in c["logprobs"].items():
            lp[k] = lp.get(k, []) + v
    return lp


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_deeply_nested_json_is_a_400(srv: Server, path: str) -> None:
    deep = b'{"model": "tiny", "max_tokens": 1, "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = post(srv, path, deep, count=False)
    assert r.status_code == 400
    after(srv)


def test_a_request_larger_than_the_queue_is_a_400(srv: Server) -> None:
    queue = srv.llm.engine.max_queue
    b = {"model": "tiny", "prompt": ["a"] * (queue // 16 + 1), "n": 16, "max_tokens": 1}
    r = post(srv, "/v1/completions", json.dumps(b).encode(), count=False)
    assert r.status_code == 400, r.text
    after(srv)


def test_oversized_body_is_a_413(srv: Server) -> None:
    big = json.dumps({"model": "tiny", "prompt": "x" * (9 << 20), "max_tokens": 1}).encode()
    r = post(srv, "/v1/completions", big, count=False)
    assert r.status_code == 413
    after(srv)


def test_engine_alive_and_idle_after_the_run(srv: Server) -> None:
    srv.still_serves()
    assert srv.idle()
    m = parse_prometheus(srv.http.get("/metrics").text)
    assert m["mcore_infer_kv_blocks_used"] == 0 and m["mcore_infer_requests_running"] == 0
    assert m["mcore_infer_healthy"] == 1
