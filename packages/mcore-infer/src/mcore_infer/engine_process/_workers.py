"""``mcore-infer serve --api-workers N`` (and every ``serve --tp N > 1``): HTTP front-end processes over one engine.

:func:`serve_workers` supervises. It binds the listening sockets (one per worker with ``SO_REUSEPORT`` on Linux:
:mod:`~mcore_infer.engine_process._sockets`), makes a pair of pipes per worker, and starts the workers (``spawn``),
each a uvicorn server over a :class:`~mcore_infer.engine_process.SharedEngineClient` on its pipes and its socket. The
engine serves every worker's pipes (each request's outputs go back to the worker it came from):

* given an :class:`~mcore_infer.engine_process.EngineSpec` (``--tp 1``), in an engine process started here that builds
  its ``LLM`` (:func:`~mcore_infer.engine_process._worker.run_engine`); this process waits for the workers;
* given a built ``LLM`` (rank 0 under ``--tp`` > 1, the other ranks following it), in this process: the same loop
  (:func:`~mcore_infer.engine_process._worker.serve_engine`) runs here until every worker's pipe closed, then
  releases the other ranks (``llm.shutdown()``).

SIGINT/SIGTERM stop the workers (each drains its requests as one server does; one that has not stopped
``shutdown_timeout`` + 15 s later is killed, as all are at a second signal); the engine loop stops once every worker's
pipe has closed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

from mcore_infer.engine_process._sockets import WorkerHeader, bind_worker_sockets
from mcore_infer.engine_process._worker import EngineSpec, run_engine, serve_engine, widen_pipe
from mcore_infer.errors import MissingDependencyError

__all__ = ["serve_workers", "wait_until_serving"]

log = logging.getLogger(__name__)

USER_ERROR_EXIT = 2
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _worker_main(index: int, commands: Any, outputs: Any, sock: socket.socket, model_name: str | None,
                 shutdown_timeout: float, level: int) -> None:  # fmt: skip
    """One front-end worker (``multiprocessing`` target): exit code 2 when the engine could not be built because of
    the user's input (the message on stderr from worker 0 only), else uvicorn until SIGINT/SIGTERM, then (drained)
    exit code 0."""
    server: Any = None

    def leave(signum: int, frame: FrameType | None) -> None:
        if server is None:  # stopped before the server was made: nothing to drain
            raise SystemExit(0)
        server.should_exit = True  # made, but uvicorn has not taken over the signals yet

    for s in _STOP_SIGNALS:
        signal.signal(s, leave)
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
    tagged = WorkerHeader(app, index)
    import uvicorn

    class WorkerServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            """Drain, whatever the signal and however many: the launcher (the process group) and the supervisor
            may both signal a worker, and a second SIGINT would make uvicorn skip the drain; the supervisor kills
            the workers when its own stop is forced or overdue."""
            self.should_exit = True

    host, port = sock.getsockname()[:2]
    server = WorkerServer(server_config(tagged, host, port, logging.getLevelName(level).lower()))
    try:
        server.run(sockets=[sock])
    finally:
        log.info("front end %d served %d requests", index, tagged.served)


class _EngineProcess:
    """``--tp 1``: the engine in a process of its own, started here, that builds its ``LLM`` from the spec."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.proc: Any = None

    def start(self, ctx: Any, commands: list[Connection], outputs: list[Connection]) -> str:
        self.proc = ctx.Process(target=run_engine, args=(self.spec, commands, outputs), name="mcore-infer-engine")
        self.proc.start()
        for conn in commands + outputs:  # the engine process holds them now: its exit shows as EOF in the workers
            conn.close()
        return f"engine process {self.proc.pid}"

    def run(self, workers: _Workers) -> None:
        workers.wait()

    def finish(self, timeout: float) -> None:
        proc = self.proc
        if proc is None:
            return
        proc.join(timeout=timeout + 10.0)
        if proc.is_alive():
            log.warning("engine process %d did not stop; terminating it", proc.pid)
            proc.terminate()
            proc.join(timeout=5.0)


class _EngineHere:
    """``--tp`` > 1, rank 0: the engine loop in this process over the ``LLM`` built here (the other ranks follow);
    it ends once every worker's pipe closed, and releases the other ranks."""

    def __init__(self, llm: Any) -> None:
        self.llm, self.released = llm, False
        self.conns: tuple[list[Connection], list[Connection]] = ([], [])

    def start(self, ctx: Any, commands: list[Connection], outputs: list[Connection]) -> str:
        self.conns = (commands, outputs)
        return f"the engine loop in this process ({os.getpid()})"

    def run(self, workers: _Workers) -> None:
        self.released = True  # serve_engine releases the other ranks however it ends
        serve_engine(self.llm, *self.conns)

    def finish(self, timeout: float) -> None:
        for conn in self.conns[0] + self.conns[1]:
            conn.close()
        if not self.released:  # stopped before the loop ran: the other ranks still wait for a step
            self.released = True
            self.llm.shutdown()


