"""The server's ASGI app: FastAPI, with the completion routes dispatched straight to their handlers.

Every request through FastAPI crosses Starlette's middleware stack (server errors, exceptions, FastAPI's exit stack
and telemetry) and its router, and every event of a stream goes back out through two wrapped ``send`` functions. For
``POST /v1/completions`` and ``POST /v1/chat/completions`` that is most of the front end's time per request and per
event at high concurrency. :class:`ServingApp` calls their handlers directly (the same handler functions, a
Starlette ``Request`` over the same scope) and answers their exceptions with the app's own exception handlers, so a
response is byte for byte what the routed path gives; every other request (other routes, other methods, the
lifespan) goes through FastAPI as usual, which still lists these routes in its OpenAPI document.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

__all__ = ["ServingApp"]

log = logging.getLogger(__name__)


class ServingApp(FastAPI):
    """``FastAPI`` whose :attr:`direct_routes` (``path -> handler`` for ``POST``) skip its middleware and router."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.direct_routes: dict[str, Callable[[Request], Any]] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.direct_routes.get(scope["path"])
            if handler is not None and not scope.get("root_path"):
                scope["app"] = self
                await self._direct(handler, scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    async def _direct(self, handler: Callable[[Request], Any], scope: Any, receive: Any, send: Any) -> None:
        request = Request(scope, receive, send)
        failed: Exception | None = None
        try:
            result = await handler(request)
            response = result if isinstance(result, Response) else JSONResponse(result)
        except Exception as e:
            response, failed = await self._answer(request, e), e
        await response(scope, receive, send)
        if failed is not None and response.status_code >= 500 and not _known(failed):
            # (the routed path re-raises an unexpected exception for uvicorn to log; here it is logged)
            log.error("exception in %s %s", scope["method"], scope["path"], exc_info=failed)

    async def _answer(self, request: Request, e: Exception) -> Response:
        """The response of the app's exception handler for ``e`` (the most specific class it names)."""
        for cls in type(e).__mro__:
            handler = self.exception_handlers.get(cls)
            if handler is not None:
                response = handler(request, e)
                return await response if inspect.isawaitable(response) else response
        raise e


def _known(e: Exception) -> bool:
    from mcore_infer.errors import InferError
    from mcore_infer.server.errors import ClientGone, HTTPError

    return isinstance(e, InferError | HTTPError | ClientGone)
