"""``mcore-infer serve --tp 2`` and ``generate --tp 2`` of a LLaVA checkpoint, on CPU with gloo, its ranks started as
torchrun starts them (tests/infer/test_tp_serving.py's ``launch``): a chat request with an image (and a stream with
two) through the real ``openai`` client gets the text of the tp 1 in-process server on the same checkpoint, and
``generate`` prints the tp 1 completion; SIGTERM stops both ranks with exit code 0."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import openai

from mcore_infer import LLM, EngineConfig, SamplingParams
from mcore_infer.async_engine import AsyncEngine
from mcore_infer.engine_process import wait_until_serving
from mcore_models.multimodal.checkpoint import save_llava_weights
from mcore_parallel import ParallelState
from tests.infer._vlm import tiny_vlm
from tests.infer.test_engine_process import Server
from tests.infer.test_tp_serving import free_port, launch
from tests.infer.test_vlm_serving import image, png_url, text, user

ENGINE = ["--device", "cpu", "--block-size", "16", "--num-blocks", "64", "--max-num-seqs", "4",
          "--max-num-batched-tokens", "24", "--max-images", "2"]  # fmt: skip
CFG: dict[str, Any] = dict(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=24, max_images=2)


def test_serve_and_generate_a_llava_checkpoint_at_tp_2(tmp_path: Path) -> None:
    path = str(save_llava_weights(tiny_vlm(), ParallelState.initialize(), tmp_path / "ckpt"))
    port = free_port()
    serve = ["serve", "--checkpoint", path, "--tp", "2", "--port", str(port), "--model-name", "tiny",
             "--shutdown-timeout", "5", *ENGINE]  # fmt: skip
    (tmp_path / "serve").mkdir()
    (tmp_path / "generate").mkdir()
    procs, logs = launch(serve, tmp_path / "serve")
    gen_procs, gen_logs = launch(["generate", "--checkpoint", path, "--tp", "2", "Hi", "--max-tokens", "5", *ENGINE],
                                 tmp_path / "generate")  # fmt: skip
    llm = LLM(path, config=EngineConfig(**CFG), device="cpu")
    want = llm.generate("Hi", SamplingParams(max_tokens=5, temperature=0.0))[0].outputs[0].text
    ref: Any = Server(AsyncEngine(llm.engine), llm.tokenizer)  # (its loop steps the engine from now on)
    try:
        assert [p.wait(timeout=120) for p in gen_procs] == [0, 0], gen_logs[0].read_text() + gen_logs[1].read_text()
        assert f"{want!r}\n" in gen_logs[0].read_text().splitlines(keepends=True)
        wait_until_serving(f"http://127.0.0.1:{port}/health", timeout=120)
        client: Any = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        kw: dict[str, Any] = dict(model="tiny", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        one = user(image(png_url(1)), text("What is in the picture?"))
        got = client.chat.completions.create(messages=one, **kw)
        expected = ref.client.chat.completions.create(messages=one, **kw)
        assert got.choices[0].message.content == expected.choices[0].message.content and got.usage == expected.usage
        two = user(text("Compare "), image(png_url(2, 16, 16)), text(" and "), image(png_url(3, 32, 8)))
        chunks = client.chat.completions.create(messages=two, stream=True, **kw)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == ref.client.chat.completions.create(messages=two, **kw).choices[0].message.content
        for p in procs:  # what torchrun does with the SIGTERM it gets
            os.killpg(p.pid, signal.SIGTERM)
        assert [p.wait(timeout=60) for p in procs] == [0, 0], logs[0].read_text() + logs[1].read_text()
        assert "Traceback" not in logs[0].read_text() + logs[1].read_text()
    finally:
        ref.close()
        for p in [*procs, *gen_procs]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