class _Workers:
    """The front-end processes: started, signalled to stop (once; killed if still there ``grace`` s later), waited
    for."""

    def __init__(self, grace: float) -> None:
        self.procs: list[Any] = []
        self.grace = grace
        self.stopping = False
        self._killer: threading.Timer | None = None

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The supervisor's SIGINT/SIGTERM handler: :meth:`stop`; a second signal kills the workers at once."""
        if not self.stopping:
            self.stop()
            return
        log.warning("%s again: killing the front ends", signal.Signals(signum).name)
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        """Ask every worker to drain and exit (once)."""
        if self.stopping:
            return
        self.stopping = True
        self._signal(signal.SIGTERM)
        self._killer = threading.Timer(self.grace, self._kill)
        self._killer.daemon = True
        self._killer.start()

    def _signal(self, sig: int) -> None:
        for p in self.procs:
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, sig)

    def _kill(self) -> None:
        if any(p.is_alive() for p in self.procs):
            log.warning("front ends still running %.0f s after the stop; killing them", self.grace)
            self._signal(signal.SIGKILL)

    def wait(self) -> None:
        while any(p.is_alive() for p in self.procs):
            for p in self.procs:
                p.join(timeout=0.2)

    def finish(self) -> list[int | None]:
        """Stop whatever still runs and wait for it; every worker's exit code."""
        if any(p.is_alive() for p in self.procs):
            self.stop()
            self.wait()
        if self._killer is not None:
            self._killer.cancel()
        return [p.exitcode for p in self.procs]


def _sockets_for(sockets: socket.socket | Sequence[socket.socket] | None, host: str, port: int,
                 workers: int) -> list[socket.socket]:  # fmt: skip
    if sockets is None:
        return bind_worker_sockets(host, port, workers)
    socks = [sockets] if isinstance(sockets, socket.socket) else list(sockets)
    if len(socks) not in (1, workers):
        raise ValueError(f"{len(socks)} sockets for {workers} workers: pass one shared socket or one per worker")
    return socks


def serve_workers(engine: EngineSpec | Any, workers: int, host: str, port: int, shutdown_timeout: float = 30.0,
                  model_name: str | None = None,
                  sockets: socket.socket | Sequence[socket.socket] | None = None) -> int:  # fmt: skip
    """Serve HTTP on ``host:port`` from ``workers`` front-end processes over one engine, until SIGINT/SIGTERM; the
    exit code (2 when the engine could not be built because of the user's input).

    ``engine``: an :class:`EngineSpec` (the engine runs in a process started here) or a built ``LLM`` (its engine loop
    runs in this process; rank 0 under ``--tp`` > 1). ``sockets``: bound sockets to serve on (one shared, or one per
    worker; default :func:`~mcore_infer.engine_process._sockets.bind_worker_sockets`: a port in use raises
    :class:`~mcore_infer.errors.InvalidRequestError` naming ``host:port``, before the engine process starts)."""
    if workers < 1:
        raise ValueError(f"workers={workers} must be at least 1")
    side = _EngineProcess(engine) if isinstance(engine, EngineSpec) else _EngineHere(engine)
    try:
        for module in ("fastapi", "uvicorn"):  # the workers import them: fail here, in one line, if they cannot
            if importlib.util.find_spec(module) is None:
                raise MissingDependencyError(module, "server")
        socks = _sockets_for(sockets, host, port, workers)
    except BaseException:
        side.finish(0.0)
        raise
    return _supervise(side, workers, socks, host, port, shutdown_timeout, model_name)


def _supervise(side: _EngineProcess | _EngineHere, n: int, socks: list[socket.socket], host: str, port: int,
               shutdown_timeout: float, model_name: str | None) -> int:  # fmt: skip
    ctx = mp.get_context("spawn")
    commands = [ctx.Pipe(duplex=False) for _ in range(n)]  # (engine's read end, worker's write end)
    outputs = [ctx.Pipe(duplex=False) for _ in range(n)]  # (worker's read end, engine's write end)
    for r, _w in commands + outputs:
        widen_pipe(r)
    workers = _Workers(grace=shutdown_timeout + 15.0)
    old = {s: signal.signal(s, workers.on_signal) for s in _STOP_SIGNALS}
    level = logging.getLogger().getEffectiveLevel()
    try:
        what = side.start(ctx, [r for r, _ in commands], [w for _, w in outputs])
        for i in range(n):
            args = (i, commands[i][1], outputs[i][0], socks[i % len(socks)], model_name, shutdown_timeout, level)
            workers.procs.append(ctx.Process(target=_worker_main, args=args, name=f"mcore-infer-worker-{i}"))
            workers.procs[-1].start()
        for conn in [w for _, w in commands] + [r for r, _ in outputs]:  # the workers hold them now
            conn.close()
        for sock in socks:  # ... and their sockets: none stays open here with nobody accepting on it
            sock.close()
        log.info("serving on %s:%d with %d front-end worker%s (pids %s, %s) over %s", host, port, n, "s" * (n > 1),
                 ",".join(str(p.pid) for p in workers.procs), _socket_kind(len(socks), n), what)  # fmt: skip
        side.run(workers)
    finally:
        codes = workers.finish()
        for s, h in old.items():
            signal.signal(s, h)
        for sock in socks:
            sock.close()
        side.finish(shutdown_timeout)
    log.info("front ends stopped (exit codes %s)", ", ".join(map(str, codes)))
    return _exit_code(codes, workers.stopping)


def _socket_kind(n_socks: int, n: int) -> str:
    if n_socks > 1:
        return "one socket each (SO_REUSEPORT)"
    return "one listening socket" if n == 1 else "one shared socket"


def _exit_code(codes: list[int | None], stopping: bool) -> int:
    if any(c == USER_ERROR_EXIT for c in codes):
        return USER_ERROR_EXIT
    clean = (0, -signal.SIGTERM, -signal.SIGINT) if stopping else (0,)  # (a signal before a worker set its handlers)
    return 0 if all(c in clean for c in codes) else 1


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
