"""Megatron's text-generation API, ``PUT /api``: ``prompts``, ``tokens_to_generate``, ``temperature``, ``top_k``,
``top_p``, ``logprobs``, ``random_seed``, ``add_BOS``; the reply holds ``text`` (prompt + completion), ``segments``
(every token's text) and, with ``logprobs``, the log-probabilities of every token after the first."""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request) at runtime

import math
from collections.abc import Callable
from typing import Any

from fastapi import Request

from mcore_infer.engine import RequestOutput
from mcore_infer.errors import InvalidRequestError
from mcore_infer.protocol import INT64_MAX
from mcore_infer.sampling import SamplingParams
from mcore_infer.server.context import Route, serving
from mcore_infer.server.streaming import read_json, run_all

__all__ = ["ROUTES", "megatron_params"]


def _number(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    """``body[name]`` as a ``kind`` (``int`` or ``float``; numbers in strings are taken, as Megatron's server does),
    ``default`` when absent or null; 400 naming it otherwise."""
    v = body.get(name)
    if v is None:
        return default
    try:
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise ValueError(v)
        x = kind(v)
        bad_float = isinstance(x, float) and not math.isfinite(x)
        if bad_float or (isinstance(x, int) and not -INT64_MAX - 1 <= x <= INT64_MAX):
            raise ValueError(v)
    except (ValueError, OverflowError):
        raise InvalidRequestError(f"{name} must be a finite {kind.__name__} (got {v!r})", param=name) from None
    return x


def megatron_params(body: dict[str, Any]) -> tuple[list[str], int, bool, SamplingParams]:
    """``(prompts, tokens_to_generate, logprobs, params)`` from a ``PUT /api`` body; with ``logprobs`` the prompt
    is scored (``echo``), which ``tokens_to_generate: 0`` asks for alone."""
    prompts = body.get("prompts")
    if not (isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts)):
        raise InvalidRequestError("prompts must be a non-empty list of strings", param="prompts")
    n_gen = body.get("tokens_to_generate", 64)
    if not isinstance(n_gen, int) or isinstance(n_gen, bool) or n_gen < 0:
        raise InvalidRequestError("tokens_to_generate must be a non-negative integer", param="tokens_to_generate")
    want_lp = bool(body.get("logprobs", False))
    if n_gen == 0 and not want_lp:
        raise InvalidRequestError("tokens_to_generate=0 only makes sense with logprobs", param="logprobs")
    seed = _number(body, "random_seed", int, None)
    top_p = _number(body, "top_p", float, 0.0)
    params = SamplingParams(
        max_tokens=max(n_gen, 1),
        temperature=_number(body, "temperature", float, 1.0),
        top_k=_number(body, "top_k", int, 0),
        top_p=top_p if 0.0 < top_p <= 1.0 else 1.0,
        seed=seed if seed is not None and seed >= 0 else None,
        logprobs=0 if want_lp else None,
        echo=want_lp,
        ignore_eos=bool(body.get("ignore_eos", False)),
    )
    return prompts, n_gen, want_lp, params


def _reply(
    prompts: list[str],
    ids_list: list[list[int]],
    results: list[RequestOutput],
    n_gen: int,
    want_lp: bool,
    tok_str: Callable[[int], str],
) -> dict[str, Any]:
    texts, segments, logprobs = [], [], []
    for prompt, ids, out in zip(prompts, ids_list, results):
        gen_ids = out.token_ids if n_gen > 0 else []
        gen_text = out.text if n_gen > 0 else ""
        texts.append(prompt + gen_text)
        segments.append([tok_str(t) for t in ids + gen_ids])
        if want_lp:
            plp = [lp for lp in (out.prompt_logprobs or [])[1:]]
            logprobs.append(plp + (list(out.logprobs or []) if n_gen > 0 else []))
    resp: dict[str, Any] = {"text": texts, "segments": segments}
    if want_lp:
        resp["logprobs"] = logprobs
    return resp


# PUT /api (no docstring: FastAPI would publish it in the OpenAPI schema)
async def megatron(request: Request) -> Any:
    ctx = serving(request)
    ctx.check_alive()
    body = await read_json(request, ctx.max_body_bytes)
    prompts, n_gen, want_lp, params = megatron_params(body)
    ids_list = []
    for p in prompts:
        ids = ctx.tokenizer.encode(p)
        if body.get("add_BOS") and getattr(ctx.tokenizer, "bos", None) is not None:
            ids = [ctx.tokenizer.bos, *ids]
        ids_list.append(ids)
    ctx.check_capacity(ids_list, params, 1, "prompts")
    results = await run_all(request, ctx.engine, [(i, ids, params) for i, ids in enumerate(ids_list)])
    return _reply(prompts, ids_list, results, n_gen, want_lp, ctx.tok_str)


ROUTES: list[Route] = [("/api", megatron, "PUT")]
