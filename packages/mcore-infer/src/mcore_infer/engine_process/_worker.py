"""The engine process: builds the LLM from an :class:`EngineSpec`, then steps its engine and answers over two pipes.

Messages (pickled, each side sends lists or tuples of plain values; engine -> front end in frames of
:func:`send_frame`, read by :class:`FrameReader`):

* front end -> engine, one list of commands per send: ``("add", request_id, prompt_ids, params, stream,
  detokenize)`` (``detokenize=False``: the front end makes the text of this streamed request itself; a VLM
  request's pixels follow as a seventh value),
  ``("abort", request_id)``, ``("stop",)``.
* engine -> front end: first ``("ready", info)`` (tokenizer, model name, limits) or ``("failed", message,
  user_error)``; then one ``("step", outputs, rejects, added, stats)`` per engine step that produced anything (every
  request's new output of that step in one message, each as :func:`to_wire` writes it), ``rejects`` the
  ``(request_id, error)`` of adds that the engine refused (see :func:`encode_error`), ``added`` how many adds it took,
  ``stats`` its load (:func:`engine_stats`).

The engine never waits for the front end: the pipes are made as large as the system allows (:func:`widen_pipe`, 1 MiB
on Linux: hundreds of steps of output), and the front end reads them on its event loop as they fill. The loop ends at
``stop`` or when the front end's pipe closes (the front end exited or was killed): no orphan. Under ``--tp`` > 1,
rank 0 runs the same loop (:func:`serve_engine`) over the ``LLM`` it built, in its own process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import selectors
import signal
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from mcore_infer.engine import LLMEngine, RequestOutput
from mcore_infer.errors import (
    ContextLengthError,
    EngineDeadError,
    InferError,
    InvalidRequestError,
    OverloadedError,
    RequestFailed,
)

__all__ = [
    "EngineSpec",
    "FrameReader",
    "decode_error",
    "encode_error",
    "engine_stats",
    "from_wire",
    "run_engine",
    "send_frame",
    "serve_engine",
    "to_wire",
    "widen_pipe",
]

log = logging.getLogger(__name__)

EncodedError = tuple[str, str, str | None, str | None]


@dataclass(frozen=True)
class EngineSpec:
    """How the engine process builds its ``LLM``: ``factory(*args, **kwargs)``, a module-level callable (pickled by
    reference), e.g. the CLI's ``_build_llm`` with its parsed arguments or a test's tiny-model builder."""

    factory: Callable[..., Any]
    """Returns an :class:`~mcore_infer.api.LLM` (one TP rank)."""
    args: tuple[Any, ...] = ()
    """Positional arguments of ``factory`` (picklable)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of ``factory`` (picklable)."""
    log_level: int = logging.INFO
    """The engine process's logging level (it logs to stderr)."""


# ------------------------------------------------------------------------------------------------ errors
_ERRORS: dict[str, type[InferError]] = {
    c.__name__: c for c in (InvalidRequestError, ContextLengthError, OverloadedError, EngineDeadError)
}


def encode_error(e: BaseException) -> EncodedError:
    """An exception as plain values (mcore-infer's exceptions do not round-trip through pickle with their fields)."""
    return type(e).__name__, getattr(e, "message", None) or str(e), getattr(e, "param", None), getattr(e, "code", None)


def decode_error(request_id: str, enc: EncodedError) -> InferError:
    """The exception :func:`encode_error` described; an unknown kind is a :class:`RequestFailed`."""
    kind, message, param, code = enc
    cls = _ERRORS.get(kind)
    if cls is ContextLengthError:
        return ContextLengthError(message, param)
    if cls is InvalidRequestError:
        return InvalidRequestError(message, param, code)
    if cls is not None:
        return cls(message)
    return RequestFailed(request_id, f"{kind}: {message}")


# ---------------------------------------------------------------------------------------------- transport
PIPE_BYTES = 1 << 20
"""The pipe buffer :func:`widen_pipe` asks for (Linux's default ``/proc/sys/fs/pipe-max-size``)."""

Wire = RequestOutput | tuple[str, list[int], str, int, int]


