"""The HTTP server exercised with the real ``openai`` client on localhost (uvicorn in a thread)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from mcore_infer import LLM, EngineConfig, SamplingParams
from mcore_infer.async_engine import AsyncEngine
from mcore_infer.protocol import apply_chat_template
from mcore_infer.server import build_app
from tests.infer._tiny import tiny_model

CFG = dict(block_size=16, num_blocks=160, max_num_seqs=16, max_num_batched_tokens=256)


class Server:
    def __init__(self, engine_cls: type[AsyncEngine] = AsyncEngine) -> None:
        self.model = tiny_model(max_position_embeddings=512)
        self.reference = LLM(model=self.model, config=EngineConfig(**CFG))  # same weights, its own engine
        self.llm = LLM(model=self.model, config=EngineConfig(**CFG))
        self.app = build_app(engine_cls(self.llm.engine), self.llm.tokenizer, "tiny", shutdown_timeout=2.0)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def greedy(self, prompt: str, n: int) -> str:
        p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        return self.reference.generate(prompt, p)[0].outputs[0].text

    def idle(self, timeout: float = 5.0) -> bool:
        end = time.monotonic() + timeout
        blocks = self.llm.runner.blocks
        while time.monotonic() < end:
            if blocks.num_free == blocks.capacity and not self.llm.engine.has_work():
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


def test_models_and_health(srv: Server) -> None:
    assert [m.id for m in srv.client.models.list().data] == ["tiny"]
    h = httpx.get(f"{srv.url}/health").json()
    assert h["status"] == "ok"


def test_completion_matches_engine_and_counts_usage(srv: Server) -> None:
    r = srv.client.completions.create(
        model="tiny", prompt="Hello", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == srv.greedy("Hello", 8)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 8, 13)


def test_streaming_completion_adds_up(srv: Server) -> None:
    chunks = list(
        srv.client.completions.create(
            model="tiny",
            prompt="Hello",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == srv.greedy("Hello", 8)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_n_and_multiple_prompts(srv: Server) -> None:
    r = srv.client.completions.create(model="tiny", prompt=["ab", "cde"], max_tokens=5, n=3, seed=5, temperature=1.0)
    assert sorted(c.index for c in r.choices) == list(range(6))
    assert r.usage.prompt_tokens == 5 and 6 <= r.usage.completion_tokens <= 30
    again = srv.client.completions.create(model="tiny", prompt=["ab", "cde"], max_tokens=5, n=3, seed=5)
    assert [c.text for c in r.choices] == [c.text for c in again.choices]  # seeded: reproducible


def test_logprobs_and_echo(srv: Server) -> None:
    r = srv.client.completions.create(
        model="tiny",
        prompt="Hi there",
        max_tokens=4,
        temperature=0,
        logprobs=2,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    c = r.choices[0]
    assert c.text.startswith("Hi there")
    lp = c.logprobs
    assert len(lp.tokens) == len("Hi there") + 4 and lp.token_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) <= 2 for t in lp.top_logprobs[len("Hi there") :])
    # greedy: the chosen token is the most likely one
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()), abs=1e-5)


def test_chat_plain_streaming_and_logprobs(srv: Server) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    want = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=["<|user|>", "<|system|>"])
    ref = srv.reference.generate(apply_chat_template(msgs), want)[0].outputs[0].text
    r = srv.client.chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref
    assert r.choices[0].logprobs is not None and len(r.choices[0].logprobs.content[0].top_logprobs) == 2
    assert r.usage.prompt_tokens == len(apply_chat_template(msgs).encode())
    stream = srv.client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref


def test_errors(srv: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.completions.create(model="tiny", prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.completions.create(model="tiny", prompt="x" * 600, max_tokens=1)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.completions.create(model="tiny", prompt="x" * 500, max_tokens=100)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.APIStatusError) as e413:
        srv.client.completions.create(model="tiny", prompt="x" * 5000, max_tokens=1)
    assert e413.value.status_code == 413
    with pytest.raises(openai.NotFoundError) as e:
        srv.client.completions.create(model="gpt-4", prompt="x")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}])
    assert e.value.body["param"].startswith("messages")
    r = httpx.post(f"{srv.url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert srv.idle()


def test_megatron_put_api(srv: Server) -> None:
    r = httpx.put(
        f"{srv.url}/api",
        json={"prompts": ["Hello"], "tokens_to_generate": 6, "temperature": 0.0, "logprobs": True, "ignore_eos": True},
    )
    body = r.json()
    assert r.status_code == 200 and body["text"][0] == "Hello" + srv.greedy("Hello", 6)
    assert len(body["logprobs"][0]) == 4 + 6
    bad = httpx.put(f"{srv.url}/api", json={"prompts": "Hello"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompts"


def test_32_concurrent_requests(srv: Server) -> None:
    prompts = [f"req {i}: " for i in range(32)]
    want = {p: srv.greedy(p, 12) for p in prompts}

    async def main() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        async with client:
            return await asyncio.gather(
                *(
                    client.completions.create(
                        model="tiny", prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
                    )
                    for p in prompts
                )
            )

    t0 = time.monotonic()
    steps0 = srv.llm.engine.num_steps
    results = asyncio.run(main())
    assert [r.choices[0].text for r in results] == [want[p] for p in prompts]
    # batched: far fewer engine steps than 32 requests x 12 tokens run one by one
    assert srv.llm.engine.num_steps - steps0 < 32 * 12 / 4
    assert time.monotonic() - t0 < 30 and srv.idle()


def test_disconnecting_clients_free_their_blocks(srv: Server) -> None:
    aborted = srv.llm.engine.num_aborted
    body = {"model": "tiny", "prompt": "long story", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                json.loads(line[6:])
                break
    # the client hung up after the first chunk: the request is aborted and its blocks come back
    assert srv.idle() and srv.llm.engine.num_aborted == aborted + 1
    body["stream"] = False
    body["n"] = 4
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}/v1/completions", json=body, timeout=0.3)
    assert srv.idle() and srv.llm.engine.num_aborted == aborted + 5


class _SlowLoop(AsyncEngine):
    """After each request's first streamed batch, the server's event loop is blocked for a while (as when it has many
    streams to write): the engine thread keeps stepping meanwhile, so several tokens wait for each stream."""

    async def generate_batches(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        first = True
        async for outs in super().generate_batches(*args, **kwargs):
            yield outs
            if first:
                time.sleep(0.4)
                first = False


def test_a_stream_that_fell_behind_gets_one_event_per_choice_with_every_token() -> None:
    """What waited for a client is sent as one event per choice (its tokens, text and log-probabilities combined),
    and the stream still adds up to the whole completion."""
    srv = Server(_SlowLoop)
    client, reference = srv.client, srv.reference
    try:
        want = reference.generate("Hello", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2))
        want_out = want[0].outputs[0]
        chunks = [c for c in client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0,
                                                       logprobs=2, stream=True, extra_body={"ignore_eos": True})
                  if c.choices]  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks) == want_out.text
        tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
        lps = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
        assert len(tokens) == 12 and lps == pytest.approx(want_out.logprobs, abs=1e-4)
        assert max(len(c.choices[0].logprobs.tokens) for c in chunks) > 1  # the waiting tokens came as one event
        assert len(chunks) < 12
        # n > 1: one event per choice and batch, each choice adding up
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=10, n=2, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})  # fmt: skip
        texts = {0: "", 1: ""}
        events = 0
        for c in chat:
            for ch in c.choices:
                texts[ch.index] += ch.delta.content or ""
                events += 1
        ref = reference.generate(apply_chat_template([{"role": "user", "content": "Hi"}]),
                                 SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0].outputs[0].text  # fmt: skip
        assert texts == {0: ref, 1: ref}
        assert events < 2 * (10 + 1)  # fewer events than one per token (plus the role event) per choice
    finally:
        srv.close()
