"""The inference context handed to ``GPTModel.forward``: KV-cache writes and attention over paged KV.

A step's tokens (decode tokens and prefill chunks of many requests) are one flat sequence. For each token the
context knows its request's row in ``block_tables``, its cache slot and how many keys it attends to (its position
plus one). ``attention`` first stores the step's keys/values at their slots, then attends:

- ``triton``: the paged kernel in :mod:`mcore_infer._triton_attention` reads blocks in place (GPU);
- ``plain``: per request, the blocks are gathered into a contiguous tensor and ``scaled_dot_product_attention``
  runs with a causal mask offset by the cached length (CPU, and the reference the kernel is tested against).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from mcore_infer._attention_host import SMALL_STEP_TOKENS, AttentionLaunch
from mcore_infer._triton_attention import paged_attention_triton, store_kv_triton
from mcore_infer.kernels.l2_prefetch import Region
from mcore_infer.kernels.small_gemv import FMA_MAX_ROWS
from mcore_infer.kv_cache import KVCache
from mcore_models.transformer.rope import apply_rotary

__all__ = ["PagedAttentionContext", "Segment"]


class Segment(NamedTuple):
    """Tokens ``[start, end)`` of the flat step belong to block-table row ``row`` and end at context ``ctx``."""

    start: int
    end: int
    row: int
    ctx: int


class PagedAttentionContext:
    """Implements ``mcore_models``' ``InferenceContext`` protocol over a :class:`KVCache`."""

    def __init__(
        self,
        cache: KVCache,
        first_layer: int,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        token_seq: torch.Tensor,
        token_ctx: torch.Tensor,
        logits_index: torch.Tensor | None,
        backend: str = "plain",
        segments: list[Segment] | None = None,
        block_tables_host: list[list[int]] | None = None,
        fuse_rotary: bool = False,
        fuse_kv_write: bool = False,
        pdl: bool = False,
        fold_combine: bool = False,
        attention_launch: AttentionLaunch | None = None,
        prefetch: dict[int, list[Region]] | None = None,
        kv_layers: list[int] | None = None,
        mamba: Any = None,
    ) -> None:
        if backend not in ("plain", "triton"):
            raise ValueError(f"attention backend {backend!r}: use 'plain' or 'triton'")
        if backend == "plain" and (segments is None or block_tables_host is None):
            raise ValueError("the plain backend needs segments and host block tables")
        self.cache, self.first_layer = cache, first_layer
        # the layers that hold KV blocks, in cache order (None: every layer from first_layer on); a hybrid model's
        # Mamba and MLP layers have none
        self.kv_index = None if kv_layers is None else {n: i for i, n in enumerate(kv_layers)}
        # the step's Mamba states (a mcore_infer.mamba_cache.MambaStepView; None for models without Mamba layers)
        self.mamba = mamba
        self.layer_number = first_layer
        self.slot_mapping, self.block_tables = slot_mapping, block_tables
        self.token_seq, self.token_ctx = token_seq, token_ctx
        self.logits_index = logits_index
        self.argmax_out: torch.Tensor | None = None
        """Where the step draws its rows' greedy tokens after the logits (a decode graph's, ``argmax_in_graph``)."""
        self.backend = backend
        self.segments = segments or []
        self.block_tables_host = block_tables_host or []
        # read by the model's attention: hand over unrotated q/k and the rotary tables (the kernels rotate)
        self.fuses_rotary = fuse_rotary and backend == "triton"
        # decode steps only (each token the one new token of its request): the attention kernel writes the KV too
        self.fuse_kv_write = fuse_kv_write and backend == "triton"
        # small decode steps: the attention kernels launched as programmatic dependents (DecodePlan.pdl)
        self.pdl = pdl and backend == "triton"
        # split attention combined by the last split to finish, not a second kernel (DecodePlan.combine_in_attention)
        self.fold_combine = fold_combine and backend == "triton"
        self.attention_launch = attention_launch  # the Triton kernel's (DecodeLaunches.attention; None: its defaults)
        # layer number -> the weights its attention pulls into L2 in steps of at most 4 tokens (EngineConfig.l2_prefetch)
        self.prefetch = prefetch if backend == "triton" else None

    def _prefetch(self, tokens: int) -> list[Region] | None:
        """The weights this layer's attention pulls into L2 (small steps only: a long step's attention is busy)."""
        if self.prefetch is None or tokens > SMALL_STEP_TOKENS:
            return None
        return self.prefetch.get(self.layer_number)

    @torch.compiler.disable
    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``q`` ``[T, 1, heads, d]`` (or grouped ``[T, 1, groups, heads / groups, d]``), ``k``/``v``
        ``[T, 1, groups, d]`` → ``[T, 1, heads * d]``. ``rotary`` (cos, sin): q and k are not rotated yet.

        Never traced by ``torch.compile`` (``EngineConfig.compile``): compiled layers run their code before and
        after this call, which depends on per-step host data (segments, block tables) and writes the cache."""
        # layer_number is set by GPTModel.forward before each layer
        i = self.layer_number - self.first_layer if self.kv_index is None else self.kv_index[self.layer_number]
        k_cache, v_cache = self.cache.keys[i], self.cache.values[i]
        t, d = q.shape[0], q.shape[-1]
        heads = q.shape[2] * q.shape[3] if q.dim() == 5 else q.shape[2]
        groups = k.shape[2]
        scale = 1.0 / (d**0.5)
        if self.backend == "triton":
            new_kv = None
            if self.fuse_kv_write:
                new_kv = (k[:, 0], v[:, 0], self.slot_mapping)
            else:
                store_kv_triton(k[:, 0], v[:, 0], k_cache, v_cache, self.slot_mapping, rotary=rotary)
            out = paged_attention_triton(q[:, 0], k_cache, v_cache, self.block_tables, self.token_seq,
                                         self.token_ctx, scale, rotary=rotary, new_kv=new_kv,
                                         pdl=self.pdl and t <= FMA_MAX_ROWS, fold=self.fold_combine,
                                         launch=self.attention_launch, prefetch=self._prefetch(t))  # fmt: skip
            return out.view(t, 1, heads * d)
        q = q.reshape(t, 1, heads, d)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        k_cache.view(-1, groups, d).index_copy_(0, self.slot_mapping, k[:, 0].to(k_cache.dtype))
        v_cache.view(-1, groups, d).index_copy_(0, self.slot_mapping, v[:, 0].to(v_cache.dtype))
        return plain_paged_attention(q[:, 0], k_cache, v_cache, self.segments, self.block_tables_host).view(
            t, 1, heads * d
        )


def plain_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    segments: list[Segment],
    block_tables: list[list[int]],
) -> torch.Tensor:
    """Reference path: gather each request's blocks, then masked SDPA. ``q`` ``[T, heads, d]`` → same shape."""
    heads, d = q.shape[1], q.shape[2]
    bs, groups = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for seg in segments:
        n = seg.end - seg.start
        nblk = (seg.ctx + bs - 1) // bs
        idx = torch.tensor(block_tables[seg.row][:nblk], dtype=torch.long, device=k_cache.device)
        keys = k_cache.index_select(0, idx).reshape(-1, groups, d)[: seg.ctx]
        vals = v_cache.index_select(0, idx).reshape(-1, groups, d)[: seg.ctx]
        # query i sits at position ctx - n + i and sees keys 0..that position
        qpos = torch.arange(seg.ctx - n, seg.ctx, device=q.device)[:, None]
        mask = torch.arange(seg.ctx, device=q.device)[None, :] <= qpos
        qs = q[seg.start : seg.end].transpose(0, 1)[None]  # [1, heads, n, d]
        ks = keys.transpose(0, 1)[None].to(q.dtype)
        vs = vals.transpose(0, 1)[None].to(q.dtype)
        if groups != heads:
            ks = ks.repeat_interleave(heads // groups, dim=1)
            vs = vs.repeat_interleave(heads // groups, dim=1)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
        out[seg.start : seg.end] = o[0].transpose(0, 1)
    return out
