"""``GET /v1/models`` and ``GET /v1/models/{id}`` (the one model this server serves), ``GET /health`` (the engine
loop is alive, with its load) and ``GET /metrics`` (the same numbers and the engine's counters, in Prometheus'
text format)."""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request) at runtime

from typing import Any

from fastapi import Request
from fastapi.responses import PlainTextResponse

from mcore_infer.protocol import error_body
from mcore_infer.server.context import Route, ServingContext, serving
from mcore_infer.server.errors import HTTPError, error_response

__all__ = ["ROUTES", "engine_stats", "prometheus_text"]

_METRICS: list[tuple[str, str, str]] = [
    ("healthy", "gauge", "1 while the engine loop runs"),
    ("requests_running", "gauge", "requests in the running batch"),
    ("requests_waiting", "gauge", "requests queued, not yet scheduled"),
    ("kv_blocks_total", "gauge", "KV-cache blocks a request can use"),
    ("kv_blocks_free", "gauge", "KV-cache blocks free"),
    ("kv_blocks_used", "gauge", "KV-cache blocks held by requests"),
    ("engine_steps_total", "counter", "engine steps run"),
    ("requests_aborted_total", "counter", "requests aborted (client gone, stop string in a stream, shutdown)"),
]


def engine_stats(ctx: ServingContext) -> dict[str, int]:
    """The engine's load, read from its public attributes (plain integers the engine thread updates)."""
    aeng = ctx.engine
    eng = aeng.engine
    blocks = eng.runner.blocks
    total, free = blocks.capacity, blocks.num_free
    return {
        "healthy": int(aeng.healthy),
        "requests_running": eng.num_running,
        "requests_waiting": eng.num_waiting,
        "kv_blocks_total": total,
        "kv_blocks_free": free,
        "kv_blocks_used": total - free,
        "engine_steps_total": eng.num_steps,
        "requests_aborted_total": eng.num_aborted,
    }


def prometheus_text(stats: dict[str, int], model_name: str, prefix: str = "mcore_infer_") -> str:
    """``stats`` in Prometheus' text exposition format (version 0.0.4), each sample labelled with the model."""
    label = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    lines = []
    for name, kind, doc in _METRICS:
        lines += [f"# HELP {prefix}{name} {doc}", f"# TYPE {prefix}{name} {kind}"]
        lines.append(f'{prefix}{name}{{model="{label}"}} {stats[name]}')
    return "\n".join(lines) + "\n"


# GET /health (no docstring: FastAPI would publish it in the OpenAPI schema)
async def health(request: Request) -> Any:
    ctx = serving(request)
    stats = engine_stats(ctx)
    if not stats["healthy"]:
        return error_response(503, error_body("engine not running", "server_error", None, "engine_unavailable"))
    return {
        "status": "ok",
        "running": stats["requests_running"],
        "waiting": stats["requests_waiting"],
        "kv_blocks": {k: stats[f"kv_blocks_{k}"] for k in ("total", "free", "used")},
    }


# GET /metrics (no docstring: FastAPI would publish it in the OpenAPI schema)
async def metrics(request: Request) -> Any:
    ctx = serving(request)
    text = prometheus_text(engine_stats(ctx), ctx.model_name)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _card(ctx: ServingContext) -> dict[str, Any]:
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "mcore",
        "max_model_len": ctx.max_model_len,
    }


# GET /v1/models (no docstring: FastAPI would publish it in the OpenAPI schema)
async def models(request: Request) -> Any:
    return {"object": "list", "data": [_card(serving(request))]}


# GET /v1/models/{model_id} (no docstring: FastAPI would publish it in the OpenAPI schema)
async def model(request: Request, model_id: str) -> Any:
    ctx = serving(request)
    if model_id != ctx.model_name:
        msg = f"The model '{model_id}' does not exist; this server serves '{ctx.model_name}'"
        raise HTTPError(404, msg, "invalid_request_error", "model", "model_not_found")
    return _card(ctx)


ROUTES: list[Route] = [
    ("/health", health, "GET"),
    ("/metrics", metrics, "GET"),
    ("/v1/models", models, "GET"),
    ("/v1/models/{model_id:path}", model, "GET"),
]
