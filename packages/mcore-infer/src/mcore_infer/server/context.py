"""What every handler shares, kept on ``app.state.serving``: the engine, tokenizer, model name, limits and the
token-string cache, with the checks that need them (model name, context length, queue room)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mcore_infer.async_engine import AsyncEngine
from mcore_infer.errors import ContextLengthError, EngineDeadError, InvalidRequestError, OverloadedError
from mcore_infer.images import VisionInfo
from mcore_infer.sampling import SamplingParams
from mcore_infer.server.errors import HTTPError

__all__ = ["MAX_BODY_BYTES", "Route", "ServingContext", "serving"]

MAX_BODY_BYTES = 8 << 20

Route = tuple[str, Callable[..., Any], str]
"""A route a module serves: its path, handler and HTTP method (``build_app`` adds each to the app)."""


@dataclass
class ServingContext:
    """The state of one app; handlers get it with :func:`serving`."""

    engine: AsyncEngine
    """The engine loop every request is queued on."""
    tokenizer: Any
    """Encodes prompts and decodes single tokens (``encode``, ``decode``, optional ``bos``)."""
    model_name: str
    """The one model name this server answers to (``model`` in requests, ``/v1/models``)."""
    shutdown_timeout: float = 30.0
    """Seconds in-flight requests get to finish when the app stops."""
    max_body_bytes: int = MAX_BODY_BYTES
    """Request bodies over this size are refused with 413."""
    created: int = field(default_factory=lambda: int(time.time()))
    """The model card's ``created`` timestamp: when the app was built."""
    token_text: dict[int, str] = field(default_factory=dict, repr=False)
    """Token id -> its text on its own, filled as tokens are first shown (logprobs, segments)."""

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def vision(self) -> VisionInfo | None:
        """A VLM engine's image format (None: a text-only model)."""
        return getattr(self.engine.engine, "vision", None)

    def tok_str(self, token: int) -> str:
        """The text of one token, decoded once."""
        s = self.token_text.get(token)
        if s is None:
            s = self.token_text[token] = self.tokenizer.decode([token])
        return s

    def check_model(self, body: dict[str, Any]) -> None:
        """400 without a model name (OpenAI requires one), 404 for a name other than this server's."""
        name = body.get("model")
        if name is None or name == "":
            raise InvalidRequestError("you must provide a model parameter", param="model")
        if name != self.model_name:
            raise HTTPError(
                404,
                f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def check_alive(self) -> None:
        """503 (``engine_unavailable``) unless the engine loop is running."""
        if not self.engine.healthy:
            raise EngineDeadError("the engine is not running")

    def check_capacity(self, prompts: list[list[int]], params: SamplingParams, n: int, param: str) -> None:
        """Every prompt fits the context (413 when far over, as the payload itself is then too large) and the queue
        has room for ``n`` requests per prompt (503 otherwise)."""
        engine = self.engine.engine
        for ids in prompts:
            try:
                engine.check_request(ids, params, param=param)
            except ContextLengthError as e:
                if len(ids) > 4 * self.max_model_len:
                    raise HTTPError(413, e.message, "invalid_request_error", e.param, e.code) from e
                raise
        if n * len(prompts) > engine.max_queue:  # never fits, however long the client waits: not a 503
            raise InvalidRequestError(
                f"the request asks for {n * len(prompts)} completions (prompts x n); the server queues at most "
                f"{engine.max_queue}",
                "n",
                "too_many_completions",
            )
        if engine.num_waiting + n * len(prompts) > engine.max_queue:
            raise OverloadedError("the server is overloaded; try again later")


def serving(request: Any) -> ServingContext:
    """The context of the app that received ``request``."""
    ctx: ServingContext = request.app.state.serving
    return ctx
