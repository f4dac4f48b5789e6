"""The streamed response of the completion routes: server-sent events written straight to the ASGI ``send``.

Starlette's ``StreamingResponse`` runs the body in a task group beside a task that listens for the client hanging up
(ASGI servers before spec 2.4 do not raise when a client is gone), so every event crosses tasks and cancel scopes.
:class:`EventStreamResponse` writes each event from the handler's own task and watches for the hang-up with one
pending ``receive()``: when it reports ``http.disconnect``, the handler's task is cancelled wherever it waits (for
the engine, usually), the events' generator is closed (which aborts the engine's requests) and the response ends
quietly. A cancellation that does not come from the hang-up (the server stopping) propagates as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response  # (starlette's, which fastapi re-exports)

__all__ = ["EventStreamResponse"]

HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # a proxy in front (nginx) passes each event on at once
]


class EventStreamResponse(Response):
    """``text/event-stream`` from ``events`` (each item one write: the events that are ready, as text)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]) -> None:  # no super().__init__: there is no body to render
        self.events = events
        self.status_code = 200
        self.background: Any = None  # FastAPI may set its BackgroundTasks here
        self.raw_headers = list(HEADERS)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for text in self.events:
                await send({"type": "http.response.body", "body": text.encode(), "more_body": True})
            watcher.cancel()  # before the last write: the server reports the finished response as a disconnect
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            uncancel = getattr(task, "uncancel", None)  # Python 3.11+: the task is no longer being cancelled
            if uncancel is not None:
                uncancel()  # the client hung up: nothing is left to write to
        finally:
            watcher.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self.events.aclose()  # type: ignore[attr-defined]
        if self.background is not None:
            await self.background()
