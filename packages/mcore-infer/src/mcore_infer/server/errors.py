"""The server's HTTP errors and the exception handlers that answer them with OpenAI-style error bodies
(``{"error": {"message", "type", "param", "code"}}``)."""

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mcore_infer.errors import EngineDeadError, InvalidRequestError, OverloadedError
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


def error_response(status: int, body: dict[str, Any]) -> JSONResponse:
    return JSONResponse(body, status_code=status)


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


def exception_handlers() -> dict[int | type[Exception], Handler]:
    """The handlers to build the app with (``FastAPI(exception_handlers=...)``)."""
    return {
        HTTPError: on_http_error,
        InvalidRequestError: on_invalid_request,
        OverloadedError: on_overloaded,
        EngineDeadError: on_engine_dead,
        ClientGone: on_client_gone,
    }
