"""mcore-infer's exceptions: user mistakes (bad requests) apart from capacity limits and internal faults."""

from __future__ import annotations

__all__ = [
    "InferError",
    "InvalidRequestError",
    "ContextLengthError",
    "OverloadedError",
    "EngineDeadError",
    "RequestFailed",
    "MissingDependencyError",
]


class InferError(Exception):
    """Base class of every mcore-infer error."""


class InvalidRequestError(InferError, ValueError):
    """A request parameter is wrong; ``param`` names it (as the OpenAI error body's ``param``)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class ContextLengthError(InvalidRequestError):
    """The prompt (plus the tokens asked for) does not fit the model's context or the KV cache."""

    def __init__(self, message: str, param: str | None = "prompt") -> None:
        super().__init__(message, param, "context_length_exceeded")


class OverloadedError(InferError):
    """The engine's queue is full; try again later (HTTP 503)."""


class EngineDeadError(InferError):
    """The engine loop stopped (after an internal fault or at shutdown)."""


class RequestFailed(InferError):
    """One request failed inside the engine (an internal fault, HTTP 500); the engine itself keeps serving."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id, self.message = request_id, message


class MissingDependencyError(InferError, ImportError):
    """An optional dependency is missing; the message names the extra that installs it."""

    def __init__(self, module: str, extra: str) -> None:
        super().__init__(f"{module} is not installed: pip install 'mcore-infer[{extra}]'")
        self.module, self.extra = module, extra
