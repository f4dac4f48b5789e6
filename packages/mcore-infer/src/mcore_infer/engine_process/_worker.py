"""The engine process: builds the LLM from an :class:`EngineSpec`, then steps its engine and answers over two pipes.

Messages (pickled, each side sends lists or tuples of plain values):

* front end -> engine, one list of commands per send: ``("add", request_id, prompt_ids, params, stream)``,
  ``("abort", request_id)``, ``("stop",)``.
* engine -> front end: first ``("ready", info)`` (tokenizer, model name, limits) or ``("failed", message,
  user_error)``; then one ``("step", outputs, rejects, added, stats)`` per engine step that produced anything (every
  request's new output of that step in one message), ``rejects`` the ``(request_id, error)`` of adds that the engine
  refused (see :func:`encode_error`), ``added`` how many adds it took, ``stats`` its load (:func:`engine_stats`).

The loop ends at ``stop`` or when the front end's pipe closes (the front end exited or was killed): no orphan.
"""

from __future__ import annotations

import logging
import signal
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

__all__ = ["EngineSpec", "decode_error", "encode_error", "engine_stats", "run_engine"]

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
        "stats": engine_stats(eng),
    }


def _is_user_error(e: BaseException) -> bool:
    try:
        from mcore_infer.cli import _user_errors

        return isinstance(e, _user_errors())
    except ImportError:
        return isinstance(e, InvalidRequestError)


def run_engine(spec: EngineSpec, commands: Connection, outputs: Connection) -> None:
    """The engine process's entry point (``multiprocessing`` target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the front end drains
    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    try:
        llm = spec.factory(*spec.args, **spec.kwargs)
        info = _info(llm)
    except Exception as e:
        log.exception("the engine process could not build its engine")
        outputs.send(("failed", f"{type(e).__name__}: {e}", _is_user_error(e)))
        return
    outputs.send(("ready", info))
    try:
        _loop(llm.engine, commands, outputs)
    finally:
        llm.shutdown()
    log.info("engine process stopped")


def _take_commands(engine: LLMEngine, commands: Connection, wait: float | None) -> tuple[list[Any], int, bool]:
    """Apply every command waiting (after up to ``wait`` s; None: until one comes); ``(rejects, added, stop)``.
    A closed pipe (the front end is gone) is a stop."""
    rejects: list[tuple[str, EncodedError]] = []
    added, stop = 0, False
    try:
        ready = commands.poll(wait)
        while ready:
            for cmd in commands.recv():
                if cmd[0] == "add":
                    _, rid, ids, params, stream = cmd
                    try:
                        engine.add_request(ids, params, request_id=rid, stream=stream)
                    except Exception as e:
                        rejects.append((rid, encode_error(e)))
                    added += 1
                elif cmd[0] == "abort":
                    engine.abort(cmd[1])
                elif cmd[0] == "stop":
                    stop = True
            ready = commands.poll(0)
    except (EOFError, OSError):
        log.warning("the front end's pipe closed; stopping")
        stop = True
    return rejects, added, stop


def _step(engine: LLMEngine) -> list[RequestOutput]:
    try:
        return engine.step()
    except Exception as e:  # step handles its own faults; this is a bug there: fail everyone, go on
        log.exception("engine step raised; failing every request and serving on")
        return engine.fail_all(e)


def _loop(engine: LLMEngine, commands: Connection, outputs: Connection) -> None:
    stats = engine_stats(engine)
    while True:
        rejects, added, stop = _take_commands(engine, commands, 0 if engine.has_work() else None)
        if stop:
            return
        outs = _step(engine) if engine.has_work() else []
        now = engine_stats(engine)
        if outs or rejects or added or now != stats:
            try:
                outputs.send(("step", outs, rejects, added, now))
            except (BrokenPipeError, OSError):
                log.warning("the front end is gone; stopping")
                return
            stats = now
