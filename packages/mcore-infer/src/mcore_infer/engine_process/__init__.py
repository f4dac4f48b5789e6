"""The engine in its own process, the HTTP front end in another (``mcore-infer serve``'s default).

:class:`EngineClient` has :class:`~mcore_infer.async_engine.AsyncEngine`'s interface, so the server runs on it
unchanged; the engine process (:func:`~mcore_infer.engine_process._worker.run_engine`, started with ``spawn``)
builds its ``LLM`` from an :class:`EngineSpec` and sends one message per engine step with every request's new
output. The front end's JSON, SSE and HTTP work then no longer holds the GIL the engine loop needs.
:func:`serve_workers` runs several front-end processes over one engine (``serve --api-workers N``): an engine process
it starts (``--tp 1``), or the engine loop in the calling process over an ``LLM`` built there (rank 0 under
``--tp`` > 1, the other ranks following it). Responses of those front ends name the worker that answered
(``x-mcore-worker``).
"""

from __future__ import annotations

from mcore_infer.engine_process._client import EngineClient, EngineView, SharedEngineClient
from mcore_infer.engine_process._sockets import WORKER_HEADER, WorkerHeader, bind_worker_sockets
from mcore_infer.engine_process._worker import EngineSpec, serve_engine
from mcore_infer.engine_process._workers import serve_workers, wait_until_serving

__all__ = [
    "WORKER_HEADER",
    "EngineClient",
    "EngineSpec",
    "EngineView",
    "SharedEngineClient",
    "WorkerHeader",
    "bind_worker_sockets",
    "serve_engine",
    "serve_workers",
    "wait_until_serving",
]