def widen_pipe(conn: Connection, size: int = PIPE_BYTES) -> int:
    """Grow the kernel buffer of the pipe under ``conn`` to ``size`` bytes where the system allows (Linux); its size
    after (0 where it cannot be known)."""
    try:
        import fcntl

        set_size, get_size = getattr(fcntl, "F_SETPIPE_SZ", 1031), getattr(fcntl, "F_GETPIPE_SZ", 1032)
        try:
            fcntl.fcntl(conn.fileno(), set_size, size)
        except OSError:  # above pipe-max-size for this user: keep the default
            log.debug("could not grow the pipe buffer to %d bytes", size)
        return int(fcntl.fcntl(conn.fileno(), get_size))
    except (ImportError, OSError, ValueError):
        return 0


_HEADER = struct.Struct("<Q")


def send_frame(conn: Connection, msg: Any) -> None:
    """Write ``msg`` pickled, behind its length (8 bytes, little-endian), to the pipe under ``conn`` (blocking)."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    fd = conn.fileno()
    while view:
        view = view[os.write(fd, view) :]


class FrameReader:
    """The messages of :func:`send_frame` from the read end of a pipe set non-blocking here: :meth:`read` takes
    whatever the pipe holds and returns every whole message in it (an event loop calls it when the pipe is
    readable); :meth:`read_one` blocks (with a poll timeout) for one message."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.fd = conn, conn.fileno()
        os.set_blocking(self.fd, False)
        self.buf = bytearray()
        self.eof = False

    def read(self) -> list[Any]:
        """Every whole message now readable; sets ``eof`` once the writer has closed its end."""
        while True:
            try:
                chunk = os.read(self.fd, PIPE_BYTES)
            except BlockingIOError:
                break
            if not chunk:
                self.eof = True
                break
            self.buf += chunk
        msgs, pos, n = [], 0, len(self.buf)
        while n - pos >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self.buf, pos)
            if n - pos - _HEADER.size < size:
                break
            start = pos + _HEADER.size
            msgs.append(pickle.loads(self.buf[start : start + size]))
            pos = start + size
        del self.buf[:pos]
        return msgs

    def read_one(self, timeout: float) -> Any | None:
        """The next message, waiting up to ``timeout`` s for it (None if none came; ``eof`` tells a closed pipe)."""
        deadline = time.monotonic() + timeout
        pending: list[Any] = []
        while not pending and not self.eof:
            pending = self.read()
            if pending or self.eof:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.conn.poll(min(left, 0.1))
        if len(pending) > 1:
            raise RuntimeError("read_one: more than one message arrived")  # only the first message is read so
        return pending[0] if pending else None


def to_wire(out: RequestOutput) -> Wire:
    """An output as it crosses the pipe: the usual streamed delta (new tokens and text, nothing else set) as a plain
    tuple ``(request_id, new_token_ids, new_text, num_prompt_tokens, num_output_tokens)``, five times cheaper to
    pickle than the dataclass; any other output whole."""
    if (
        out.finished
        or out.finish_reason is not None
        or out.new_logprobs is not None
        or out.prompt_logprobs is not None
        or out.error is not None
        or out.stop_reason is not None
        or out.metrics
    ):
        return out
    return out.request_id, out.new_token_ids, out.new_text, out.num_prompt_tokens, out.num_output_tokens


def from_wire(w: Wire) -> RequestOutput:
    """The output :func:`to_wire` sent."""
    if isinstance(w, RequestOutput):
        return w
    rid, ids, text, n_prompt, n_out = w
    return RequestOutput(rid, ids, text, None, None, False, num_prompt_tokens=n_prompt, num_output_tokens=n_out)


# -------------------------------------------------------------------------------------------------- loop
def engine_stats(engine: LLMEngine) -> tuple[int, int, int, int, int]:
    """``(running, waiting, kv_blocks_free, steps, aborted)``."""
    return (engine.num_running, engine.num_waiting, engine.runner.blocks.num_free, engine.num_steps,
            engine.num_aborted)  # fmt: skip


def _info(llm: Any) -> dict[str, Any]:
    eng = llm.engine
    return {
        "tokenizer": llm.tokenizer,
        "name": llm.name,
        "max_model_len": eng.max_model_len,
        "max_queue": eng.max_queue,
        "vocab_size": llm.runner.vocab_size,
        "block_size": llm.runner.block_size,
        "kv_blocks_total": llm.runner.blocks.capacity,
        "vision": eng.vision,
        "stats": engine_stats(eng),
    }


