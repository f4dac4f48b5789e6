"""The engine loop for servers: one background thread steps the engine; asyncio callers await their outputs.

Many HTTP handlers share the one :class:`~mcore_infer.engine.LLMEngine` with no lock around whole requests:
``generate`` queues a request (validation errors are raised in the caller) and yields the outputs the loop thread
hands over through the caller's event loop. When the caller stops iterating (a client disconnected, the handler
was cancelled) the request is aborted and its KV blocks are freed at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator

from mcore_infer.engine import LLMEngine, RequestOutput
from mcore_infer.errors import EngineDeadError, OverloadedError
from mcore_infer.sampling import SamplingParams

__all__ = ["AsyncEngine"]

log = logging.getLogger(__name__)


def _deliver(items: list[tuple[asyncio.Queue[RequestOutput | BaseException], RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._accepting = True
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    # --------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mcore-infer-engine", daemon=True)
            self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._error is None and self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to ``timeout`` s, abort the rest, stop."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self.healthy and self.engine.has_work() and time.monotonic() < deadline:
            time.sleep(0.02)
        for rid in list(self._queues):
            self.engine.abort(rid)
        self._wake.set()
        t_end = time.monotonic() + 5.0
        while self.healthy and self.engine.has_work() and time.monotonic() < t_end:
            time.sleep(0.01)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        self.engine.runner.stop_followers()

    # ------------------------------------------------------------------------------------------------ loop
    def _loop(self) -> None:
        while not self._stop:
            if not self.engine.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except BaseException as e:  # an internal fault: fail every waiter, stop
                log.exception("engine step failed")
                self._error = e
                for loop, q in list(self._queues.values()):
                    loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(f"engine stopped: {e!r}"))
                return
            # one hand-over per event loop and step (not one per request: each wakes the loop through a pipe write)
            by_loop: dict[
                asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestOutput | BaseException], RequestOutput]]
            ] = {}
            for out in outputs:
                entry = self._queues.get(out.request_id)
                if entry is not None:
                    by_loop.setdefault(entry[0], []).append((entry[1], out))
            for loop, items in by_loop.items():
                loop.call_soon_threadsafe(_deliver, items)

    # -------------------------------------------------------------------------------------------- requests
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, stream: bool = True
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request (deltas each step when ``stream``; always a last one with ``finished``)."""
        async for batch in self.generate_batches(prompt_ids, params, request_id, stream):
            for out in batch:
                yield out

    async def generate_batches(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, stream: bool = True
    ) -> AsyncIterator[list[RequestOutput]]:
        """Like :meth:`generate`, but each item is every output that arrived since the caller last asked (a server
        under load writes them to its client at once instead of one write per token)."""
        if self._error is not None or not self._accepting:
            raise (
                EngineDeadError("the engine is not accepting requests")
                if self._error
                else OverloadedError("the server is shutting down")
            )
        rid = request_id or self.engine.new_request_id()
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            self.engine.add_request(prompt_ids, params, request_id=rid, stream=stream)
            self._wake.set()
            while True:
                batch = [await q.get()]
                while not q.empty():
                    batch.append(q.get_nowait())
                outs: list[RequestOutput] = []
                error: BaseException | None = None
                for item in batch:
                    if isinstance(item, BaseException):
                        error = item
                        break
                    outs.append(item)
                finished = any(o.finished for o in outs)
                if outs:
                    yield outs  # what came before a failure still reaches the caller, in order
                if error is not None:
                    raise error
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.engine.abort(rid)
                self._wake.set()
