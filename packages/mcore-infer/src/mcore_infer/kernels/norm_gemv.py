"""The residual add and RMSNorm inside the one-row GEMV after them, for steps of a few rows (batch-1 decoding).

A decode layer starts with ``h = out + residual`` (``out`` possibly the split-K partial sums of the layer before),
``rms_norm(h) * weight`` and the QKV projection. :func:`~mcore_infer.kernels.add_norm.add_rms_norm` and
:func:`~mcore_infer.kernels.small_gemv.row_linear` do it in two kernels; :func:`norm_row_linear` does it in one: each
program takes the rows' mean squares over the whole row first (the row is a few KB, read from the L2 by every
program), then streams its ``BLOCK_N`` weight rows as the row kernel does (products accumulated elementwise in
registers), normalising each input tile it loads as ``F.rms_norm`` rounds it; program 0 writes ``h``, the next
residual. Where the row is at most two K steps (``llama-1b``'s 2,048 at the default 1,024), the program normalises
the ``h`` it took the mean squares of, once, instead of reading the row again for each tile, and the second tile's
weight load is in flight while it does (with the same early load in the row GEMV, a batch-1 decode step of
``llama-1b`` ran 1.041x on an H100). Unlike :mod:`~mcore_infer.kernels.norm_linear` (which scales the finished
products by the row's 1 / rms, with MMAs over padded rows), the products here are of the normalised input rounded as
the unfused ops round it.

Launched as a programmatic dependent where the GPU has them (its first weight tile loaded before it waits for the
kernel before it). The op ``mcore_infer::norm_row_linear`` computes the same with PyTorch ops without Triton, or on
the CPU outside ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mcore_infer.kernels._row_input import install, row_operands
from mcore_infer.kernels.add_norm import add_rms_norm_reference
from mcore_infer.kernels.norm_linear import _use_triton, gdc_launch
from mcore_infer.kernels.small_gemv import FMA_MAX_ROWS, Launch, check_deferred, heuristic_launch

__all__ = ["norm_row_linear", "norm_row_linear_reference"]

_KERNEL: Any = None
_input_tile: Any = None  # the shared helpers, set by _row_input.install (Triton looks a kernel's callees up here)
_row_stats: Any = None


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    install(globals())

    @triton.jit  # type: ignore[misc]
    def norm_gemv_kernel(  # type: ignore[no-untyped-def]
        X,
        R,
        NW,
        HOUT,
        W,
        Y,
        M,
        N,
        K,
        eps,
        stride_xs,
        stride_xm,
        stride_rm,
        stride_wn,
        SPLITS: tl.constexpr,
        PARTS: tl.constexpr,
        M_PAD: tl.constexpr,
        K_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GDC: tl.constexpr,
        WHOLE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        dtype = R.dtype.element_ty
        rows = tl.arange(0, M_PAD)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        w_rows = W + cols[:, None] * stride_wn
        acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], tl.float32)
        k_lo = 0
        if GDC:  # the first weight tile before waiting for the kernel that writes X
            gdc_launch_dependents()
        if GDC or WHOLE > 0:
            w0 = tl.load(w_rows + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
        if GDC:
            gdc_wait()
        if WHOLE == 2:  # the second (last) tile's load in flight while the row's statistics are taken
            k1 = BLOCK_K + ks
            w1 = tl.load(w_rows + k1[None, :], mask=(cols[:, None] < N) & (k1[None, :] < K), other=0.0)
        d = tl.arange(0, K_PAD)
        inv, h = _row_stats(X, R, rows, d, M, K, eps, stride_xs, stride_xm, stride_rm, dtype, SPLITS, PARTS)
        if pid == 0:
            tl.store(HOUT + rows[:, None] * K + d[None, :], h.to(dtype), mask=(rows[:, None] < M) & (d[None, :] < K))
        if WHOLE > 0:  # the row normalised once from the h above (rounded as _input_tile rounds), cut into its tiles
            nw = tl.load(NW + d, mask=d < K, other=0.0).to(tl.float32)
            xn = ((h * inv[:, None]).to(dtype).to(tl.float32) * nw[None, :]).to(dtype).to(tl.float32)
            if WHOLE == 1:
                acc += xn[:, None, :] * w0.to(tl.float32)[None, :, :]
            else:
                x0, x1 = tl.split(tl.permute(tl.reshape(xn, [M_PAD, 2, BLOCK_K]), [0, 2, 1]))
                acc += x0[:, None, :] * w0.to(tl.float32)[None, :, :]
                acc += x1[:, None, :] * w1.to(tl.float32)[None, :, :]
        else:
            if GDC:
                x = _input_tile(X, R, NW, inv, rows, ks, M, K, stride_xs, stride_xm, stride_rm, dtype, SPLITS, PARTS,
                                True)  # fmt: skip
                acc += x[:, None, :] * w0.to(tl.float32)[None, :, :]
                k_lo = BLOCK_K
            for k0 in range(k_lo, K, BLOCK_K):
                kk = k0 + ks
                w = tl.load(w_rows + kk[None, :], mask=(cols[:, None] < N) & (kk[None, :] < K), other=0.0)
                x = _input_tile(X, R, NW, inv, rows, kk, M, K, stride_xs, stride_xm, stride_rm, dtype, SPLITS, PARTS,
                                True)  # fmt: skip
                acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
        out = tl.sum(acc, axis=2)
        tl.store(Y + rows[:, None] * N + cols[None, :], out.to(dtype), mask=(rows[:, None] < M) & (cols[None, :] < N))

    _KERNEL = norm_gemv_kernel
    return _KERNEL


def _heuristic(k: int, rows: int, row: bool = True) -> Launch:
    """The row kernel's launch (:func:`~mcore_infer.kernels.small_gemv.heuristic_launch`, one split unless ``row`` is
    False) with its K step divided by the padded row count, so that the register tile of products stays 8 x 1,024
    floats (at four rows 8 x 1,024 spilled 644 bytes a thread for ``sm_90a``, and 668 in the gated-norm GEMV;
    ``bench/kernel_registers.py``)."""
    base = heuristic_launch(k, row=row)
    m_pad = 1 << max(0, rows - 1).bit_length()
    return base._replace(block_k=max(64, base.block_k // m_pad))


def norm_row_linear_reference(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused computation (PyTorch ops): ``(F.linear(rms_norm(h) * norm_weight, weight), h)``."""
    normed, h = add_rms_norm_reference(x, residual, norm_weight, eps)
    return F.linear(normed, weight), h


