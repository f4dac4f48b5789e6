"""Packed sequences: causal attention that does not cross the documents packed into one row.

A packed row holds several documents back to back; each token carries the id of its document (``[b, s]``, equal ids
= the same document, e.g. ``0 0 0 1 1 2 2 2``). :func:`document_mask` turns the ids into a :class:`DocumentMask`
once per micro-batch (``GPTModel.forward`` does it for its ``document_ids``), and every attention layer of the model
reads it:

- ``flex`` (the default on CUDA): a ``torch.nn.attention.flex_attention`` ``BlockMask`` of the document-causal
  mask, built by a compiled ``create_block_mask`` (its memory is O((s / 128)^2) blocks, never an ``s x s`` mask), and
  the attention through compiled ``flex_attention``: blocks that hold no pair of one document are skipped.
- ``dense`` (the default elsewhere): a boolean block-diagonal causal mask ``[b, 1, s, s]`` for
  ``F.scaled_dot_product_attention`` (O(s^2) memory: for CPU runs and tests).

Position ids restarting per document (RoPE per document) come from :func:`document_positions`. Sequence parallelism
needs nothing more: attention runs on the all-gathered sequence, whose tokens the ids describe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

__all__ = ["DocumentMask", "PackedBackend", "document_attention", "document_mask", "document_positions", "mask_kwargs"]

PackedBackend = Literal["auto", "flex", "dense"]
"""How packed attention runs: ``flex`` (flex_attention with a block mask), ``dense`` (SDPA with a boolean mask), or
``auto`` (flex on CUDA, dense elsewhere)."""

_COMPILED: dict[str, Any] = {}


@dataclass(frozen=True, eq=False)
class DocumentMask:
    """Which keys each query of a packed micro-batch may attend to: earlier tokens of its own document."""

    document_ids: torch.Tensor
    """``[b, s]`` integer document id of every token (the whole sequence, also under sequence parallelism)."""
    block_mask: Any = None
    """``flex``: the ``BlockMask`` of the document-causal mask."""
    dense: torch.Tensor | None = None
    """``dense``: ``[b, 1, s, s]`` bool, True where a query may attend to a key."""
    ring_ids: torch.Tensor | None = None
    """Context parallelism: ``[cp, b, s]`` the document ids of every cp rank's chunks (``document_ids`` this rank's),
    read by ring attention (:func:`~mcore_models.transformer.ring_attention.ring_document_mask`)."""


def _backend(backend: PackedBackend, device: torch.device) -> str:
    if backend == "auto":
        return "flex" if device.type == "cuda" else "dense"
    if backend not in ("flex", "dense"):
        raise ValueError(f"packed attention backend {backend!r} must be one of auto, flex, dense")
    return backend


def document_mask(document_ids: torch.Tensor, backend: PackedBackend = "auto") -> DocumentMask:
    """The :class:`DocumentMask` of per-token document ids ``[b, s]`` for ``backend``."""
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be [batch, sequence], got shape {tuple(document_ids.shape)}")
    ids = document_ids.long()
    b, s = ids.shape
    if _backend(backend, ids.device) == "dense":
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril_()
        return DocumentMask(ids, dense=((ids[:, :, None] == ids[:, None, :]) & causal)[:, None])

    def document_causal(batch: Any, head: Any, q: Any, kv: Any) -> Any:
        return (ids[batch, q] == ids[batch, kv]) & (q >= kv)

    # compiled: the mask is evaluated block by block, never as s x s (one compilation for every micro-batch)
    block = _compiled("create_block_mask")(document_causal, b, None, s, s, device=ids.device)
    return DocumentMask(ids, block_mask=block)


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Position ids ``[b, s]`` counting from 0 at every document's first token (a token whose id differs from the
    one before it), without a host sync."""
    b, s = document_ids.shape
    idx = torch.arange(s, device=document_ids.device).expand(b, s)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def _compiled(name: str) -> Any:
    """``torch.nn.attention.flex_attention.<name>``, compiled once (inside an already compiled layer the plain
    function, which that compilation traces)."""
    from torch.nn.attention import flex_attention as flex

    fn = getattr(flex, name)
    if torch.compiler.is_compiling():
        return fn
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, dynamic=False)
    return _COMPILED[name]


def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask, *, dropout_p: float, enable_gqa: bool
) -> torch.Tensor:
    """Per-document causal attention of ``[b, heads, s, d]`` queries over ``[b, groups, s, d]`` keys/values
    (``enable_gqa``: groups may be fewer than heads); ``[b, heads, s, d]``."""
    if mask.dense is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, dropout_p=dropout_p, enable_gqa=enable_gqa)
    if dropout_p > 0:
        raise ValueError(
            "attention_dropout > 0 with packed sequences: flex_attention has no dropout; set attention_dropout=0 "
            "(or build the document mask with backend='dense')"
        )
    out: torch.Tensor = _compiled("flex_attention")(q, k, v, block_mask=mask.block_mask, enable_gqa=enable_gqa)
    return out


def mask_kwargs(mask: DocumentMask | None) -> dict[str, Any]:
    """``{"document_mask": mask}``, or nothing without one: unpacked calls keep their plain signature."""
    return {} if mask is None else {"document_mask": mask}
