"""Serving a LLaVA-style VLM with images: the engine's greedy tokens equal the full recompute of
``LlavaModel.forward`` (chunked prefill with an image across the chunk boundary, two images, two requests in one
batch), each request's images are encoded once, and the OpenAI chat API takes ``image_url`` data URLs (the real
``openai`` client against uvicorn), with a 400 and an OpenAI error body for every bad image input."""

from __future__ import annotations

import base64
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
import uvicorn

from mcore_data._png import encode_png
from mcore_infer import LLM, EngineConfig, SamplingParams
from mcore_infer.async_engine import AsyncEngine
from mcore_infer.server import build_app
from mcore_models.multimodal import LlavaModel
from tests.infer._tiny import tiny_model
from tests.infer._vlm import IMG, S, T, prompt, tiny_vlm


def vlm_llm(model: LlavaModel, **kw: Any) -> LLM:
    cfg: dict[str, Any] = dict(block_size=16, num_blocks=64, max_num_batched_tokens=24, max_num_seqs=4,
                               max_images=2, max_model_len=128)  # fmt: skip
    cfg.update(kw)
    return LLM(model=model, config=EngineConfig(**cfg))


def pixels(seed: int, n: int = 1) -> torch.Tensor:
    return torch.rand(n, 3, S, S, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def reference(model: LlavaModel, prompt: list[int], images: torch.Tensor, n: int) -> list[int]:
    """LlavaModel.forward over the whole sequence for every new token, argmax of the last position."""
    ids, out = list(prompt), []
    for _ in range(n):
        t = int(model(torch.tensor([ids]), images, gather_logits=True)[0, -1].argmax())
        out.append(t)
        ids.append(t)
    return out


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def vlm() -> LlavaModel:
    return tiny_vlm()


def test_engine_matches_full_recompute_with_chunked_prefill(vlm: LlavaModel) -> None:
    llm = vlm_llm(vlm)  # 24-token chunks: prompt positions 16..31 are the image, cut at 24
    calls: list[int] = []
    encode = llm.runner.encode_images
    llm.runner.encode_images = lambda px: (calls.append(px.shape[0]), encode(px))[1]  # type: ignore[method-assign]
    cases = [(prompt(16, 9), pixels(1)), (prompt(3, 5, images=2, seed=1), pixels(2, 2)), (prompt(20, 30), pixels(3))]
    for ids, px in cases:
        calls.clear()
        out = _run(llm, ids, px)
        assert out == reference(vlm, ids, px, 6)
        assert calls == [px.shape[0]]  # encoded once, over several prefill steps
    assert llm.runner.blocks.num_free == llm.runner.blocks.capacity


def _run(llm: LLM, ids: list[int], px: torch.Tensor, params: SamplingParams = GREEDY) -> list[int]:
    rid = llm.engine.add_request(ids, params, images=px)
    done: dict[str, Any] = {}
    while llm.engine.has_work():
        for o in llm.engine.step():
            if o.finished:
                done[o.request_id] = o
    return list(done[rid].token_ids)


def test_two_requests_in_one_batch_each_get_their_own_answer(vlm: LlavaModel) -> None:
    llm = vlm_llm(vlm, max_num_batched_tokens=128)
    a, b = (prompt(5, 7, seed=3), pixels(4)), (prompt(9, 2, seed=5), pixels(5))
    alone = [_run(vlm_llm(vlm), ids, px) for ids, px in (a, b)]
    assert alone == [reference(vlm, ids, px, 6) for ids, px in (a, b)]
    calls: list[int] = []
    encode = llm.runner.encode_images
    llm.runner.encode_images = lambda px: (calls.append(px.shape[0]), encode(px))[1]  # type: ignore[method-assign]
    rids = [llm.engine.add_request(ids, GREEDY, images=px) for ids, px in (a, b)]
    done: dict[str, list[int]] = {}
    llm.engine.step()
    assert calls == [1, 1]  # both prefills in the first step, each image encoded once
    while llm.engine.has_work():
        done.update({o.request_id: o.token_ids for o in llm.engine.step() if o.finished})
    assert [done[r] for r in rids] == alone
    assert calls == [1, 1]


def test_text_only_requests_and_bad_images_to_the_engine(vlm: LlavaModel) -> None:
    llm = vlm_llm(vlm)
    ids = prompt(30, 0, images=0)
    assert _run(llm, ids, None) == reference(vlm, ids, None, 6)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="16 image tokens .* but 0 image"):
        llm.engine.add_request(prompt(4, 4), GREEDY)
    with pytest.raises(ValueError, match="at most 2 per request"):
        llm.engine.add_request(prompt(4, 4, images=3), GREEDY, images=pixels(0, 3))
    with pytest.raises(ValueError, match=r"shape \[1, 3, 16, 16\]"):
        llm.engine.add_request(prompt(4, 4), GREEDY, images=torch.rand(1, 3, 8, 8))
    text = LLM(model=tiny_model(), config=EngineConfig(num_blocks=16, max_num_seqs=2))
    with pytest.raises(ValueError, match="text-only"):
        text.engine.add_request([1, 2, 3], GREEDY, images=pixels(0))


