"""The engine loop for servers: one background thread steps the engine; asyncio callers await their outputs.

Many HTTP handlers share the one :class:`~mcore_infer.engine.LLMEngine` with no lock around whole requests:
``generate`` queues a request (validation errors are raised in the caller) and yields the outputs the loop thread
hands over through the caller's event loop. When the caller stops iterating (a client disconnected, the handler
was cancelled) the request is aborted and its KV blocks are freed at the next step.

A request that failed inside the engine (an output with ``error`` set) reaches its caller as
:class:`~mcore_infer.errors.RequestFailed`, raised from ``generate``/``generate_batches`` after the outputs that came
before it; the loop and every other request go on. Should ``step`` itself raise, every request the engine holds is
failed that way and the loop keeps serving new ones; only a ``BaseException`` that is no ``Exception`` stops it (the
waiters then get :class:`~mcore_infer.errors.EngineDeadError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from mcore_infer.engine import LLMEngine, RequestOutput
from mcore_infer.errors import EngineDeadError, OverloadedError, RequestFailed
from mcore_infer.sampling import SamplingParams

__all__ = ["AsyncEngine"]

log = logging.getLogger(__name__)


Item = RequestOutput | BaseException
"""What a request's queue carries: its outputs, or the exception that ends it."""


def deliver(items: list[tuple[asyncio.Queue[Item], Item]]) -> None:
    """Put each item on its queue (called on the queues' event loop)."""
    for q, out in items:
        q.put_nowait(out)


async def queue_batches(q: asyncio.Queue[Item]) -> AsyncGenerator[list[RequestOutput], None]:
    """A request's outputs from its queue, each item every output that arrived since the last one; an exception on
    the queue is raised after the outputs before it; ends with the batch holding the finished output."""
    while True:
        batch = [await q.get()]
        while not q.empty():
            batch.append(q.get_nowait())
        outs: list[RequestOutput] = []
        for item in batch:
            if isinstance(item, BaseException):
                if outs:
                    yield outs  # what came before a failure still reaches the caller, in order
                raise item
            outs.append(item)
        yield outs
        if any(o.finished for o in outs):
            return


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Item]]] = {}
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
                self.engine.runner.keep_alive()  # (tensor parallelism: the followers wait in a collective)
                continue
            try:
                try:
                    outputs = self.engine.step()
                except Exception as e:  # step handles its own faults; this is a bug there: fail everyone, go on
                    log.exception("engine step raised; failing every request and serving on")
                    outputs = self.engine.fail_all(e)
            except BaseException as e:  # an internal fault that cannot be handled: fail every waiter, stop
                log.exception("engine loop stopped")
                self._error = e
                for loop, q in list(self._queues.values()):
                    loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(f"engine stopped: {e!r}"))
                return
            self._hand_over(outputs)

    def _hand_over(self, outputs: list[RequestOutput]) -> None:
        """One hand-over per event loop and step (not one per request: each wakes the loop through a pipe write);
        a failed request's output becomes a :class:`RequestFailed` for its caller."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Item], Item]]] = {}
        for out in outputs:
            entry = self._queues.get(out.request_id)
            if entry is not None:
                item: Item = out if out.error is None else RequestFailed(out.request_id, out.error)
                by_loop.setdefault(entry[0], []).append((entry[1], item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(deliver, items)

    # -------------------------------------------------------------------------------------------- requests
    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        stream: bool = True,
        images: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request (deltas each step when ``stream``; always a last one with ``finished``).
        ``images``: a VLM request's pixels (default: those of an :class:`~mcore_infer.images.ImagePrompt`)."""
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
        """Like :meth:`generate`, but each item is every output that arrived since the caller last asked (a server
        under load writes them to its client at once instead of one write per token)."""
        if self._error is not None or not self._accepting:
            raise (
                EngineDeadError("the engine is not accepting requests")
                if self._error
                else OverloadedError("the server is shutting down")
            )
        rid = request_id or self.engine.new_request_id()
        q: asyncio.Queue[Item] = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            images = images if images is not None else getattr(prompt_ids, "images", None)
            self.engine.add_request(prompt_ids, params, request_id=rid, stream=stream, images=images)
            self._wake.set()
            async with contextlib.aclosing(queue_batches(q)) as batches:
                async for outs in batches:
                    finished = any(o.finished for o in outs)
                    yield outs
        except RequestFailed:
            finished = True  # the engine has let it go already
            raise
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.engine.abort(rid)
                self._wake.set()
