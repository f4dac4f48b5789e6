"""A Mamba-2 mixer's gated RMSNorm inside its out-projection's one-row GEMV, for decode steps of a few rows.

After its one-step recurrence a Mamba layer computes ``rmsnorm(y * silu(z)) * w`` over groups of ``d / G`` channels
(``norm_before_gate``: ``rmsnorm(y) * w * silu(z)``), then the out-projection: a norm kernel and a GEMV.
:func:`gated_norm_partials` does both in one kernel. Each program first takes every row's mean squares, group by
group, over the whole row (``y`` and ``z`` are a few KB a row, read from the L2 by every program), then streams its
``BLOCK_N`` weight rows over its split of ``K`` as :mod:`~mcore_infer.kernels.small_gemv`'s row kernel does
(products accumulated elementwise in registers), gating and normalising each input tile it loads in float32 and
rounding it once to the model's dtype, as :class:`~mcore_models.ssm.mixer.GatedRMSNorm` rounds its output. Like
:func:`~mcore_infer.kernels.small_gemv.linear_partials` it writes float32 split-K partial sums ``[splits, ..., N]``,
which the next residual add sums.

A loop step of ``BLOCK_K`` inputs lies in one group: ``BLOCK_K`` is the launch's, lowered to the largest power of two
that divides the group size (:func:`gated_block_k`; the host refuses a group size without one of at least 16).
Launched as a programmatic dependent where the GPU has them (its first weight tile loaded before it waits for the
kernel before it). The op ``mcore_infer::gated_norm_partials`` computes the same with PyTorch ops without Triton, or
on the CPU outside ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mcore_infer.kernels.norm_gemv import _heuristic
from mcore_infer.kernels.norm_linear import _use_triton, gdc_launch
from mcore_infer.kernels.small_gemv import FMA_MAX_ROWS, Launch, _cdiv
from mcore_models.ssm.mixer import gated_rms_norm

__all__ = ["gated_block_k", "gated_norm_partials", "takes_group"]

_KERNEL: Any = None
_gated_input: Any = None  # the kernel's helpers, module globals once defined (Triton looks a kernel's callees up here)
_gated_tile: Any = None


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit  # type: ignore[misc]
    def _gated_input(Y, Z, rows, kk, M, K, stride_ym, stride_zm, BEFORE: tl.constexpr):  # type: ignore[no-untyped-def]
        """What is normalised, as float32: ``y * silu(z)``, or ``y`` itself when the norm comes before the gate."""
        m2 = (rows[:, None] < M) & (kk[None, :] < K)
        y = tl.load(Y + rows[:, None] * stride_ym + kk[None, :], mask=m2, other=0.0).to(tl.float32)
        if not BEFORE:
            z = tl.load(Z + rows[:, None] * stride_zm + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            y = y * (z * tl.sigmoid(z))
        return y

    @triton.jit  # type: ignore[misc]
    def _gated_tile(Y, Z, NW, rstd, gi, g, rows, kk, M, K, stride_ym, stride_zm,  # type: ignore[no-untyped-def]
                    BEFORE: tl.constexpr):  # fmt: skip
        """The norm's output at ``kk`` (group ``g``) of ``rows``: float32 math, rounded once to Y's dtype."""
        h = _gated_input(Y, Z, rows, kk, M, K, stride_ym, stride_zm, BEFORE)
        r = tl.sum(tl.where(gi[None, :] == g, rstd, 0.0), axis=1)
        nw = tl.load(NW + kk, mask=kk < K, other=0.0).to(tl.float32)
        x = h * r[:, None] * nw[None, :]
        if BEFORE:
            m2 = (rows[:, None] < M) & (kk[None, :] < K)
            z = tl.load(Z + rows[:, None] * stride_zm + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            x = x * (z * tl.sigmoid(z))
        return x.to(Y.dtype.element_ty).to(tl.float32)

    globals().update(_gated_input=_gated_input, _gated_tile=_gated_tile)

    @triton.jit  # type: ignore[misc]
    def gated_norm_gemv(  # type: ignore[no-untyped-def]
        Y,
        Z,
        NW,
        W,
        P,
        M,
        N,
        K,
        GS,
        K_PER,
        eps,
        stride_ym,
        stride_zm,
        stride_wn,
        stride_pm,
        stride_ps,
        G_PAD: tl.constexpr,
        M_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BEFORE: tl.constexpr,
        GDC: tl.constexpr,
    ):
        pid = tl.program_id(0)
        split = tl.program_id(1)
        rows = tl.arange(0, M_PAD)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        gi = tl.arange(0, G_PAD)
        w_rows = W + cols[:, None] * stride_wn
        acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], tl.float32)
        k_lo = split * K_PER
        if GDC:  # the first weight tile before waiting for the kernel that writes Y
            gdc_launch_dependents()
            w0 = tl.load(w_rows + (k_lo + ks)[None, :], mask=(cols[:, None] < N) & ((k_lo + ks)[None, :] < K),
                         other=0.0)  # fmt: skip
            gdc_wait()
        ss = tl.zeros([M_PAD, G_PAD], tl.float32)  # each row's sum of squares, group by group, over the whole row
        for k0 in range(0, K, BLOCK_K):
            h = _gated_input(Y, Z, rows, k0 + ks, M, K, stride_ym, stride_zm, BEFORE)
            ss += tl.where(gi[None, :] == k0 // GS, tl.sum(h * h, axis=1)[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(ss / GS + eps)
        if GDC:
            x = _gated_tile(Y, Z, NW, rstd, gi, k_lo // GS, rows, k_lo + ks, M, K, stride_ym, stride_zm, BEFORE)
            acc += x[:, None, :] * w0.to(tl.float32)[None, :, :]
            k_lo += BLOCK_K
        for k0 in range(k_lo, (split + 1) * K_PER, BLOCK_K):
            kk = k0 + ks
            w = tl.load(w_rows + kk[None, :], mask=(cols[:, None] < N) & (kk[None, :] < K), other=0.0)
            x = _gated_tile(Y, Z, NW, rstd, gi, k0 // GS, rows, kk, M, K, stride_ym, stride_zm, BEFORE)
            acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
        out = tl.sum(acc, axis=2)
        tl.store(P + split * stride_ps + rows[:, None] * stride_pm + cols[None, :], out,
                 mask=(rows[:, None] < M) & (cols[None, :] < N))  # fmt: skip

    _KERNEL = gated_norm_gemv
    return _KERNEL


def gated_block_k(block_k: int, group_size: int) -> int:
    """The K step of the kernel: ``block_k`` lowered to the largest power of two that divides ``group_size`` (so a
    step lies in one group)."""
    return min(block_k, group_size & -group_size)


def takes_group(group_size: int) -> bool:
    """Whether the kernel takes norm groups of ``group_size`` channels: a K step of at least 16 lies in one group."""
    return group_size >= 1 and gated_block_k(group_size, group_size) >= 16


def _launch(k: int, rows: int, values: list[int] | None) -> Launch:
    """The launch an op was given, else the row kernel's heuristic for ``K`` (split in two from 4,096 inputs), its K
    step divided by the padded row count as :mod:`~mcore_infer.kernels.norm_gemv`'s is."""
    return _heuristic(k, rows, row=False) if values is None else Launch(*values)


