"""The front end's side of the engine process: :class:`EngineClient`, a drop-in for
:class:`~mcore_infer.async_engine.AsyncEngine` whose engine runs in another process.

No thread of the front end stands between the engine and the event loop: the loop reads the engine's pipe itself
(``add_reader`` on the loop the requests run on: every message waiting, as soon as the pipe is readable, each
request's outputs put straight on its queue) and writes commands to the engine's pipe as the handlers make them. A
reader thread would need the GIL the loop holds while it formats events, and wait up to the interpreter's switch
interval (5 ms) for it per message: the engine's pipe would fill and the engine wait. ``client.engine`` is a
read-only view with the engine's limits, its last reported load and its request checks (what the server's handlers,
``/health`` and ``/metrics`` read).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from mcore_infer.async_engine import Item, deliver, queue_batches
from mcore_infer.detokenizer import IncrementalText, text_tokens
from mcore_infer.engine import LLMEngine, RequestOutput
from mcore_infer.engine_process._worker import (
    EngineSpec,
    FrameReader,
    decode_error,
    from_wire,
    run_engine,
    widen_pipe,
)
from mcore_infer.errors import EngineDeadError, InvalidRequestError, OverloadedError, RequestFailed
from mcore_infer.images import VisionInfo
from mcore_infer.sampling import SamplingParams

__all__ = ["EngineClient", "SharedEngineClient"]


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


log = logging.getLogger(__name__)


class _Blocks:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.num_free = capacity, capacity


class _Runner:
    def __init__(self, info: dict[str, Any]) -> None:
        self.vocab_size: int = info["vocab_size"]
        self.block_size: int = info["block_size"]
        self.blocks = _Blocks(info["kv_blocks_total"])


class EngineView:
    """What the front end knows of the remote engine: its limits, its load as of its last step message (plus the
    requests sent since) and :meth:`check_request` (the engine's own checks, run in the front end)."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.max_model_len: int = info["max_model_len"]
        self.max_queue: int = info["max_queue"]
        self.vision: VisionInfo | None = info.get("vision")
        self.runner = _Runner(info)
        self.num_running = self.num_steps = self.num_aborted = 0
        self._waiting = 0
        self.unacked = 0
        self.update(info["stats"], 0)

    def check_request(self, prompt_ids: list[int], params: SamplingParams, param: str = "prompt") -> int:
        """The engine's own checks (they read only ``max_model_len`` and ``runner.{vocab_size,block_size,blocks}``)."""
        return LLMEngine.check_request(self, prompt_ids, params, param)  # type: ignore[arg-type]

    @property
    def num_waiting(self) -> int:
        return self._waiting + self.unacked

    def update(self, stats: tuple[int, int, int, int, int], added: int) -> None:
        self.num_running, self._waiting, self.runner.blocks.num_free, self.num_steps, self.num_aborted = stats
        self.unacked = max(0, self.unacked - added)


class EngineClient:
    """The :class:`~mcore_infer.async_engine.AsyncEngine` interface (``start``, ``healthy``, ``shutdown``,
    ``generate``, ``generate_batches``, ``engine``) over an engine process built from ``spec``.

    :meth:`launch` starts the process and waits until its engine is built (``tokenizer`` and ``model_name`` are set
    then). Should the process die, every waiting request gets :class:`EngineDeadError`, ``healthy`` turns false and
    new requests are refused with that error (the server answers 503); the front end keeps running.
    """

    def __init__(self, spec: EngineSpec, start_timeout: float = 1800.0) -> None:
        self.spec, self.start_timeout = spec, start_timeout
        self.engine: EngineView | None = None
        self.tokenizer: Any = None
        self.model_name = ""
        self._proc: Any = None
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Item]]] = {}
        self._reader_loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._exited = False
        self._accepting = True
        self._stopping = False
        self._dead: EngineDeadError | None = None

    # --------------------------------------------------------------------------------------------- lifecycle
    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def launch(self) -> EngineClient:
        """Start the engine process and wait for its engine (a failure to build it is raised here)."""
        if self._proc is not None:
            return self
        ctx = mp.get_context("spawn")
        cmd_r, self._cmd = ctx.Pipe(duplex=False)
        self._out, out_w = ctx.Pipe(duplex=False)
        for conn in (self._cmd, self._out):
            widen_pipe(conn)
        self._frames = FrameReader(self._out)
        self._proc = ctx.Process(target=run_engine, args=(self.spec, cmd_r, out_w), name="mcore-infer-engine")
        self._proc.start()
        cmd_r.close()  # only the child holds these ends now: its exit shows as EOF here, ours as EOF there
        out_w.close()
        atexit.register(self._reap, True)
        msg = self._first_message()
        if msg[0] == "failed":
            self._reap(True)
        self._take_ready(msg)
        log.info("engine process %d ready (%s)", self._proc.pid, self.model_name)
        return self

    def _take_ready(self, msg: tuple[Any, ...] | list[Any]) -> None:
        """The engine's first message: its limits and tokenizer (``ready``), or why it could not start (raised: a
        user's mistake as :class:`InvalidRequestError`)."""
        if msg[0] == "failed":
            err = InvalidRequestError if msg[2] else EngineDeadError
            raise err(f"the engine process could not start: {msg[1]}")
        info = msg[1]
        self.engine, self.tokenizer, self.model_name = EngineView(info), info["tokenizer"], info["name"]

    def _first_message(self) -> tuple[Any, ...]:
        deadline = time.monotonic() + self.start_timeout
        while True:
            msg = self._frames.read_one(0.1)
            if msg is not None:
                return tuple(msg)
            if self._frames.eof or not self._proc.is_alive() or time.monotonic() > deadline:
                code = self._proc.exitcode
                self._reap(True)
                raise EngineDeadError(f"the engine process did not start (exit code {code})")

    def start(self) -> None:
        """Launch (if not yet) and, called on the serving event loop (the app's startup), read the engine's pipe from
        now on: the engine sends its load to every front end each step, and a front end that waited for its first
        request to read would let that pile up in the pipe until the engine blocks writing to it."""
        self.launch()
        loop = _running_loop()
        if loop is not None:
            self._attach_reader(loop)

    @property
    def healthy(self) -> bool:
        return self._dead is None and self._proc is not None and self._proc.is_alive() and not self._stopping

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to ``timeout`` s, abort the rest, stop the engine
        process (joined; terminated if it does not exit)."""
        if self._proc is None or (self._stopping and not self._proc.is_alive()):
            return  # never started, or stopped already
        self._drain(timeout)
        self._send(("stop",))
        with self._send_lock:
            self._cmd.close()
        self._reap()
        self._detach_reader()
        if not self._exited:
            self._on_exit()
        atexit.unregister(self._reap)

    def _drain(self, timeout: float) -> None:
        """Stop taking requests, let in-flight ones finish for up to ``timeout`` s, abort the rest (and give the
        engine 5 s to confirm), then mark this client stopping."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self.healthy and self._queues and time.monotonic() < deadline:
            time.sleep(0.02)
        for rid in list(self._queues):
            self._send(("abort", rid))
        t_end = time.monotonic() + 5.0
        while self.healthy and self._queues and time.monotonic() < t_end:
            time.sleep(0.01)
        self._stopping = True

    def _reap(self, close_commands: bool = False) -> None:
        """Make sure the engine process is gone: it exits on ``stop`` or when our pipe closes (``close_commands``:
        close it now, as at exit without :meth:`shutdown`); else it is terminated."""
        self._stopping = True
        proc = self._proc
        if close_commands:
            with self._send_lock:
                self._cmd.close()
        proc.join(timeout=10.0)
        if proc.is_alive():
            log.warning("engine process %d did not stop; terminating it", proc.pid)
            proc.terminate()
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()

    # -------------------------------------------------------------------------------------------------- pipes
    def _send(self, cmd: tuple[Any, ...]) -> None:
        """Write one command to the engine (from any thread; the engine's pipe is wide, so this does not wait)."""
        with self._send_lock:
            if self._cmd.closed:
                return
            with contextlib.suppress(OSError):  # the engine process is gone; the reader reports it
                self._cmd.send([cmd])

    def _attach_reader(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the engine's pipe on ``loop`` (the loop of the first request, again after that loop closed)."""
        if self._reader_loop is loop or self._exited:
            return
        if self._reader_loop is not None and not self._reader_loop.is_closed():
            return  # another live loop reads; this loop's requests get their outputs through call_soon_threadsafe
        self._reader_loop = loop
        loop.add_reader(self._out.fileno(), self._on_readable)

    def _detach_reader(self) -> None:
        loop, self._reader_loop = self._reader_loop, None
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(Exception):
            if loop is _running_loop():
                loop.remove_reader(self._out.fileno())
            else:
                loop.call_soon_threadsafe(loop.remove_reader, self._out.fileno())

    def _on_readable(self) -> None:
        """Every message waiting in the engine's pipe (called by the loop when it is readable)."""
        try:
            for msg in self._frames.read():
                if msg[0] == "step":
                    self._on_step(*msg[1:])
            if self._frames.eof:
                self._detach_reader()
                self._on_exit()
        except OSError:
            self._detach_reader()
            self._on_exit()
        except Exception:
            log.exception("reading the engine process's output failed")
            self._detach_reader()
            self._on_exit()

    def _on_step(self, outputs: list[RequestOutput], rejects: list[Any], added: int, stats: Any) -> None:
        assert self.engine is not None
        with self._lock:
            self.engine.update(stats, added)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Item], Item]]] = {}
        items: list[tuple[str, Item]] = [(rid, decode_error(rid, enc)) for rid, enc in rejects]
        here = _running_loop()
        for out in map(from_wire, outputs):
            items.append((out.request_id, out if out.error is None else RequestFailed(out.request_id, out.error)))
        for rid, item in items:
            entry = self._queues.get(rid)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], item))
        for loop, batch in by_loop.items():
            if loop is here:
                deliver(batch)
                continue
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits there any more
                loop.call_soon_threadsafe(deliver, batch)

    @staticmethod
    def _fill_text(text: IncrementalText, outs: list[RequestOutput]) -> None:
        """The text of outputs whose engine made none, detokenized once for the batch the caller takes (a caller
        that fell behind takes several steps' outputs at once): the last output carries what all their new tokens
        add (and, when finished, the whole text)."""
        last = outs[-1]
        ids = [t for o in outs for t in o.new_token_ids] if len(outs) > 1 else last.new_token_ids
        if last.finished:
            n_text = text_tokens(last.num_output_tokens, last.finish_reason, last.stop_reason)
            ids = ids[: max(0, n_text - len(text.ids))]
        for o in outs[:-1]:
            o.new_text = ""
        last.new_text = text.add(ids, final=last.finished)
        if last.finished:
            last.text = text.text

    def _on_exit(self) -> None:
        """The engine's pipe closed: every waiting request and every later one gets :class:`EngineDeadError`."""
        with self._lock:
            if self._exited:
                return
            self._exited = True
        self._dead = EngineDeadError(self._exit_reason())
        for loop, q in list(self._queues.values()):
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(q.put_nowait, self._dead)

    def _exit_reason(self) -> str:
        self._proc.join(timeout=2.0)
        code = self._proc.exitcode
        if not self._stopping:
            log.error("the engine process %d exited (exit code %s); answering 503 from now on", self._proc.pid, code)
        return f"the engine process exited (exit code {code})"

    # ---------------------------------------------------------------------------------------------- requests
    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        stream: bool = True,
        images: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request (deltas each step when ``stream``; always a last one with ``finished``)."""
        async for batch in self.generate_batches(prompt_ids, params, request_id, stream, images):
            for out in batch:
                yield out

    async def generate_batches(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        stream: bool = True,
        images: Any = None,
    ) -> AsyncIterator[list[RequestOutput]]:
        """Every output that arrived since the caller last asked, as :meth:`AsyncEngine.generate_batches`."""
        if self.engine is None or self._dead is not None:
            raise self._dead or EngineDeadError("the engine process is not running")
        if not self._accepting:
            raise OverloadedError("the server is shutting down")
        self.engine.check_request(prompt_ids, params)
        rid = request_id or self.new_request_id()
        q: asyncio.Queue[Item] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._queues[rid] = (loop, q)
        self._attach_reader(loop)
        finished = False
        try:
            if self._dead is not None:  # died between the check above and registering: nobody would tell us
                raise self._dead
            with self._lock:
                self.engine.unacked += 1
            text = IncrementalText(self.tokenizer.decode) if stream and not params.stop else None  # stop strings
            images = images if images is not None else getattr(prompt_ids, "images", None)
            cmd: tuple[Any, ...] = ("add", rid, list(prompt_ids), params, stream, text is None)  # need engine's text?
            self._send(cmd if images is None else (*cmd, images))  # a VLM request's pixels (pickled tensor)
            async with contextlib.aclosing(queue_batches(q)) as batches:
                async for outs in batches:
                    if text is not None:
                        self._fill_text(text, outs)
                    finished = any(o.finished for o in outs)
                    yield outs
        except Exception:
            finished = True  # the engine has let it go already (failed, refused, or the process is gone)
            raise
        finally:
            self._queues.pop(rid, None)
            if not finished and self._dead is None:
                self._send(("abort", rid))


class SharedEngineClient(EngineClient):
    """An :class:`EngineClient` of one front-end worker (``serve --api-workers N``) over an engine process that
    another process started and owns (:func:`~mcore_infer.engine_process.serve_workers`): its own pair of pipes,
    request ids that name the worker, and a shutdown that only closes its pipes (the engine aborts this worker's
    requests; it stops once every worker is gone)."""

    def __init__(self, commands: Any, outputs: Any, worker: int, start_timeout: float = 1800.0) -> None:
        super().__init__(EngineSpec(_unused_factory), start_timeout)
        self._cmd, self._out, self.worker = commands, outputs, worker
        self._ids = itertools.count()
        self._prefix = f"w{worker}-req-"

    @property
    def pid(self) -> int | None:
        return None

    def launch(self) -> EngineClient:
        """Wait for the engine's ``ready`` on this worker's pipe (a failure to build it is raised here)."""
        if self.engine is not None:
            return self
        self._frames = FrameReader(self._out)
        deadline = time.monotonic() + self.start_timeout
        msg = None
        while msg is None:
            msg = self._frames.read_one(0.1)
            if msg is None and (self._frames.eof or time.monotonic() > deadline):
                raise EngineDeadError("the engine process did not start")
        self._take_ready(msg)
        return self

    @property
    def healthy(self) -> bool:
        return self._dead is None and self.engine is not None and not self._stopping

    def new_request_id(self) -> str:
        return f"{self._prefix}{next(self._ids)}"

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to ``timeout`` s, abort the rest, close the pipes."""
        if self.engine is None or self._stopping:
            return
        self._drain(timeout)
        with self._send_lock:
            self._cmd.close()
        self._detach_reader()
        self._on_exit()

    def _exit_reason(self) -> str:
        if not self._stopping:
            log.error("worker %d lost the engine process; answering 503 from now on", self.worker)
        return "the engine process exited"


def _unused_factory() -> Any:
    raise RuntimeError("a SharedEngineClient does not build an engine")
