"""The server's HTTP errors and the exception handlers that answer them with OpenAI-style error bodies
(``{"error": {"message", "type", "param", "code"}}``): every failure a request can cause, including unknown routes,
wrong methods and unexpected exceptions (a 500 with that body, never plain text)."""

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mcore_infer.errors import EngineDeadError, InferError, InvalidRequestError, OverloadedError
from mcore_infer.protocol import error_body

__all__ = ["ClientGone", "HTTPError", "error_response", "exception_handlers"]

Handler = Callable[[Request, Any], Coroutine[Any, Any, Response]]


class HTTPError(Exception):
    """Answered with ``status`` and the error body built from the other fields."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, kind, param, code)


class ClientGone(Exception):
    """The client hung up before its non-streamed answer was ready (answered with 499, which nobody reads)."""


def error_response(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


async def on_http_error(_: Request, e: HTTPError) -> Response:
    return error_response(e.status, e.body)


async def on_invalid_request(_: Request, e: InvalidRequestError) -> Response:
    return error_response(400, error_body(e.message, "invalid_request_error", e.param, e.code))


async def on_overloaded(_: Request, e: OverloadedError) -> Response:
    return error_response(503, error_body(str(e), "server_error", None, "overloaded"))


async def on_engine_dead(_: Request, e: EngineDeadError) -> Response:
    return error_response(503, error_body(str(e), "server_error", None, "engine_unavailable"))


async def on_client_gone(_: Request, e: ClientGone) -> Response:
    return Response(status_code=499)


_ROUTING_CODES = {404: "unknown_url", 405: "method_not_allowed"}


async def on_routing_error(request: Request, e: Any) -> Response:
    """The router's errors, Starlette ``HTTPException`` s: an unknown route (404), a wrong method (405, with its
    ``Allow`` header)."""
    where = f"{request.method} {request.url.path}"
    message = f"Invalid URL ({where})" if e.status_code == 404 else f"{e.detail} ({where})"
    body = error_body(message, "invalid_request_error", None, _ROUTING_CODES.get(e.status_code))
    return error_response(e.status_code, body, headers=dict(e.headers or {}))


async def on_unexpected(request: Request, e: Exception) -> Response:
    """Anything else a handler raised: a bug, answered with 500. Starlette re-raises it after the response is sent,
    so uvicorn logs it with its traceback and closes the connection: the response says so (``Connection: close``),
    so that no client sends its next request down a connection about to close. An mcore-infer error's message is
    shown (one request failed inside the engine); any other exception's only by its type."""
    message = str(e) if isinstance(e, InferError) else f"internal server error ({type(e).__name__})"
    body = error_body(message, "server_error", None, "internal_error")
    return error_response(500, body, headers={"connection": "close"})


def exception_handlers() -> dict[int | type[Exception], Handler]:
    """The handlers to build the app with (``FastAPI(exception_handlers=...)``)."""
    return {
        HTTPError: on_http_error,
        InvalidRequestError: on_invalid_request,
        OverloadedError: on_overloaded,
        EngineDeadError: on_engine_dead,
        ClientGone: on_client_gone,
        **{status: on_routing_error for status in _ROUTING_CODES},
        Exception: on_unexpected,
    }
