"""``serve --api-workers N`` (:func:`~mcore_infer.engine_process.serve_workers`): several HTTP front-end processes on
one socket over one engine process. Through the real ``openai`` client: the reference engine's greedy text from
concurrent streamed and plain requests (each answered by whichever worker accepted it), a clean stop on SIGTERM, a
bad engine reported as a user error (exit code 2). On CPU."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from mcore_infer import LLM, EngineConfig, SamplingParams
from mcore_infer.engine_process import EngineSpec, serve_workers, wait_until_serving
from mcore_infer.errors import InvalidRequestError
from tests.infer._tiny import tiny_llm, tiny_model

CFG = dict(block_size=16, num_blocks=64, max_num_seqs=16, max_num_batched_tokens=256)


def build_llm() -> Any:
    llm = tiny_llm(tiny_model(max_position_embeddings=256), **CFG)
    llm.name = "tiny"
    return llm


def bad_llm() -> Any:
    raise InvalidRequestError("/no/such/run is not a checkpoint")


def _serve(factory: Any, port: int, workers: int, codes: Any) -> None:
    codes.put(serve_workers(EngineSpec(factory), workers, "127.0.0.1", port, shutdown_timeout=2.0))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[openai.OpenAI, Any, Any]]:
    ctx = mp.get_context("spawn")
    port, codes = _port(), ctx.Queue()
    proc = ctx.Process(target=_serve, args=(build_llm, port, 2, codes))
    proc.start()
    try:
        wait_until_serving(f"http://127.0.0.1:{port}/health", timeout=180)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        yield client, proc, codes
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()


def _spawned_children(pid: int) -> int:
    """How many processes ``multiprocessing`` spawned from ``pid`` (Linux ``/proc``; its resource tracker aside)."""
    n = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        n += ppid == pid and b"spawn_main" in cmdline
    return n


def test_workers_give_the_reference_text(served: tuple[openai.OpenAI, Any, Any]) -> None:
    client, proc, _ = served
    if Path("/proc/self/stat").exists():
        assert _spawned_children(proc.pid) == 3  # the engine process and the 2 workers
    ref = LLM(model=tiny_model(max_position_embeddings=256), config=EngineConfig(**CFG))
    prompts = [f"prompt {i}:" for i in range(12)]
    want = [g.outputs[0].text for g in ref.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10,
                                                                             ignore_eos=True))]  # fmt: skip

    def one(i: int) -> str:
        kw: dict[str, Any] = dict(model="tiny", prompt=prompts[i], max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
        if i % 2:
            return client.completions.create(**kw).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)

    with ThreadPoolExecutor(12) as pool:
        got = list(pool.map(one, range(12)))
    assert got == want
    assert client.models.list().data[0].id == "tiny"


def test_sigterm_stops_workers_and_engine(served: tuple[openai.OpenAI, Any, Any]) -> None:
    """Last in the module: it stops the shared server."""
    _, proc, codes = served
    os.kill(proc.pid, signal.SIGTERM)
    proc.join(timeout=60)
    assert proc.exitcode == 0 and codes.get(timeout=5) == 0


def test_a_bad_engine_is_a_user_error() -> None:
    ctx = mp.get_context("spawn")
    codes = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(bad_llm, _port(), 2, codes))
    proc.start()
    proc.join(timeout=120)
    assert codes.get(timeout=5) == 2


def test_cli_checks_api_workers(capsys: pytest.CaptureFixture[str]) -> None:
    from mcore_infer.cli import main

    assert main(["serve", "--checkpoint", "nowhere", "--api-workers", "0"]) == 2
    assert "--api-workers 0: must be at least 1" in capsys.readouterr().err
    assert main(["serve", "--checkpoint", "nowhere", "--api-workers", "2", "--no-engine-process"]) == 2
    assert "--api-workers > 1 needs the engine process" in capsys.readouterr().err
