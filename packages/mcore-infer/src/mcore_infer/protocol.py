"""OpenAI request parsing and response shapes (plain dicts), and the simple chat template.

Parsing is by hand so that every bad field gives a 400 naming it (``param``), as OpenAI's API does.

Chat template (used because mcore tokenizers carry none): each message becomes ``<|{role}|>\\n{content}\\n``, and
the prompt ends with ``<|assistant|>\\n``. Generation stops at the end-of-document token or at ``<|user|>`` /
``<|system|>`` (added to the request's stop strings). Content may be a string or a list of ``text`` and
``image_url`` parts; each image part is the image placeholder where it was (:mod:`mcore_infer.server.images`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mcore_data.chat import CHAT_ROLES, CHAT_STOP, IMAGE_PLACEHOLDER
from mcore_data.chat import apply_chat_template as chat_prompt
from mcore_infer.errors import InvalidRequestError
from mcore_infer.sampling import SamplingParams

__all__ = [
    "CHAT_STOP",
    "INT64_MAX",
    "ChatMessages",
    "apply_chat_template",
    "chat_messages",
    "error_body",
    "sampling_from_request",
    "stream_usage",
]

_ROLES = CHAT_ROLES


@dataclass
class ChatMessages:
    """A request's ``messages`` as template turns: each image content part is the image placeholder in its turn."""

    turns: list[dict[str, str]]
    images: list[tuple[str, str]] = field(default_factory=list)
    """Each image part's URL and where it is (``messages[i].content[j]``), in order."""
    placeholder_in_text: str | None = None
    """Where a text part holds the image placeholder literally (a problem only in a request with images)."""


def _content(i: int, content: Any, out: ChatMessages) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError("content must be a string or a list of content parts", param=f"messages[{i}]")
    pieces = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = str(part.get("text", ""))
            if IMAGE_PLACEHOLDER in text and out.placeholder_in_text is None:
                out.placeholder_in_text = where
            pieces.append(text)
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str):
                raise InvalidRequestError("an image_url part needs image_url.url (a data URL)", param=where)
            out.images.append((url, where))
            pieces.append(IMAGE_PLACEHOLDER)
        else:
            raise InvalidRequestError("content parts must be of type text or image_url", param=where)
    return "".join(pieces)


def chat_messages(messages: Any) -> ChatMessages:
    """Parse ``messages``: roles, string or content-part contents (``text``, ``image_url``)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    out = ChatMessages([])
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise InvalidRequestError(f"messages[{i}] needs a role in {_ROLES}", param=f"messages[{i}].role")
        out.turns.append({"role": m["role"], "content": _content(i, m.get("content"), out)})
    return out


def apply_chat_template(messages: Any) -> str:
    """The prompt text of ``messages`` (an image part becomes the image placeholder)."""
    return chat_prompt(chat_messages(messages).turns)  # the template the training data is made with (mcore_data.chat)


INT64_MAX = 2**63 - 1
"""Integers in requests must fit a signed 64-bit integer (as in OpenAI's schema; torch takes no more)."""


def _get(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and kind is not bool:
        raise InvalidRequestError(f"{name} must be of type {getattr(kind, '__name__', kind)}", param=name)
    if isinstance(v, int) and not isinstance(v, bool) and not -INT64_MAX - 1 <= v <= INT64_MAX:
        raise InvalidRequestError(f"{name} is out of range (a signed 64-bit integer)", param=name)
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise InvalidRequestError(f"{name} must be of type {names} (got {type(v).__name__})", param=name)
    return v


def stream_usage(body: dict[str, Any], stream: bool) -> bool:
    """``stream_options.include_usage``: an object (or null) that only a streamed request may send."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise InvalidRequestError("stream_options must be an object", param="stream_options")
    if not stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
    return bool(_get(opts, "include_usage", bool, False))


def _check_openai_ranges(params: SamplingParams) -> None:
    """OpenAI's limits where they are narrower than the engine's (which :meth:`SamplingParams.validate` checks)."""
    if not 0.0 <= params.temperature <= 2.0:
        raise InvalidRequestError(f"temperature must be in [0, 2] (got {params.temperature})", param="temperature")
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise InvalidRequestError(
            f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({params.max_tokens})", param="min_tokens"
        )


def sampling_from_request(body: dict[str, Any], chat: bool) -> tuple[SamplingParams, int, bool]:
    """``(params, n, stream)`` from an OpenAI completions / chat-completions body."""
    for unsupported in ("logit_bias", "suffix", "tools", "functions", "response_format"):
        if body.get(unsupported):
            raise InvalidRequestError(f"{unsupported} is not supported by this server", param=unsupported)
    n = _get(body, "n", int, 1)
    if not 1 <= n <= 16:
        raise InvalidRequestError("n must be between 1 and 16", param="n")
    best_of = _get(body, "best_of", int, n)
    if best_of != n:
        raise InvalidRequestError("best_of other than n is not supported", param="best_of")
    stream = _get(body, "stream", bool, False)
    stream_usage(body, stream)
    max_tokens = _get(body, "max_tokens", int, 16 if not chat else None)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _get(body, "max_completion_tokens", int, None)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
    if chat:
        stop = list(stop) + CHAT_STOP
        logprobs = _get(body, "top_logprobs", int, 0) if _get(body, "logprobs", bool, False) else None
        if body.get("top_logprobs") is not None and logprobs is None:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        echo = False
    else:
        logprobs = _get(body, "logprobs", int, None)
        echo = _get(body, "echo", bool, False)
    stop_ids = body.get("stop_token_ids") or []
    if not (isinstance(stop_ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids)):
        raise InvalidRequestError("stop_token_ids must be a list of integers", param="stop_token_ids")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_get(body, "temperature", float, 1.0),
        top_p=_get(body, "top_p", float, 1.0),
        top_k=_get(body, "top_k", int, 0),
        min_p=_get(body, "min_p", float, 0.0),
        repetition_penalty=_get(body, "repetition_penalty", float, 1.0),
        presence_penalty=_get(body, "presence_penalty", float, 0.0),
        frequency_penalty=_get(body, "frequency_penalty", float, 0.0),
        seed=_get(body, "seed", int, None),
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=_get(body, "ignore_eos", bool, False),
        logprobs=logprobs,
        echo=echo,
        min_tokens=_get(body, "min_tokens", int, 0),
    )
    _check_openai_ranges(params)
    return params, n, stream


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
