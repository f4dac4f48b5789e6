"""The HTTP side of ``serve_bench.py``: uvicorn serving an engine in a thread, streaming clients spread over processes,
and py-spy samples of the server's processes."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

GEN = 128
PROMPT = 128
"""Prompt tokens of every benchmark request (``serve_bench.py --context`` adds longer ones)."""


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def latency_row(conc: int, wall: float, ttft: list[float], tpot: list[float]) -> dict[str, Any]:
    """Throughput and p50/p99 time-to-first-token and per-token latency (ms) of one concurrency level."""
    return {
        "concurrency": conc,
        "output_tok_s": conc * GEN / wall,
        "wall_s": wall,
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "tpot_ms_p50": pct(tpot, 50),
        "tpot_ms_p99": pct(tpot, 99),
    }


def prompts(n: int, vocab: int, seed: int, length: int = PROMPT) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HTTPServer:
    """uvicorn serving ``engine`` (an ``AsyncEngine`` over an engine in this process, or an ``EngineClient`` over an
    engine process) with the server's own ``server_config`` (httptools and uvloop when installed), in a thread."""

    def __init__(self, engine: Any, tokenizer: Any) -> None:
        import uvicorn

        from mcore_infer.server import build_app, server_config

        self.port = free_port()
        app = build_app(engine, tokenizer, "llama-1b")
        self.server = uvicorn.Server(server_config(app, "127.0.0.1", self.port, "warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def http_run(port: int, conc: int, procs: int, seed: int = 99, client: str = "httpx") -> dict[str, Any]:
    """``conc`` streaming clients against the server on ``port``, spread over ``procs`` client processes (their
    Python work is not the server's: real clients run elsewhere), started together after a warm-up request per client
    (each client with its connection open already). ``client``: ``httpx`` (``httpx.AsyncClient``) or ``raw`` (one
    asyncio connection per client writing a request prepared before the start and counting the events of the chunked
    response: the least a client can spend, so the server's share of the time shows)."""
    import multiprocessing as mp

    ps = prompts(conc, 32768, seed)
    procs = max(1, min(procs, conc))
    ctx = mp.get_context("spawn")
    queue, go = ctx.Queue(), ctx.Event()
    parts = [ps[i::procs] for i in range(procs)]
    workers = [ctx.Process(target=_http_clients_process, args=(port, part, go, queue, client)) for part in parts]
    for w in workers:
        w.start()
    ready = [queue.get(timeout=600) for _ in workers]
    assert all(r == "ready" for r in ready), ready
    go.set()
    res: list[tuple[float, float, float, int, str]] = []
    for _ in workers:
        got = queue.get(timeout=900)
        if isinstance(got, str):
            raise RuntimeError(f"an HTTP client process failed: {got}")
        res += got
    for w in workers:
        w.join(timeout=60)
    wall = max(e for _, _, e, _, _ in res) - min(s for s, _, _, _, _ in res)
    ttft = [(f - s) * 1e3 for s, f, _, _, _ in res]
    tpot = [(e - f) * 1e3 / (GEN - 1) for _, f, e, _, _ in res]
    events = sum(n for _, _, _, n, _ in res)
    starts = [s for s, *_ in res]
    row = {**latency_row(conc, wall, ttft, tpot), "client_processes": procs, "events_per_request": events / conc,
           "start_spread_ms": (max(starts) - min(starts)) * 1e3}  # fmt: skip
    served_by = sorted({w for *_, w in res if w})
    if served_by:  # how the kernel spread the connections over the front-end workers
        row["requests_per_worker"] = {w: sum(1 for *_, x in res if x == w) for w in served_by}
    return row


def _http_clients_process(port: int, ps: list[list[int]], go: Any, queue: Any, client: str = "httpx") -> None:
    try:
        run = _raw_clients if client == "raw" else _http_clients
        queue.put(asyncio.run(run(port, ps, go, queue)))
    except Exception as e:  # the parent reports it
        queue.put(f"{type(e).__name__}: {e}")


async def _http_clients(
    port: int, ps: list[list[int]], go: Any, queue: Any
) -> list[tuple[float, float, float, int, str]]:
    """``len(ps)`` concurrent streaming completions once ``go`` is set (after a warm-up that opens a connection per
    client, then "ready" on
    ``queue``): per request its start, first-token and end times (``time.perf_counter``, one clock for every
    process) and its number of events."""
    import httpx

    async def one(client: httpx.AsyncClient, p: list[int], gen: int = GEN) -> tuple[float, float, float, int, str]:
        body = {
            "model": "llama-1b",
            "prompt": p,
            "max_tokens": gen,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        t0 = time.perf_counter()
        first, n = None, 0
        async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            worker = r.headers.get("x-mcore-worker", "")
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if first is None:
                        first = time.perf_counter()
                    n += 1
        end = time.perf_counter()
        assert first is not None
        return t0, first, end, n, worker

    limits = httpx.Limits(max_connections=len(ps) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        # warm-up: one short request per client at once, so each client holds an open connection (as a real
        # client's pool does) and the timed requests measure the server, not TCP and HTTP connection set-up
        await asyncio.gather(*(one(client, p, 2) for p in ps))
        queue.put("ready")
        await asyncio.to_thread(go.wait)
        return list(await asyncio.gather(*(one(client, p) for p in ps)))


def _request(port: int, p: list[int], gen: int) -> bytes:
    body = json.dumps({"model": "llama-1b", "prompt": p, "max_tokens": gen, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()  # fmt: skip
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n")  # fmt: skip
    return head.encode() + body


async def _raw_one(conn: tuple[Any, Any], request: bytes) -> tuple[float, float, float, int, str]:
    """One streamed completion on an open connection: its start, first-event and end times, events, worker."""
    reader, writer = conn
    t0 = time.perf_counter()
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = head.split(b" ", 2)[1]
    headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
    headers = {k.lower(): v for k, v in headers.items()}
    if status != b"200" or headers.get(b"transfer-encoding") != b"chunked":
        body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
        raise RuntimeError(f"HTTP {status.decode()}: {body[:300]!r}")
    first, n = None, 0
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        chunk = await reader.readexactly(size + 2)
        if not size:
            break
        k = chunk.count(b"data: ") - chunk.count(b"data: [DONE]")
        if k and first is None:
            first = time.perf_counter()
        n += k
    assert first is not None
    return t0, first, time.perf_counter(), n, headers.get(b"x-mcore-worker", b"").decode()


async def _raw_clients(
    port: int, ps: list[list[int]], go: Any, queue: Any
) -> list[tuple[float, float, float, int, str]]:
    """As :func:`_http_clients` with the raw client: a connection per client opened and warmed up by a two-token
    request, the timed requests' bytes made before ``go``."""
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in ps]
    await asyncio.gather(*(_raw_one(c, _request(port, p, 2)) for c, p in zip(conns, ps)))
    reqs = [_request(port, p, GEN) for p in ps]
    queue.put("ready")
    await asyncio.to_thread(go.wait)
    try:
        return list(await asyncio.gather(*(_raw_one(c, r) for c, r in zip(conns, reqs))))
    finally:
        for _, w in conns:
            w.close()


def py_spy(args: argparse.Namespace, pids: dict[str, int], tag: str) -> list[Any]:
    """``py-spy record`` of each of ``pids`` for 4 s (``--py-spy``), started now."""
    import shutil

    exe = shutil.which("py-spy") or next((os.path.join(p, "..", "bin", "py-spy") for p in sys.path
                                          if os.path.exists(os.path.join(p, "..", "bin", "py-spy"))), None)  # fmt: skip
    if not args.py_spy or exe is None:
        return []
    os.makedirs(args.py_spy, exist_ok=True)
    return [subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", "4", "--rate", "250", "--nonblocking",
                              "--format", "raw", "-o", os.path.join(args.py_spy, f"{name}_{tag}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in pids.items()]  # fmt: skip
