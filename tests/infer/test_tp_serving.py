"""``mcore-infer serve --tp 2`` over HTTP, on CPU with gloo: rank 0 runs the engine loop and starts the front ends
(here ``--api-workers 2``, one ``SO_REUSEPORT`` socket each), rank 1 follows. Through the real ``openai`` client the
greedy text of the tp 1 in-process server (completions, chat, streams), OpenAI error bodies, connections spread over
both workers (``x-mcore-worker``), and SIGTERM, sent as torchrun sends it (to each rank's process group), drains an
in-flight stream and stops every process with exit code 0. A bad checkpoint under a real ``torchrun`` is one line
and exit code 2.

The served ranks are started as torchrun starts them (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, one
session per rank) so that each rank's exit code can be checked; torchrun itself reports none after a SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mcore_infer import LLM, EngineConfig
from mcore_infer.async_engine import AsyncEngine
from mcore_infer.engine_process import WORKER_HEADER, wait_until_serving
from mcore_models.checkpoint import save_weights
from mcore_parallel import ParallelState
from tests.infer._tiny import tiny_model
from tests.infer.test_engine_process import Server

ROOT = Path(__file__).resolve().parents[2]
CFG: dict[str, Any] = dict(block_size=16, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=128)
FLAGS = ["--device", "cpu", "--block-size", "16", "--num-blocks", "64", "--max-num-seqs", "8",
         "--max-num-batched-tokens", "128", "--model-name", "tiny"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Ranks:
    """The two ranks of ``serve --tp 2``, their logs, and clients of the server."""

    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]
    url: str
    client: openai.OpenAI

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text()


def launch(argv: list[str], logdir: Path, nproc: int = 2) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    """``python -m mcore_infer.cli ARGV`` on ``nproc`` ranks, each in a session of its own, as torchrun does."""
    master = str(free_port())
    procs, logs = [], []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master,
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # fmt: skip
        logs.append(logdir / f"rank{rank}.log")
        with logs[-1].open("wb") as out:
            cmd = [sys.executable, "-m", "mcore_infer.cli", *argv]
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    return procs, logs


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(save_weights(tiny_model(), ParallelState.initialize(), tmp_path_factory.mktemp("ckpt")))


@pytest.fixture(scope="module")
def ranks(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ranks]:
    port = free_port()
    argv = ["serve", "--checkpoint", str(checkpoint), "--tp", "2", "--api-workers", "2", "--port", str(port),
            "--shutdown-timeout", "10", *FLAGS]  # fmt: skip
    procs, logs = launch(argv, tmp_path_factory.mktemp("logs"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(f"{url}/health", timeout=120)
        seen: set[str] = set()
        end = time.monotonic() + 60
        while len(seen) < 2 and time.monotonic() < end:  # both workers listening (a new connection each time)
            seen.add(httpx.get(f"{url}/health").headers[WORKER_HEADER])
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        yield Ranks(procs, logs, url, client)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture(scope="module")
def ref(checkpoint: Path) -> Iterator[Server]:
    """The tp 1 reference: the in-process server over an engine on the same checkpoint."""
    llm = LLM(checkpoint, config=EngineConfig(**CFG), device="cpu")
    s = Server(AsyncEngine(llm.engine), llm.tokenizer)
    yield s
    s.close()


def _stream_text(stream: Any) -> str:
    return "".join(c.choices[0].text for c in stream if c.choices)


def _logprobs(chat: Any) -> list[float]:
    return [v for t in chat.choices[0].logprobs.content for v in (t.logprob, *(x.logprob for x in t.top_logprobs))]


def test_tp2_gives_the_tp1_text(ranks: Ranks, ref: Server) -> None:
    kw: dict[str, Any] = dict(model="tiny", max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    prompts = [f"prompt {i}:" for i in range(8)]

    def complete(client: openai.OpenAI, i: int) -> str:
        if i % 2:
            return _stream_text(client.completions.create(prompt=prompts[i], stream=True, **kw))
        return client.completions.create(prompt=prompts[i], **kw).choices[0].text

    want = [complete(ref.client, i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda i: complete(ranks.client, i), range(8))) == want
    chat: dict[str, Any] = dict(model="tiny", messages=[{"role": "user", "content": "Hi there"}], max_tokens=8,
                                temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    got, expected = ranks.client.chat.completions.create(**chat), ref.client.chat.completions.create(**chat)
    assert got.choices[0].message.content == expected.choices[0].message.content and got.usage == expected.usage
    assert _logprobs(got) == pytest.approx(_logprobs(expected), abs=1e-4)  # (tp sums in another order)
    assert [t.token for t in got.choices[0].logprobs.content] == [t.token for t in expected.choices[0].logprobs.content]
    chunks = ranks.client.chat.completions.create(**{**chat, "logprobs": False, "top_logprobs": None}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.choices[0].message.content
    assert ranks.client.models.list().data[0].id == "tiny"


def test_errors_are_openai_bodies(ranks: Ranks) -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 10_000}
    r = httpx.post(f"{ranks.url}/v1/completions", json=body)
    assert r.status_code == 400 and set(r.json()) == {"error"}
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        ranks.client.completions.create(model="tiny", prompt="Hi", max_tokens=4, top_p=5)
    assert e.value.body["param"] == "top_p"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        ranks.client.completions.create(model="other", prompt="Hi", max_tokens=4)
    assert httpx.get(f"{ranks.url}/health").json()["status"] == "ok"


def test_connections_spread_over_both_workers(ranks: Ranks) -> None:
    """32 connections at once, each a new one: the kernel hashes them over the two workers' sockets."""
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda _: httpx.get(f"{ranks.url}/v1/models"), range(32)))
    assert all(r.status_code == 200 for r in answers)
    served = Counter(r.headers[WORKER_HEADER] for r in answers)
    assert set(served) == {"0", "1"} and min(served.values()) >= 4, served
    assert "one socket each (SO_REUSEPORT)" in ranks.log(0)
    workers = [p for p in descendants(ranks.procs[0].pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()
               and b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()]  # fmt: skip
    assert len(workers) == 2
    # two listening sockets on the port, one in each worker; none in rank 0 (nobody would accept on it)
    port = int(ranks.url.rsplit(":", 1)[1])
    holders = {inode: socket_holders(inode) for inode in listening_inodes(port)}
    assert len(holders) == 2 and sorted(pid for pids in holders.values() for pid in pids) == sorted(workers), holders


def listening_inodes(port: int) -> list[str]:
    """The inodes of the TCP sockets listening on ``port`` (Linux ``/proc/net/tcp``)."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return [r[9] for r in rows if int(r[1].split(":")[1], 16) == port and r[3] == "0A"]


def socket_holders(inode: str) -> list[int]:
    """The processes with the socket ``inode`` open."""
    found = []
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            if os.readlink(fd) == f"socket:[{inode}]":
                found.append(int(fd.parts[2]))
        except OSError:
            continue
    return sorted(set(found))


def test_sigterm_drains_and_stops_every_process(ranks: Ranks) -> None:
    """Last in the module: it stops the shared server."""
    below = {pid for p in ranks.procs for pid in descendants(p.pid)}
    assert len(below) >= 2
    stream = ranks.client.completions.create(model="tiny", prompt="Once", max_tokens=150, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = iter(stream)
    first = next(chunks)
    for p in ranks.procs:  # what torchrun does with the SIGTERM it gets
        os.killpg(p.pid, signal.SIGTERM)
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length", rest[-1]
    assert len(_stream_text([first, *rest])) > 0
    codes = [p.wait(timeout=60) for p in ranks.procs]
    assert codes == [0, 0], ranks.log(0) + ranks.log(1)
    end = time.monotonic() + 10
    while any(alive(pid) for pid in below) and time.monotonic() < end:
        time.sleep(0.1)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in below if alive(pid)}
    assert not left, left
    assert "front ends stopped (exit codes 0, 0)" in ranks.log(0)
    assert "got SIGTERM: following rank 0" in ranks.log(1) and "Traceback" not in ranks.log(0) + ranks.log(1)


def test_a_bad_checkpoint_under_torchrun_is_one_line_and_exit_2(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "mcore_infer.cli",
           "serve", "--checkpoint", str(tmp_path / "nowhere"), "--tp", "2", "--device", "cpu",
           "--port", str(free_port())]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    errors = [line for line in out.splitlines() if "mcore-infer: error:" in line]
    assert r.returncode != 0 and len(errors) == 1 and str(tmp_path / "nowhere") in errors[0], out
    assert re.search(r"exitcode\s*: 2", out), out  # torchrun's report: a rank exited 2
    assert not re.search(r'File ".*mcore_(infer|models|parallel|data)', out), out  # no trace of ours


def test_cli_checks_the_launch_and_the_port(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without torchrun, ``--tp 2`` names the launch it needs; under it, a port in use fails on rank 0 before any
    model is loaded (the checkpoint is never read), in one line naming host:port."""
    from mcore_infer.cli import main

    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    assert main(["serve", "--checkpoint", "nowhere", "--tp", "2"]) == 2
    assert "launch it with torchrun --nproc-per-node 2" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert main(["serve", "--checkpoint", "nowhere", "--tp", "2", "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert f"mcore-infer: error: cannot listen on 127.0.0.1:{port}" in err and len(err.splitlines()) == 1, err
        monkeypatch.delenv("RANK")
        monkeypatch.delenv("WORLD_SIZE")
        assert main(["serve", "--checkpoint", "nowhere", "--api-workers", "2", "--port", str(port)]) == 2
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_worker_sockets_share_the_port_and_a_taken_port_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from mcore_infer.engine_process import _sockets, bind_worker_sockets
    from mcore_infer.errors import InvalidRequestError

    socks = bind_worker_sockets("127.0.0.1", 0, 3)
    (port,) = {s.getsockname()[1] for s in socks}
    assert len(socks) == 3 and all(s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) for s in socks)
    assert not any(s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) for s in socks)  # each worker listens
    for s in socks:
        s.listen()
    with pytest.raises(InvalidRequestError, match=f"^cannot listen on 127.0.0.1:{port}: "):
        bind_worker_sockets("127.0.0.1", port, 2)  # a running SO_REUSEPORT group holds it: not joined
    for s in socks:
        s.close()
    monkeypatch.setattr(_sockets, "reuseport_balances", lambda: False)
    (shared,) = bind_worker_sockets("127.0.0.1", 0, 3)  # no SO_REUSEPORT: one socket for every worker
    assert not shared.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)
    shared.close()