def test_abort_and_finish_free_the_images(vlm: LlavaModel) -> None:
    llm = vlm_llm(vlm)
    rid = llm.engine.add_request(prompt(16, 9), GREEDY, images=pixels(1))
    llm.engine.step()  # the first chunk: the image is encoded, half of it prefilled
    seq = llm.engine._seqs[rid]
    assert seq.images is not None and seq.images.embeds is not None
    llm.engine.abort(rid)
    llm.engine.step()
    assert seq.images is None and llm.runner.blocks.num_free == llm.runner.blocks.capacity
    rid = llm.engine.add_request(prompt(16, 9), GREEDY, images=pixels(1))
    llm.engine.step()
    seq = llm.engine._seqs[rid]
    llm.engine.step()  # the image's last tokens: its embeddings are dropped, the pixels kept until the end
    assert seq.images is not None and seq.images.embeds is None
    while llm.engine.has_work():
        llm.engine.step()
    assert seq.images is None


def test_llava_checkpoint_loads_for_serving(vlm: LlavaModel, tmp_path: Any) -> None:
    from mcore_models.multimodal.checkpoint import save_llava_weights
    from mcore_parallel import ParallelState

    norm = {"image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.25, 0.3]}  # as an mcore-train run saves it
    path = save_llava_weights(vlm, ParallelState.initialize(), tmp_path, metadata={"config": {"multimodal": norm}})
    llm = LLM(path, config=EngineConfig(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=24), device="cpu")
    assert llm.runner.vision is not None and llm.runner.vision.image_tokens == T
    assert llm.runner.vision.mean == (0.5, 0.4, 0.3) and llm.runner.vision.std == (0.2, 0.25, 0.3)
    ids, px = prompt(16, 9), pixels(1)
    assert _run(llm, ids, px) == reference(vlm, ids, px, 6)


# ------------------------------------------------------------------------------------------------------- server
def png_url(seed: int, h: int = 20, w: int = 24) -> str:
    px = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return "data:image/png;base64," + base64.b64encode(encode_png(px)).decode()


def user(*parts: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def text(s: str) -> dict[str, Any]:
    return {"type": "text", "text": s}


class Server:
    def __init__(self, model: LlavaModel, llm: LLM | None = None, **engine: Any) -> None:
        self.model = model
        self.llm = llm or vlm_llm(model, **engine)
        self.reference = vlm_llm(model, **engine)
        self.app = build_app(AsyncEngine(self.llm.engine), self.llm.tokenizer, "tiny-vlm", shutdown_timeout=2.0)
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

    def expected(self, messages: list[dict[str, Any]], n: int) -> str:
        """The engine's own answer to the prompt and pixels the server makes of ``messages``."""
        from mcore_infer.protocol import CHAT_STOP, chat_messages
        from mcore_infer.server.images import prompt_with_images, request_pixels

        vision = self.llm.runner.vision
        assert vision is not None
        chat = chat_messages(messages)
        px, tiles = request_pixels(chat.images, vision)
        ids = prompt_with_images(self.llm.tokenizer, chat.turns, vision, tiles)
        p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, stop=CHAT_STOP)
        rid = self.reference.engine.add_request(ids, p, images=px)
        while True:
            for o in self.reference.engine.step():
                if o.finished and o.request_id == rid:
                    assert o.token_ids == reference(self.model, ids, px, len(o.token_ids))
                    return o.text

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def srv(vlm: LlavaModel) -> Iterator[Server]:
    s = Server(vlm)
    yield s
    s.close()


def test_openai_client_chat_with_an_image(srv: Server) -> None:
    messages = user(image(png_url(1)), text("What is in the picture?"))
    r = srv.client.chat.completions.create(model="tiny-vlm", messages=messages, max_tokens=6,  # type: ignore[arg-type]
                                           temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].message.content == srv.expected(messages, 6)
    assert r.usage is not None and r.usage.prompt_tokens > T
    two = user(text("Compare "), image(png_url(2, 16, 16)), text(" and "), image(png_url(3, 32, 8)))
    stream = srv.client.chat.completions.create(model="tiny-vlm", messages=two, max_tokens=5, stream=True,  # type: ignore[arg-type]
                                                temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == srv.expected(two, 5)


def _post(srv: Server, messages: Any, **kw: Any) -> httpx.Response:
    body = {"model": "tiny-vlm", "messages": messages, "max_tokens": 4, **kw}
    return httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30)


def huge_png_url() -> str:
    """A PNG header claiming 100000 x 100000 pixels (never decoded)."""
    data = bytearray(encode_png(np.zeros((2, 2, 3), np.uint8)))
    data[16:24] = (100000).to_bytes(4, "big") * 2
    return "data:image/png;base64," + base64.b64encode(bytes(data)).decode()


BAD: list[tuple[str, Any, str]] = [
    ("http url", user(image("https://example.com/cat.png")), "only data URLs"),
    ("bad base64", user(image("data:image/png;base64,@@not base64@@")), "not valid base64"),
    ("undecodable", user(image("data:image/png;base64," + base64.b64encode(b"not a png").decode())), "cannot decode"),
    ("jpeg junk", user(image("data:image/jpeg;base64," + base64.b64encode(b"\xff\xd8junk").decode())), "cannot decode"),
    ("unsupported type", user(image("data:image/bmp;base64,AAAA")), "image/bmp is not supported"),
    ("not a data url", user(image("file:///etc/passwd")), "base64 data URL"),
    ("too many", user(*[image(png_url(i)) for i in range(3)]), "at most 2 per request"),
    ("placeholder text", user(text("<image>"), image(png_url(1))), "image placeholder"),
    ("too long", user(image(png_url(1)), text("x" * 110)), "image tokens"),
    ("bad part", user({"type": "audio"}), "text or image_url"),
    ("huge png", user(image(huge_png_url())), "at most 16777216 pixels"),
]


@pytest.mark.parametrize("name,messages,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_images_are_400s_and_the_engine_serves_on(srv: Server, name: str, messages: Any, needle: str) -> None:
    r = _post(srv, messages)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert needle in err["message"], err["message"]
    assert err["param"] and err["param"].startswith("messages")
    good = user(image(png_url(7)), text("hi"))
    ok = _post(srv, good, temperature=0, ignore_eos=True)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == srv.expected(good, 4)


def test_an_image_to_a_text_only_model_is_a_400() -> None:
    from fastapi.testclient import TestClient

    llm = LLM(model=tiny_model(), config=EngineConfig(num_blocks=16, max_num_seqs=2))
    app = build_app(AsyncEngine(llm.engine), llm.tokenizer, "tiny", shutdown_timeout=1.0)
    with TestClient(app) as c:
        body = {"model": "tiny", "messages": user(image(png_url(1)), text("hi")), "max_tokens": 2}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and "text-only" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={**body, "messages": user(text("hi"))})
        assert r.status_code == 200


def build_vlm_llm() -> LLM:
    """The engine process's factory (module level: ``spawn`` pickles it by reference)."""
    llm = vlm_llm(tiny_vlm())
    llm.name = "tiny-vlm"
    return llm


def test_engine_process_takes_images(srv: Server) -> None:
    """``serve``'s default layout: the pixels cross to the engine process with the request."""
    from mcore_infer.engine_process import EngineClient, EngineSpec

    client = EngineClient(EngineSpec(build_vlm_llm)).launch()
    app = build_app(client, client.tokenizer, client.model_name, shutdown_timeout=2.0)  # type: ignore[arg-type]
    good = user(image(png_url(9)), text("and this?"))
    try:
        from fastapi.testclient import TestClient

        with TestClient(app) as c:
            body = {"model": "tiny-vlm", "messages": good, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == srv.expected(good, 4)
            r = c.post("/v1/chat/completions", json={**body, "messages": user(image("http://x/y.png"))})
            assert r.status_code == 400 and "only data URLs" in r.json()["error"]["message"]
    finally:
        client.shutdown(0.0)


def test_cli_generate_with_a_llava_checkpoint(vlm: LlavaModel, tmp_path: Any, capsys: Any) -> None:
    from mcore_infer.cli import main
    from mcore_models.multimodal.checkpoint import save_llava_weights
    from mcore_parallel import ParallelState

    path = save_llava_weights(vlm, ParallelState.initialize(), tmp_path)
    args = ["generate", "--checkpoint", str(path), "Hi", "--max-tokens", "3", "--device", "cpu", "--num-blocks", "16",
            "--max-num-seqs", "2", "--image-mean", "0.5,0.5,0.5", "--image-std", "0.5,0.5,0.5"]  # fmt: skip
    assert main(args) == 0
    assert capsys.readouterr().out.strip()
    assert main([*args[:-2], "--image-std", "0.5,0.5"]) == 2  # one std per mean
    assert "image_std" in capsys.readouterr().err


def test_a_preempted_request_encodes_its_images_again(vlm: LlavaModel) -> None:
    llm = vlm_llm(vlm, num_blocks=8, max_num_batched_tokens=96)  # 7 blocks: the second request is preempted
    calls: list[int] = []
    encode = llm.runner.encode_images
    llm.runner.encode_images = lambda px: (calls.append(px.shape[0]), encode(px))[1]  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    reqs = [(prompt(16, 9, seed=8), pixels(8)), (prompt(16, 9, seed=9), pixels(9))]
    rids = [llm.engine.add_request(ids, params, images=px) for ids, px in reqs]
    done: dict[str, list[int]] = {}
    while llm.engine.has_work():
        done.update({o.request_id: o.token_ids for o in llm.engine.step() if o.finished})
    assert llm.engine.scheduler.num_preemptions >= 1 and len(calls) == 2 + llm.engine.scheduler.num_preemptions
    assert [done[r] for r in rids] == [reference(vlm, ids, px, 30) for ids, px in reqs]


def _serve_checkpoint_at_tp_2(path: str, cases: list[tuple[list[int], torch.Tensor]]) -> list[list[int]] | None:
    from mcore_parallel import ParallelConfig, ParallelState

    state = ParallelState.initialize(ParallelConfig(tp=2))
    llm = LLM(path, config=EngineConfig(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=24), tp=state.tp,
              device="cpu")  # fmt: skip
    vlm = llm.runner.vlm
    assert vlm is not None and llm.runner.vision is not None and llm.runner.vision.image_tokens == T
    tower: Any = vlm.vision.decoder.layers["0"]
    lm: Any = vlm.language.decoder.layers["0"]
    assert tower.self_attention.linear_qkv.weight.shape == (48, 32)  # this rank's half of the tower's heads
    assert lm.self_attention.linear_qkv.weight.shape == (64, 64)  # and of the LM's
    assert vlm.projector.linear_fc1.weight.shape == (64, 32)  # the projector whole
    if not llm.is_driver:
        llm.follow()
        return None
    out = [_run(llm, ids, px) for ids, px in cases]
    llm.shutdown()
    return out


def test_a_llava_checkpoint_serves_at_tp_2(vlm: LlavaModel, tmp_path: Any) -> None:
    """Saved from one process, loaded at tp=2 (each rank its shard of the tower and the LM): the greedy tokens of
    ``LlavaModel.forward`` for an image across the chunk boundary and for two images (tests/infer/test_vlm_tp.py
    checks the engine at tp=2 in depth)."""
    from mcore_models.multimodal.checkpoint import save_llava_weights
    from mcore_parallel import ParallelState
    from mcore_parallel.testing import run_distributed

    path = save_llava_weights(vlm, ParallelState.initialize(), tmp_path)
    cases = [(prompt(16, 9), pixels(1)), (prompt(2, 4, images=2, seed=4), pixels(11, 2))]
    want = [reference(vlm, ids, px, 6) for ids, px in cases]
    assert run_distributed(_serve_checkpoint_at_tp_2, 2, str(path), cases) == [want, None]


# ------------------------------------------------------------------------------------------------------- tiling
def tiled_checkpoint(vlm: LlavaModel, tmp_path: Any, **multimodal: Any) -> Any:
    from mcore_models.multimodal.checkpoint import save_llava_weights
    from mcore_parallel import ParallelState

    meta = {"config": {"multimodal": multimodal}}  # as an mcore-train run saves its tiling
    return save_llava_weights(vlm, ParallelState.initialize(), tmp_path, metadata=meta)


TILED: dict[str, Any] = dict(max_model_len=256, max_num_batched_tokens=64)


def test_a_tiled_checkpoint_serves_its_tiles_as_trained(vlm: LlavaModel, tmp_path: Any) -> None:
    from mcore_data.chat import tokenize_conversation
    from mcore_data.multimodal_torch import image_tiles
    from mcore_data.tiling import Tiling, tile_tags

    path = tiled_checkpoint(vlm, tmp_path, max_tiles=4)
    llm = LLM(path, config=EngineConfig(num_blocks=64, max_num_seqs=4, max_images=2, **TILED), device="cpu")
    assert llm.runner.vision is not None and llm.runner.vision.tiling == Tiling(4)
    srv = Server(vlm, llm, max_tiles=4, **TILED)
    seen: list[tuple[list[int], Any]] = []  # what the engine is asked: prompt ids and pixels
    add = llm.engine.add_request

    def spy(ids: list[int], params: SamplingParams, **k: Any) -> str:
        seen.append((list(ids), k.get("images")))
        return add(ids, params, **k)

    llm.engine.add_request = spy  # type: ignore[method-assign,assignment]
    try:
        wide = np.random.default_rng(4).integers(0, 256, (16, 40, 3), dtype=np.uint8)  # a 3 x 1 grid + thumbnail
        url = "data:image/png;base64," + base64.b64encode(encode_png(wide)).decode()
        messages = user(image(url), text("What is it?"))
        r = srv.client.chat.completions.create(model="tiny-vlm", messages=messages, max_tokens=6,  # type: ignore[arg-type]
                                               temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        tiles = image_tiles(torch.from_numpy(wide).permute(2, 0, 1).float() / 255, S, Tiling(4))
        conv = tokenize_conversation(llm.tokenizer, [{"role": "user", "content": "<image>What is it?"}],
                                     image_token_id=IMG, image_tokens=T, append_eod=False,
                                     tiles=[tile_tags(4, Tiling(4))])  # fmt: skip
        ((ids, px),) = seen
        assert ids == [*conv.tokens.tolist(), *llm.tokenizer.encode("<|assistant|>\n")] and conv.num_tiles == 4
        assert px.shape == (4, 3, S, S) and torch.equal(px, tiles)
        assert bytes(ids).count(b"<tile_") == 4 and b"<tile_3><tile_global_thumbnail>" not in bytes(ids)
        assert r.choices[0].message.content == srv.expected(messages, 6)  # = LlavaModel.forward over those tiles
        seen.clear()
        two = user(image(url), text(" vs "), image(png_url(2, 16, 16)))  # the square one: 1 tile
        r = srv.client.chat.completions.create(model="tiny-vlm", messages=two, max_tokens=4,  # type: ignore[arg-type]
                                               temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert seen[0][1].shape[0] == 5 and r.choices[0].message.content == srv.expected(two, 4)
        r3 = _post(srv, user(*[image(png_url(i)) for i in range(3)]))  # still counted in images, before decoding
        assert r3.status_code == 400 and r3.json()["error"]["code"] == "too_many_images", r3.text
        assert "at most 2 per request" in r3.json()["error"]["message"]
    finally:
        srv.close()
    with pytest.raises(ValueError, match=r"11 image tiles; this server takes at most 10 per request \(2 images"):
        llm.engine.add_request([IMG] * T * 11, GREEDY, images=torch.rand(11, 3, S, S))
    with pytest.raises(ValueError, match="16 image tokens .* but 2 image tile"):
        llm.engine.add_request([1, *[IMG] * T], GREEDY, images=torch.rand(2, 3, S, S))


def test_tiling_flags_override_the_checkpoint(vlm: LlavaModel, tmp_path: Any, capsys: Any) -> None:
    from mcore_data.tiling import Tiling
    from mcore_infer.cli import _engine_config, _parser, main

    path = tiled_checkpoint(vlm, tmp_path, max_tiles=4, tile_tags=False)
    small: dict[str, Any] = dict(num_blocks=16, max_num_seqs=2)
    vision = lambda **kw: LLM(path, config=EngineConfig(**small, **kw), device="cpu").runner.vision  # noqa: E731
    assert vision().tiling == Tiling(4, thumbnail=True, tags=False)  # type: ignore[union-attr]
    assert vision(max_tiles=2, tile_tags=True).tiling == Tiling(2, True, True)  # type: ignore[union-attr]
    assert vision(max_tiles=1).tiling == Tiling(1, True, False)  # type: ignore[union-attr]
    assert vision_of_plain(vlm, tmp_path / "plain").tiling == Tiling()  # no tiling saved: none
    args = ["generate", "--checkpoint", str(path), "Hi", "--max-tokens", "2", "--device", "cpu", "--num-blocks", "16",
            "--max-num-seqs", "2"]  # fmt: skip
    config = _engine_config(_parser().parse_args([*args, "--max-tiles", "6", "--no-tile-thumbnail", "--tile-tags"]),
                            "cpu")  # fmt: skip
    assert config.tiling() == Tiling(6, thumbnail=False, tags=True)
    assert _engine_config(_parser().parse_args(args), "cpu").max_tiles is None  # unset: the checkpoint's
    assert main([*args, "--max-tiles", "3"]) == 0 and capsys.readouterr().out.strip()
    assert main([*args, "--max-tiles", "0"]) == 2
    assert "max_tiles=0 must be an integer >= 1" in capsys.readouterr().err
    bad = tiled_checkpoint(vlm, tmp_path / "bad", max_tiles="4")
    assert main(["generate", "--checkpoint", str(bad), *args[3:]]) == 2
    assert "multimodal.max_tiles='4' is not valid" in capsys.readouterr().err


def vision_of_plain(vlm: LlavaModel, tmp_path: Any) -> Any:
    return LLM(tiled_checkpoint(vlm, tmp_path), config=EngineConfig(num_blocks=16, max_num_seqs=2),
               device="cpu").runner.vision  # fmt: skip