@torch.library.custom_op("mcore_infer::gated_norm_partials", mutates_args=())
def _gated_norm_partials_op(
    y: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
    weight: torch.Tensor,
    launch_values: list[int] | None,
    pdl: bool = False,
) -> torch.Tensor:
    if not _use_triton(y):
        normed = gated_rms_norm(y, z, norm_weight, group_size, eps, norm_before_gate)
        return F.linear(normed, weight).float()[None]
    n, k = weight.shape
    y2, z2 = y.reshape(-1, k), z.reshape(-1, k)
    y2 = y2 if y2.stride(-1) == 1 else y2.contiguous()
    z2 = z2 if z2.stride(-1) == 1 else z2.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    rows = y2.shape[0]
    launch = _launch(k, rows, launch_values)
    block_k = gated_block_k(min(launch.block_k, max(16, 1 << (k - 1).bit_length())), group_size)
    per = _cdiv(_cdiv(k, launch.splits), block_k) * block_k  # each split's K range, whole steps
    parts = torch.empty(launch.splits, rows, n, dtype=torch.float32, device=y.device)
    if rows:
        groups = k // group_size
        _kernel()[(-(-n // launch.block_n), launch.splits)](
            y2, z2, norm_weight, w, parts, rows, n, k, group_size, per, eps, y2.stride(0), z2.stride(0), w.stride(0),
            parts.stride(1), parts.stride(0), G_PAD=1 << max(0, groups - 1).bit_length(),
            M_PAD=1 << max(0, rows - 1).bit_length(), BLOCK_N=launch.block_n, BLOCK_K=block_k,
            BEFORE=norm_before_gate, num_warps=launch.warps, **gdc_launch(y, pdl),
        )  # fmt: skip
    return parts.view(launch.splits, *y.shape[:-1], n)


@_gated_norm_partials_op.register_fake
def _(
    y: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
    weight: torch.Tensor,
    launch_values: list[int] | None,
    pdl: bool = False,
) -> torch.Tensor:
    splits = _launch(weight.shape[1], 1, launch_values).splits if _use_triton(y) else 1
    return y.new_empty(splits, *y.shape[:-1], weight.shape[0], dtype=torch.float32)


def gated_norm_partials(
    y: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
    weight: torch.Tensor,
    launch: Launch | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``F.linear(gated_rms_norm(y, z), weight)`` (no bias) for at most
    :data:`~mcore_infer.kernels.small_gemv.FMA_MAX_ROWS` rows of ``y`` and ``z`` ``[..., K]`` (``z`` may be a strided
    view, e.g. of the in-projection's output), the norm over groups of ``group_size`` channels with weight
    ``norm_weight`` ``[K]``: float32 split-K partial sums ``[splits, ..., N]`` (one on the PyTorch path) for
    :func:`~mcore_infer.kernels.small_gemv.add_deferred`. ``launch``: a
    :class:`~mcore_infer.kernels.small_gemv.Launch` (None: the row kernel's heuristic for ``K``). ``pdl``: a
    programmatic dependent launch on Hopper and later. Inference only."""
    k = weight.shape[1]
    rows = y.numel() // max(1, y.shape[-1])
    if rows > FMA_MAX_ROWS:
        raise ValueError(
            f"gated_norm_partials takes at most {FMA_MAX_ROWS} rows, got {rows}: use the norm and F.linear"
        )
    if y.shape != z.shape or y.shape[-1] != k or norm_weight.shape != (k,):
        raise ValueError(f"gated_norm_partials: y {tuple(y.shape)}, z {tuple(z.shape)}, norm weight "
                         f"{tuple(norm_weight.shape)} and weight {tuple(weight.shape)} do not match")  # fmt: skip
    if not takes_group(group_size) or k % group_size:
        raise ValueError(f"gated_norm_partials: group size {group_size} must divide {k} and have a power-of-two "
                         "factor of at least 16")  # fmt: skip
    values = None if launch is None else list(launch.checked())
    result: torch.Tensor = _gated_norm_partials_op(y, z, norm_weight, float(eps), int(group_size),
                                                   bool(norm_before_gate), weight, values, bool(pdl))  # fmt: skip
    return result