def _is_user_error(e: BaseException) -> bool:
    try:
        from mcore_infer.cli import _user_errors

        return isinstance(e, _user_errors())
    except ImportError:
        return isinstance(e, InvalidRequestError)


def run_engine(
    spec: EngineSpec, commands: Connection | list[Connection], outputs: Connection | list[Connection]
) -> None:
    """The engine process's entry point (``multiprocessing`` target): one front end's pipes, or a list of pipes per
    front end (``--api-workers``); every front end gets the ``ready`` (or ``failed``) message."""
    cmds = commands if isinstance(commands, list) else [commands]
    outs = outputs if isinstance(outputs, list) else [outputs]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the front end drains
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    try:
        llm = spec.factory(*spec.args, **spec.kwargs)
        info = _info(llm)
    except Exception as e:
        user = _is_user_error(e)
        if not user:  # a user's mistake is reported by the front end in one line; anything else with its trace
            log.exception("the engine process could not build its engine")
        for conn in outs:
            with contextlib.suppress(OSError):
                send_frame(conn, ("failed", str(e) if user else f"{type(e).__name__}: {e}", user))
        return
    serve_engine(llm, cmds, outs, info)
    log.info("engine process stopped")


def serve_engine(llm: Any, commands: list[Connection], outputs: list[Connection],
                 info: dict[str, Any] | None = None) -> None:  # fmt: skip
    """Serve the front ends on these pipes (``commands[i]``, ``outputs[i]`` for front end ``i``) from the built
    ``llm`` in the calling thread: each gets the ``ready`` message, then the engine loop runs until ``stop`` or until
    every front end's pipe closed, and ``llm.shutdown()`` releases the other TP ranks. The engine process's loop
    (:func:`run_engine`), and rank 0's under ``--tp`` > 1 (:func:`~mcore_infer.engine_process.serve_workers`)."""
    try:
        info = info or _info(llm)
        for conn in outputs:
            with contextlib.suppress(OSError):
                send_frame(conn, ("ready", info))
        _loop(llm.engine, _FrontEnds(commands, outputs))
    finally:
        llm.shutdown()


class _FrontEnds:
    """The front ends an engine process serves (one, or ``--api-workers`` of them): their pipes, and which front end
    each request came from (its outputs go back there)."""

    def __init__(self, commands: list[Connection], outputs: list[Connection]) -> None:
        self.commands, self.outputs = commands, outputs
        self.open = list(range(len(commands)))
        self.owner: dict[str, int] = {}
        # several front ends: one selector over their command pipes, registered once (not a select set per poll)
        self.selector: selectors.BaseSelector | None = None
        if len(commands) > 1:
            self.selector = selectors.DefaultSelector()
            for i, conn in enumerate(commands):
                self.selector.register(conn.fileno(), selectors.EVENT_READ, i)

    def close(self, engine: LLMEngine, i: int, why: str) -> None:
        """Front end ``i`` is gone: abort its requests (their blocks are freed at the next step)."""
        if i not in self.open:
            return
        self.open.remove(i)
        if self.selector is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self.selector.unregister(self.commands[i].fileno())
        gone = [rid for rid, owner in self.owner.items() if owner == i]
        log.warning("front end %d %s; aborting its %d requests", i, why, len(gone))
        for rid in gone:
            engine.abort(rid)


def _apply(engine: LLMEngine, fronts: _FrontEnds, i: int, cmd: tuple[Any, ...], rejects: list[Any],
           added: list[int]) -> bool:  # fmt: skip
    """One command of front end ``i``; True for ``stop``."""
    if cmd[0] == "add":
        _, rid, ids, params, stream, detokenize, *images = cmd  # (a VLM request's pixels last)
        fronts.owner[rid] = i
        try:
            engine.add_request(ids, params, request_id=rid, stream=stream, detokenize=detokenize,
                               images=images[0] if images else None)  # fmt: skip
        except Exception as e:
            rejects.append((rid, encode_error(e)))
        added[i] += 1
    elif cmd[0] == "abort":
        engine.abort(cmd[1])
    elif cmd[0] == "stop":
        return True
    return False


