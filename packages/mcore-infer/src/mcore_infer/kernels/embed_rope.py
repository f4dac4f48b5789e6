"""A small decode step's first kernel: each token's embedding row and its position's rotary rows in one launch.

A decode step starts with three gathers: the word embedding of each token (``F.embedding``) and the cos and sin rows
of each position from :class:`~mcore_infer.rope_table.RotaryTable`. At batch 1 each is a ~2 µs kernel launched after
the one before, ahead of the first layer's QKV projection. :func:`embed_rope` does the three in one kernel (one
program a token) that, on Hopper, lets the next kernel launch at its start (``gdc_launch_dependents``): the QKV GEMV
then loads its first weight tile while the rows are copied, and waits for them before reading them. The values are
copies: bit for bit what the three gathers give.

Ids must lie in ``[0, rows of the table)`` and positions in ``[0, rows of the rotary tables)``, as for the gathers
(the engine admits no request past its ``max_model_len`` and checks prompt ids against the vocabulary); the loads
are masked to the tables, so a bad index reads nothing outside them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mcore_infer.kernels.norm_linear import _use_triton, gdc_launch

__all__ = ["embed_rope", "embed_rope_reference"]

_KERNEL: Any = None


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents

    @triton.jit  # type: ignore[misc]
    def embed_rope_kernel(  # type: ignore[no-untyped-def]
        IDS, POS, EMB, COS, SIN, H, COS_OUT, SIN_OUT, V, P, HIDDEN, ROT, stride_e, stride_c,
        BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        if GDC:  # the next kernel (the first QKV projection) may launch now; it waits for this one before reading
            gdc_launch_dependents()
        t = tl.program_id(0)
        tok = tl.load(IDS + t)
        pos = tl.load(POS + t)
        d = tl.arange(0, BLOCK_H)
        toks = d * 0 + tok  # (the index as a vector: masks of scalar comparisons are not every Triton's)
        row = tl.load(EMB + tok * stride_e + d, mask=(d < HIDDEN) & (toks >= 0) & (toks < V), other=0.0)
        tl.store(H + t * HIDDEN + d, row, mask=d < HIDDEN)
        r = tl.arange(0, BLOCK_R)
        rows = r * 0 + pos
        pos_ok = (r < ROT) & (rows >= 0) & (rows < P)
        cos = tl.load(COS + pos * stride_c + r, mask=pos_ok, other=0.0)
        sin = tl.load(SIN + pos * stride_c + r, mask=pos_ok, other=0.0)
        tl.store(COS_OUT + t * ROT + r, cos, mask=r < ROT)
        tl.store(SIN_OUT + t * ROT + r, sin, mask=r < ROT)

    _KERNEL = embed_rope_kernel
    return _KERNEL


def embed_rope_reference(
    ids: torch.Tensor, positions: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The three gathers as the model and :class:`~mcore_infer.rope_table.RotaryTable` run them: hidden
    ``[T, 1, hidden]`` and ``(cos, sin)`` ``[T, 1, 1, rot]`` for ``ids`` and ``positions`` ``[T]``."""
    pos = positions[:, None]
    return F.embedding(ids[:, None], weight), (F.embedding(pos, cos)[:, :, None], F.embedding(pos, sin)[:, :, None])


def embed_rope(
    ids: torch.Tensor,
    positions: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pdl: bool = False,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`embed_rope_reference` as one Triton kernel (on CUDA, or on the CPU under ``TRITON_INTERPRET=1``; else
    the gathers). ``ids``, ``positions``: int64 ``[T]``; ``weight`` ``[vocab, hidden]``; ``cos``, ``sin``
    ``[positions, rot]`` of ``weight``'s dtype. ``pdl``: signal the next kernel at the start (Hopper and later)."""
    if ids.dim() != 1 or positions.shape != ids.shape:
        raise ValueError(f"embed_rope: ids {tuple(ids.shape)} and positions {tuple(positions.shape)} must be [T]")
    if cos.shape != sin.shape or cos.dim() != 2 or cos.dtype != weight.dtype or sin.dtype != weight.dtype:
        raise ValueError(f"embed_rope: cos {tuple(cos.shape)} {cos.dtype} and sin {tuple(sin.shape)} {sin.dtype} "
                         f"must be [positions, rot] tables of the embedding's dtype {weight.dtype}")  # fmt: skip
    if not _use_triton(weight) or weight.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        return embed_rope_reference(ids, positions, weight, cos, sin)
    ids, positions = ids.contiguous(), positions.contiguous()
    t, (v, hidden), (p, rot) = ids.shape[0], weight.shape, cos.shape
    h = torch.empty(t, 1, hidden, dtype=weight.dtype, device=weight.device)
    c = torch.empty(t, 1, 1, rot, dtype=cos.dtype, device=weight.device)
    s = torch.empty_like(c)
    if t:
        gdc = gdc_launch(weight, False)["GDC"] and pdl
        _kernel()[(t,)](
            ids, positions, weight, cos, sin, h, c, s, v, p, hidden, rot, weight.stride(0), cos.stride(0),
            BLOCK_H=1 << max(0, hidden - 1).bit_length(), BLOCK_R=max(2, 1 << max(0, rot - 1).bit_length()), GDC=gdc,
            num_warps=4,
        )  # fmt: skip
    return h, (c, s)
