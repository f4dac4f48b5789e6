"""The HTTP server: a thin FastAPI layer over :class:`~mcore_infer.async_engine.AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (OpenAI schemas, ``stream`` as server-sent events,
``n``, ``logprobs``, ``usage``), ``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``
(Prometheus) and Megatron's ``PUT /api``. Every error carries an OpenAI-style body ``{"error": {"message", "type",
"param", "code"}}``: 400 for bad parameters, bodies and prompts over the context length, 404 for an unknown model or
route, 405 for a wrong method, 413 for an oversized body, 500 for a bug, 503 when the engine is not running,
overloaded or shutting down.

One module per route family (``completions``, ``chat``, ``models``, ``megatron``), each listing its ``ROUTES``;
``app`` the FastAPI subclass that dispatches the completion routes without its middleware, ``errors`` holds the
HTTP error type and the exception handlers, ``streaming`` the shared helpers (body reading,
fan-out and merging of ``n`` > 1 streams, SSE framing, usage, logprobs shapes), ``protocols`` uvicorn's HTTP protocol with JSON answers to unparsable requests, ``context`` the
:class:`~mcore_infer.server.context.ServingContext` that every handler reads from ``request.app.state.serving``.

fastapi and uvicorn are imported only when the app is built or served (``pip install mcore-infer[server]``):
importing this package imports neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from mcore_infer.errors import MissingDependencyError

if TYPE_CHECKING:
    from fastapi import FastAPI

    from mcore_infer.async_engine import AsyncEngine

__all__ = ["build_app", "serve", "server_config"]

log = logging.getLogger(__name__)


def _require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(module, "server") from e


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    ctx = app.state.serving
    ctx.engine.start()
    yield
    await asyncio.to_thread(ctx.engine.shutdown, ctx.shutdown_timeout)


def build_app(engine: AsyncEngine, tokenizer: Any, model_name: str, shutdown_timeout: float = 30.0) -> FastAPI:
    """The FastAPI app; starting it starts the engine loop, stopping it drains and stops the engine."""
    _require("fastapi")
    from mcore_infer.server import chat, completions, megatron, models
    from mcore_infer.server.app import ServingApp
    from mcore_infer.server.context import ServingContext
    from mcore_infer.server.errors import exception_handlers

    app = ServingApp(title="mcore-infer", lifespan=_lifespan, exception_handlers=exception_handlers())
    app.state.serving = ServingContext(engine, tokenizer, model_name, shutdown_timeout=shutdown_timeout)
    for path, endpoint, method in (*models.ROUTES, *completions.ROUTES, *chat.ROUTES, *megatron.ROUTES):
        app.add_api_route(path, endpoint, methods=[method])
    for path, endpoint, method in (*completions.ROUTES, *chat.ROUTES):  # the hot routes skip the middleware
        if method == "POST":
            app.direct_routes[path] = endpoint
    return app


def server_config(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> Any:
    """The ``uvicorn.Config`` that :func:`serve` runs: uvicorn's own HTTP protocol, except that requests it cannot
    parse (a bad ``Content-Length``) get a JSON error body too (:mod:`mcore_infer.server.protocols`)."""
    uvicorn = _require("uvicorn")
    from mcore_infer.server.protocols import JSONErrorHTTPProtocol

    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=30, http=JSONErrorHTTPProtocol
    )


def serve(app: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run ``app`` with uvicorn until SIGINT/SIGTERM (then in-flight requests drain; see ``build_app``)."""
    uvicorn = _require("uvicorn")
    uvicorn.Server(server_config(app, host, port, log_level)).run()
