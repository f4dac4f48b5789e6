"""The engine in its own process, the HTTP front end in another (``mcore-infer serve --engine-process``, opt-in).

:class:`EngineClient` has :class:`~mcore_infer.async_engine.AsyncEngine`'s interface, so the server runs on it
unchanged; the engine process (:func:`~mcore_infer.engine_process._worker.run_engine`, started with ``spawn``)
builds its ``LLM`` from an :class:`EngineSpec` and sends one message per engine step with every request's new
output. The front end's JSON, SSE and HTTP work then no longer holds the GIL the engine loop needs (``serve``'s
default at ``--tp 1``). :func:`serve_workers` runs several front-end processes over one engine process
(``serve --api-workers N``). One TP rank only, for now.
"""

from __future__ import annotations

from mcore_infer.engine_process._client import EngineClient, EngineView, SharedEngineClient
from mcore_infer.engine_process._worker import EngineSpec
from mcore_infer.engine_process._workers import serve_workers, wait_until_serving

__all__ = ["EngineClient", "EngineSpec", "EngineView", "SharedEngineClient", "serve_workers", "wait_until_serving"]