def _ready(fronts: _FrontEnds, wait: float | None) -> list[int]:
    """The open front ends with commands (or a closed pipe) to read, after up to ``wait`` s (None: until one)."""
    if fronts.selector is None:  # the usual single front end
        return list(fronts.open) if fronts.open and fronts.commands[fronts.open[0]].poll(wait) else []
    return sorted(key.data for key, _ in fronts.selector.select(wait) if key.data in fronts.open)


def _take_commands(engine: LLMEngine, fronts: _FrontEnds, wait: float | None) -> tuple[list[Any], list[int], bool]:
    """Apply every command waiting (after up to ``wait`` s; None: until one comes); ``(rejects, added per front
    end, stop)``. A front end whose pipe closed is gone (its requests aborted); none left is a stop."""
    rejects: list[tuple[str, EncodedError]] = []
    added = [0] * len(fronts.commands)
    stop = False
    ready = _ready(fronts, wait)
    while ready:
        for i in ready:
            conn = fronts.commands[i]
            try:
                while conn.poll(0):
                    for cmd in conn.recv():
                        stop = _apply(engine, fronts, i, cmd, rejects, added) or stop
            except (EOFError, OSError):
                fronts.close(engine, i, "closed its pipe")
        ready = _ready(fronts, 0) if fronts.open else []
    if not fronts.open:
        log.warning("every front end's pipe closed; stopping")
        stop = True
    return rejects, added, stop


def _step(engine: LLMEngine) -> list[RequestOutput]:
    try:
        return engine.step()
    except Exception as e:  # step handles its own faults; this is a bug there: fail everyone, go on
        log.exception("engine step raised; failing every request and serving on")
        return engine.fail_all(e)


def _send_step(engine: LLMEngine, fronts: _FrontEnds, outs: list[RequestOutput], rejects: list[Any],
               added: list[int], stats: tuple[int, ...], changed: bool) -> None:  # fmt: skip
    """Each front end its requests' outputs and refusals of this step (and the engine's load when it changed)."""
    mine: dict[int, tuple[list[Any], list[Any]]] = {i: ([], []) for i in fronts.open}
    single = len(fronts.commands) == 1
    for o in outs:
        i = 0 if single else fronts.owner.get(o.request_id, -1)
        if o.finished:
            fronts.owner.pop(o.request_id, None)
        if i in mine:
            mine[i][0].append(to_wire(o))
    for rid, enc in rejects:
        i = fronts.owner.pop(rid, -1)
        if i in mine:
            mine[i][1].append((rid, enc))
    for i, (wire, rej) in mine.items():
        if wire or rej or added[i] or changed:
            try:
                send_frame(fronts.outputs[i], ("step", wire, rej, added[i], stats))
            except OSError:
                fronts.close(engine, i, "is gone")


IDLE_WAKE_S = 5.0
"""How long an idle engine loop waits for a command before it looks whether its followers need a keep-alive."""


def _loop(engine: LLMEngine, fronts: _FrontEnds) -> None:
    stats = engine_stats(engine)
    clock = time.perf_counter
    spent = {"commands": 0.0, "step": 0.0, "send": 0.0}
    steps = 0
    try:
        while fronts.open:
            t0 = clock()
            idle = not engine.has_work()  # then wait for a command, waking to keep tensor-parallel followers alive
            rejects, added, stop = _take_commands(engine, fronts, IDLE_WAKE_S if idle else 0)
            t1 = clock()
            if stop:
                return
            if idle:
                engine.runner.keep_alive()
            outs = _step(engine) if engine.has_work() else []
            t2 = clock()
            now = engine_stats(engine)
            if outs or rejects or any(added) or now != stats:
                _send_step(engine, fronts, outs, rejects, added, now, now != stats)
                stats = now
            steps += bool(outs)
            if engine.has_work() or outs:  # (time blocked waiting for a first command is not counted)
                spent["commands"] += t1 - t0
            spent["step"] += t2 - t1
            spent["send"] += clock() - t2
    finally:
        log.info("engine loop: %d steps with output; seconds in commands %.3f, steps %.3f, sending %.3f", steps,
                 spent["commands"], spent["step"], spent["send"])  # fmt: skip
