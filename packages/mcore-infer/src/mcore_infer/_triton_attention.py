"""A Triton kernel for attention over the paged KV cache, reading blocks in place (no gather into a copy).

One program per (query token, key/value group): it loads the group's query heads, walks the token's request's
block table up to the token's context length with an online softmax, and writes the heads' outputs. Decode tokens
and prefill chunks use the same kernel: a prefill token at position ``p`` has context length ``p + 1`` (its own
key/value was written to the cache before the call). Works under CUDA-graph capture (no host syncs).
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_infer.errors import MissingDependencyError

__all__ = ["paged_attention_triton", "triton_available"]

_KERNEL: Any = None


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise MissingDependencyError("triton", "gpu") from e

    @triton.jit  # type: ignore[misc]
    def kernel(  # type: ignore[no-untyped-def]
        Q,
        K,
        V,
        Out,
        BT,
        TSEQ,
        TCTX,
        scale,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_ks,
        stride_kg,
        stride_bt,
        stride_ot,
        stride_oh,
        HPG: tl.constexpr,
        HPG_PAD: tl.constexpr,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        t = tl.program_id(0)
        g = tl.program_id(1)
        seq = tl.load(TSEQ + t)
        ctx = tl.load(TCTX + t)
        h = tl.arange(0, HPG_PAD)
        d = tl.arange(0, D)
        hmask = h < HPG
        heads = g * HPG + h
        q = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=hmask[:, None], other=0.0)
        m_i = tl.full([HPG_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([HPG_PAD], tl.float32)
        acc = tl.zeros([HPG_PAD, D], tl.float32)
        offs = tl.arange(0, BLOCK)
        num_blocks = (ctx + BLOCK - 1) // BLOCK
        for j in range(0, num_blocks):
            start = j * BLOCK
            blk = tl.load(BT + seq * stride_bt + j).to(tl.int64)
            base = blk * stride_kb + offs[:, None] * stride_ks + g * stride_kg + d[None, :]
            k = tl.load(K + base)
            v = tl.load(V + base)
            if IEEE:  # float32 caches: exact products (no TF32), as the plain path computes
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            s = tl.where((start + offs)[None, :] < ctx, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
            m_i = m_new
        denom = tl.where(l_i > 0, l_i, 1.0)
        out = acc / denom[:, None]
        tl.store(
            Out + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=hmask[:, None],
        )

    _KERNEL = kernel
    return kernel


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_seq: torch.Tensor,
    token_ctx: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``q`` ``[T, heads, d]``; caches ``[blocks, block_size, groups, d]``; ``block_tables`` ``[S, max_blocks]``;
    ``token_seq``/``token_ctx`` ``[T]`` (row of the block table, keys to attend). Returns ``[T, heads, d]``."""
    t, heads, d = q.shape
    _, block_size, groups, _ = k_cache.shape
    hpg = heads // groups
    out = torch.empty_like(q)
    if t == 0:
        return out
    q = q.contiguous()
    _kernel()[(t, groups)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        token_seq,
        token_ctx,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        HPG=hpg,
        HPG_PAD=max(16, 1 << (hpg - 1).bit_length()),
        D=d,
        BLOCK=block_size,
        IEEE=k_cache.dtype == torch.float32,
    )
    return out
