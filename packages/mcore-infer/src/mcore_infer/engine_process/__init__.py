"""The engine in its own process, the HTTP front end in another (``mcore-infer serve --engine-process``, opt-in).

:class:`EngineClient` has :class:`~mcore_infer.async_engine.AsyncEngine`'s interface, so the server runs on it
unchanged; the engine process (:func:`~mcore_infer.engine_process._worker.run_engine`, started with ``spawn``)
builds its ``LLM`` from an :class:`EngineSpec` and sends one message per engine step with every request's new
output. The front end's JSON, SSE and HTTP work then no longer holds the GIL the engine loop needs. Whether that
pays is not yet measured on a GPU, so the in-process engine stays the default. One TP rank only, for now.
"""

from __future__ import annotations

from mcore_infer.engine_process._client import EngineClient, EngineView
from mcore_infer.engine_process._worker import EngineSpec

__all__ = ["EngineClient", "EngineSpec", "EngineView"]
