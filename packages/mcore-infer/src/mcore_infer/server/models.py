"""``GET /v1/models`` (the one model this server serves) and ``GET /health`` (the engine loop is alive)."""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request) at runtime

from typing import Any

from fastapi import Request

from mcore_infer.protocol import error_body
from mcore_infer.server.context import Route, serving
from mcore_infer.server.errors import error_response

__all__ = ["ROUTES"]


# GET /health (no docstring: FastAPI would publish it in the OpenAPI schema)
async def health(request: Request) -> Any:
    engine = serving(request).engine
    if not engine.healthy:
        return error_response(503, error_body("engine not running", "server_error", None, "engine_unavailable"))
    return {"status": "ok", "running": engine.engine.num_running, "waiting": engine.engine.num_waiting}


# GET /v1/models (no docstring: FastAPI would publish it in the OpenAPI schema)
async def models(request: Request) -> Any:
    ctx = serving(request)
    card = {
        "id": ctx.model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "mcore",
        "max_model_len": ctx.max_model_len,
    }
    return {"object": "list", "data": [card]}


ROUTES: list[Route] = [("/health", health, "GET"), ("/v1/models", models, "GET")]
