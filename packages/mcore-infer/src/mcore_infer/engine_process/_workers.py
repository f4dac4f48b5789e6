"""``mcore-infer serve --api-workers N``: one engine process, ``N`` HTTP front-end processes on one listening socket.

The process that calls :func:`serve_workers` supervises: it starts the engine process with a pair of pipes per
worker (:func:`~mcore_infer.engine_process._worker.run_engine` serves them all: each request's outputs go back to
the worker it came from), binds the socket, and starts the workers (``spawn``), each a uvicorn server over a
:class:`~mcore_infer.engine_process.SharedEngineClient` accepting on the shared socket, so the kernel spreads the
connections over them. SIGINT/SIGTERM stop the workers (each drains its requests as one server does); the engine
process stops once every worker's pipe has closed.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from types import FrameType
from typing import Any

from mcore_infer.engine_process._worker import EngineSpec, run_engine, widen_pipe

__all__ = ["serve_workers"]

log = logging.getLogger(__name__)

USER_ERROR_EXIT = 2


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket for the workers to share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _worker_main(index: int, commands: Any, outputs: Any, sock: socket.socket, model_name: str | None,
                 shutdown_timeout: float, level: int) -> None:  # fmt: skip
    """One front-end worker (``multiprocessing`` target): exit code 2 when the engine could not be built because of
    the user's input (the message on stderr from worker 0 only), else uvicorn until SIGINT/SIGTERM."""
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s %(name)s[worker {index}]: %(message)s")
    from mcore_infer.engine_process._client import SharedEngineClient
    from mcore_infer.errors import InvalidRequestError
    from mcore_infer.server import build_app, server_config

    try:
        client = SharedEngineClient(commands, outputs, index).launch()
    except InvalidRequestError as e:
        if index == 0:
            sys.stderr.write(f"mcore-infer: error: {e}\n")
        sys.exit(USER_ERROR_EXIT)
    app = build_app(client, client.tokenizer, model_name or client.model_name, shutdown_timeout)  # type: ignore[arg-type]
    import uvicorn

    host, port = sock.getsockname()[:2]
    uvicorn.Server(server_config(app, host, port, logging.getLevelName(level).lower())).run(sockets=[sock])


def serve_workers(spec: EngineSpec, workers: int, host: str, port: int, shutdown_timeout: float = 30.0,
                  model_name: str | None = None, sock: socket.socket | None = None) -> int:  # fmt: skip
    """Serve HTTP on ``host:port`` (or the listening ``sock``) from ``workers`` front-end processes over one engine
    process built from ``spec``, until SIGINT/SIGTERM; the exit code (2 when the engine could not be built because of
    the user's input)."""
    if workers < 1:
        raise ValueError(f"workers={workers} must be at least 1")
    ctx = mp.get_context("spawn")
    commands = [ctx.Pipe(duplex=False) for _ in range(workers)]  # (engine's read end, worker's write end)
    outputs = [ctx.Pipe(duplex=False) for _ in range(workers)]  # (worker's read end, engine's write end)
    for r, _w in commands + outputs:
        widen_pipe(r)
    engine = ctx.Process(target=run_engine, args=(spec, [r for r, _ in commands], [w for _, w in outputs]),
                         name="mcore-infer-engine")  # fmt: skip
    engine.start()
    sock = sock or listening_socket(host, port)
    level = logging.getLogger().getEffectiveLevel()
    procs = []
    for i in range(workers):
        args = (i, commands[i][1], outputs[i][0], sock, model_name, shutdown_timeout, level)
        procs.append(ctx.Process(target=_worker_main, args=args, name=f"mcore-infer-worker-{i}"))
    for p in procs:
        p.start()
    for r, w in commands + outputs:  # the children hold them now: a child's exit shows as EOF on the other side
        r.close()
        w.close()
    log.info("serving on %s:%d with %d front-end workers (pids %s) over engine process %d", host, port, workers,
             ",".join(str(p.pid) for p in procs), engine.pid)  # fmt: skip
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            for p in procs:
                if p.is_alive() and p.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGTERM)

    old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while any(p.is_alive() for p in procs):
            for p in procs:
                p.join(timeout=0.2)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        sock.close()
        engine.join(timeout=shutdown_timeout + 10.0)
        if engine.is_alive():
            log.warning("engine process %d did not stop; terminating it", engine.pid)
            engine.terminate()
            engine.join(timeout=5.0)
    codes = [p.exitcode for p in procs]
    if any(c == USER_ERROR_EXIT for c in codes):
        return USER_ERROR_EXIT
    return 0 if stopping or all(c == 0 for c in codes) else 1


def wait_until_serving(url: str, timeout: float = 600.0) -> None:
    """Block until ``url`` (e.g. ``http://127.0.0.1:8000/health``) answers 200 (tests and benchmarks)."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {timeout} s")
        time.sleep(0.2)