@torch.library.custom_op("mcore_infer::norm_row_linear", mutates_args=())
def _norm_row_linear_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    launch_values: list[int] | None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not _use_triton(x if residual is None else residual):
        return norm_row_linear_reference(x, residual, norm_weight, eps, weight)
    n, k = weight.shape
    x2, r2, shape, parts = row_operands(x, residual)  # no residual: h is x itself, read as r2 with nothing added
    rows = r2.shape[0]
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    launch = _heuristic(k, rows) if launch_values is None else Launch(*launch_values)
    k_pad = 1 << max(0, k - 1).bit_length()
    block_k = min(launch.block_k, k_pad)  # (a wider tile would only load masked columns)
    y = torch.empty(rows, n, dtype=r2.dtype, device=x.device)
    h = torch.empty_like(r2)
    if rows:
        _kernel()[(-(-n // launch.block_n),)](
            x2, r2, norm_weight, h, w, y, rows, n, k, eps, x2.stride(0), x2.stride(1), r2.stride(0), w.stride(0),
            SPLITS=0 if residual is None else x2.shape[0], PARTS=parts or residual is None, M_PAD=1 << max(0, rows - 1).bit_length(),
            K_PAD=k_pad, BLOCK_N=launch.block_n, BLOCK_K=block_k, num_warps=launch.warps,
            WHOLE=k_pad // block_k if k_pad <= 2 * block_k else 0, **gdc_launch(x2, pdl),
        )  # fmt: skip
    return y.view(*shape[:-1], n), h.view(shape)


@_norm_row_linear_op.register_fake
def _(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    launch_values: list[int] | None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    like = x if residual is None else residual
    return like.new_empty(*like.shape[:-1], weight.shape[0]), like.new_empty(like.shape)


def norm_row_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    launch: Launch | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(rms_norm(h) * norm_weight, weight), h)`` for ``h = x + residual`` (``x`` of the residual's shape
    or its float32 split-K partial sums ``[splits, *residual.shape]``, added in float32 and rounded once; no
    residual: ``h = x``), at most
    :data:`~mcore_infer.kernels.small_gemv.FMA_MAX_ROWS` rows, no bias: one kernel. ``launch``: a
    :class:`~mcore_infer.kernels.small_gemv.Launch` whose ``SPLITS`` must be 1 (None: the row kernel's heuristic).
    ``pdl``: a programmatic dependent launch on Hopper and later. Inference only."""
    shape = x.shape if residual is None else residual.shape
    rows = int(torch.Size(shape).numel()) // max(1, shape[-1])
    if rows > FMA_MAX_ROWS:
        raise ValueError(f"norm_row_linear takes at most {FMA_MAX_ROWS} rows, got {rows}: use the norm and F.linear")
    check_deferred("norm_row_linear", x, residual)
    if norm_weight.shape != (shape[-1],) or weight.shape[1] != shape[-1]:
        raise ValueError(f"norm_row_linear: norm weight {tuple(norm_weight.shape)} and weight {tuple(weight.shape)} "
                         f"for rows of {shape[-1]}")  # fmt: skip
    if launch is not None and launch.checked().splits != 1:
        raise ValueError(f"norm_row_linear: launch {launch} has SPLITS={launch.splits}; the kernel writes the summed "
                         "output (SPLITS=1)")  # fmt: skip
    values = None if launch is None else list(launch)
    return _norm_row_linear_op(x, residual, norm_weight, float(eps), weight, values, bool(pdl))
