"""A gated MLP of a few rows (batch-1 decoding) as one weight-streaming Triton kernel: up projection, SwiGLU and
down projection, with the down projection's split-K partial sums added by a second, small kernel.

In a decode step the MLP reads its two weights (``fc1`` ``[2F, H]`` = ``[gate; up]`` and ``fc2`` ``[H, F]``, five
sixths of a Llama layer's bytes) once each, and its time is their bytes over the bandwidth reached. Run as cuBLAS's up
projection then :func:`~mcore_infer.kernels.small_gemv.swiglu_down`, it is two kernels with a full stop between
them (cuBLAS is not launched as a programmatic dependent). Here program ``p`` owns the intermediate features
``[p * BLOCK_F, (p + 1) * BLOCK_F)``: it computes their gate and up rows over all of ``H`` (products accumulated
elementwise in registers, as the one-row GEMV does), rounds each to the input dtype as the unfused ops do, applies
``silu(gate) * up`` (each product rounded too, as eager 16-bit PyTorch ops round them), and multiplies the result by the
same features' columns of ``fc2``, writing the float32 partial sums ``[programs, M, H]`` of the down projection: no
program needs another's output, so the whole MLP streams its ~100 MB (``llama-1b``) in one launch. :func:`sum_partials`
adds the partials in a fixed order (the result does not depend on scheduling) to one float32 ``[1, M, H]``, which the
next residual add reads as any split-K partial sum (:func:`~mcore_infer.kernels.small_gemv.add_deferred`,
:func:`~mcore_infer.kernels.add_norm.add_rms_norm`).

Both launch as programmatic dependents where the GPU has them (:func:`~mcore_infer.kernels.norm_linear.gdc_launch`):
the MLP kernel loads its first gate and up tiles before it waits for the kernel before it.

The op ``mcore_infer::fused_mlp_partials`` computes the same with PyTorch ops without Triton, or on the CPU outside
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from mcore_infer.kernels._row_input import install, row_operands
from mcore_infer.kernels.norm_linear import _use_triton, gdc_launch, parse_ints
from mcore_infer.kernels.small_gemv import FMA_MAX_ROWS, add_deferred, check_deferred, swiglu_down_reference

__all__ = [
    "MlpLaunch",
    "fused_mlp_partials",
    "fused_mlp_reference",
    "heuristic_mlp_launch",
    "norm_mlp_partials",
    "norm_mlp_reference",
    "sum_partials",
]

_KERNELS: Any = None
_input_tile: Any = None  # the shared helpers, set by _row_input.install (Triton looks a kernel's callees up here)
_row_stats: Any = None


def _kernels() -> Any:
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    install(globals())  # _residual_sum, _input_tile, _row_stats

    @triton.jit  # type: ignore[misc]
    def fused_mlp_kernel(  # type: ignore[no-untyped-def]
        X,
        R,
        NW,
        HOUT,
        W1,
        W2,
        Y,
        M,
        H,
        FF,
        eps,
        stride_xs,
        stride_xm,
        stride_rm,
        stride_w1,
        stride_w2,
        stride_ys,
        stride_ym,
        SPLITS: tl.constexpr,
        M_PAD: tl.constexpr,
        H_PAD: tl.constexpr,
        BLOCK_F: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_H: tl.constexpr,
        NORM: tl.constexpr,
        PARTS: tl.constexpr,
        GDC: tl.constexpr,
    ):
        # NORM: X (with the residual R) is the input before the residual add and RMSNorm: each program takes each
        # row's mean square over the whole row first, then normalises the tiles it loads; program 0 writes h = x + R
        # to HOUT. Else X is the MLP's input.
        pid = tl.program_id(0)
        dtype = R.dtype.element_ty
        rows = tl.arange(0, M_PAD)
        fs = pid * BLOCK_F + tl.arange(0, BLOCK_F)
        fmask = fs < FF
        ks = tl.arange(0, BLOCK_K)
        gate_rows = W1 + fs[:, None] * stride_w1
        up_rows = W1 + (fs[:, None] + FF) * stride_w1
        acc_g = tl.zeros([M_PAD, BLOCK_F, BLOCK_K], tl.float32)
        acc_u = tl.zeros([M_PAD, BLOCK_F, BLOCK_K], tl.float32)
        k_lo = 0
        if GDC:  # the first weight tiles before waiting for the kernel that writes X
            gdc_launch_dependents()
            wmask = fmask[:, None] & (ks[None, :] < H)
            wg = tl.load(gate_rows + ks[None, :], mask=wmask, other=0.0)
            wu = tl.load(up_rows + ks[None, :], mask=wmask, other=0.0)
            gdc_wait()
        inv = tl.zeros([M_PAD], tl.float32)
        if NORM:
            d = tl.arange(0, H_PAD)
            inv, h = _row_stats(X, R, rows, d, M, H, eps, stride_xs, stride_xm, stride_rm, dtype, SPLITS, PARTS)
            if pid == 0:
                tl.store(
                    HOUT + rows[:, None] * H + d[None, :], h.to(dtype), mask=(rows[:, None] < M) & (d[None, :] < H)
                )
        if GDC:
            x = _input_tile(X, R, NW, inv, rows, ks, M, H, stride_xs, stride_xm, stride_rm, dtype, SPLITS, PARTS, NORM)
            acc_g += x[:, None, :] * wg.to(tl.float32)[None, :, :]
            acc_u += x[:, None, :] * wu.to(tl.float32)[None, :, :]
            k_lo = BLOCK_K
        for k0 in range(k_lo, H, BLOCK_K):
            kk = k0 + ks
            wmask = fmask[:, None] & (kk[None, :] < H)
            wg = tl.load(gate_rows + kk[None, :], mask=wmask, other=0.0)
            wu = tl.load(up_rows + kk[None, :], mask=wmask, other=0.0)
            x = _input_tile(X, R, NW, inv, rows, kk, M, H, stride_xs, stride_xm, stride_rm, dtype, SPLITS, PARTS, NORM)
            acc_g += x[:, None, :] * wg.to(tl.float32)[None, :, :]
            acc_u += x[:, None, :] * wu.to(tl.float32)[None, :, :]
        # the up projection's output in the input dtype, then silu(gate) and its product with up, each rounded
        gate = tl.sum(acc_g, axis=2).to(dtype).to(tl.float32)
        up = tl.sum(acc_u, axis=2).to(dtype).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        act = (act * up).to(dtype).to(tl.float32)  # [M_PAD, BLOCK_F]; zero in masked features (their weights are 0)
        for h0 in range(0, H, BLOCK_H):
            hs = h0 + tl.arange(0, BLOCK_H)
            w2 = tl.load(W2 + hs[:, None] * stride_w2 + fs[None, :], mask=(hs[:, None] < H) & fmask[None, :],
                         other=0.0).to(tl.float32)  # fmt: skip
            out = tl.sum(act[:, None, :] * w2[None, :, :], axis=2)  # [M_PAD, BLOCK_H]
            tl.store(Y + pid * stride_ys + rows[:, None] * stride_ym + hs[None, :], out,
                     mask=(rows[:, None] < M) & (hs[None, :] < H))  # fmt: skip

    @triton.jit  # type: ignore[misc]
    def sum_partials_kernel(  # type: ignore[no-untyped-def]
        P, OUT, S, N, stride_ps, S_PAD: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr
    ):
        pid = tl.program_id(0)
        if GDC:
            gdc_launch_dependents()
            gdc_wait()
        ss = tl.arange(0, S_PAD)
        cols = pid * BLOCK + tl.arange(0, BLOCK)
        tile = tl.load(P + ss[:, None] * stride_ps + cols[None, :], mask=(ss[:, None] < S) & (cols[None, :] < N),
                       other=0.0)  # fmt: skip
        tl.store(OUT + cols, tl.sum(tile, axis=0), mask=cols < N)

    _KERNELS = (fused_mlp_kernel, sum_partials_kernel)
    return _KERNELS


class MlpLaunch(NamedTuple):
    """A launch of the fused MLP kernel."""

    block_f: int = 64  # intermediate features per program (a power of two >= 8): programs = F / block_f
    block_k: int = 128  # input elements per step of the up projection (a power of two >= 16)
    block_h: int = 64  # output features per step of the down projection (a power of two >= 16)
    warps: int = 8

    def __str__(self) -> str:  # the form :meth:`parse` reads
        return ",".join(str(v) for v in self)

    @classmethod
    def parse(cls, text: str) -> MlpLaunch:
        """A checked launch from ``BLOCK_F,BLOCK_K,BLOCK_H,WARPS`` (integers)."""
        source = f"fused MLP launch {text!r} (expected BLOCK_F,BLOCK_K,BLOCK_H,WARPS, e.g. 64,128,64,8)"
        return cls(*parse_ints(text, source, (4,))).checked(source)

    def checked(self, source: str | None = None) -> MlpLaunch:
        """This launch, or a ValueError saying which field the kernel cannot take (``source`` opens the message)."""
        source = source or f"fused MLP launch {self!r}"
        pow2 = all(v > 0 and not v & (v - 1) for v in self[:3])
        if not pow2 or self.block_f < 8 or self.block_k < 16 or self.block_h < 16:
            raise ValueError(f"{source}: BLOCK_F (>= 8), BLOCK_K and BLOCK_H (>= 16) must be powers of two")
        if self.warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"{source}: WARPS must be one of 1, 2, 4, 8, 16")
        return self


def heuristic_mlp_launch(rows: int) -> MlpLaunch:
    """64 intermediate features a program (128 programs for an 8,192-wide MLP: about one per H200 SM; each reads
    128-byte segments of the down projection's rows), 8 warps, and a step of the up projection that keeps the
    register tiles of its products at ``rows * 64 * block_k`` floats (128 inputs at one row)."""
    m_pad = 1 << max(0, rows - 1).bit_length()
    return MlpLaunch(64, max(32, 128 // m_pad), 64, 8)


def fused_mlp_reference(x: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor) -> torch.Tensor:
    """The unfused computation (PyTorch ops): the up projection, SwiGLU and the down projection."""
    return swiglu_down_reference(F.linear(x, fc1_weight), fc2_weight)


def _check(x: torch.Tensor, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor) -> None:
    rows = x.numel() // max(1, x.shape[-1])
    if rows > FMA_MAX_ROWS:
        raise ValueError(f"fused_mlp_partials takes at most {FMA_MAX_ROWS} rows, got {rows}: use the MLP's GEMMs")
    h, ff = fc2_weight.shape
    if fc1_weight.shape != (2 * ff, h) or x.shape[-1] != h:
        raise ValueError(
            f"fused_mlp_partials: x {tuple(x.shape)}, fc1 {tuple(fc1_weight.shape)} and fc2 {tuple(fc2_weight.shape)}"
            f" are not a gated MLP (fc1 [2F, H] = [gate; up], fc2 [H, F], x [..., H])"
        )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sum_partials(parts: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``parts.sum(0, keepdim=True)`` for float32 partial sums ``[S, ...]`` of a few rows, in a fixed order: one
    Triton kernel (a programmatic dependent with ``pdl``) on CUDA or under the interpreter, else PyTorch's sum."""
    if not _use_triton(parts):
        return parts.sum(0, keepdim=True)
    s = parts.shape[0]
    flat = parts.reshape(s, -1)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    n = flat.shape[1]
    out = torch.empty(1, *parts.shape[1:], dtype=torch.float32, device=parts.device)
    s_pad = 1 << max(0, s - 1).bit_length()
    block = max(16, min(256, 4096 // s_pad))
    if n:
        _kernels()[1][(_cdiv(n, block),)](
            flat, out, s, n, flat.stride(0), S_PAD=s_pad, BLOCK=block, num_warps=4, **gdc_launch(flat, pdl)
        )
    return out


def _run(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm: tuple[torch.Tensor, float] | None,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    launch_values: list[int] | None,
    pdl: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' ``(sum [1, ..., H], h)`` (``h`` the residual sum with ``norm``, else an empty tensor)."""
    h, ff = fc2_weight.shape
    x2, r2, shape, parts_in = row_operands(x, residual)
    rows = r2.shape[0]
    w1 = fc1_weight if fc1_weight.stride(-1) == 1 else fc1_weight.contiguous()
    w2 = fc2_weight if fc2_weight.stride(-1) == 1 else fc2_weight.contiguous()
    launch = heuristic_mlp_launch(rows) if launch_values is None else MlpLaunch(*launch_values)
    programs = _cdiv(ff, launch.block_f)
    parts = torch.empty(programs, rows, h, dtype=torch.float32, device=x.device)
    h_out = torch.empty(rows if norm is not None else 0, h, dtype=r2.dtype, device=x.device)
    nw, eps = norm if norm is not None else (r2, 0.0)
    if rows:
        _kernels()[0][(programs,)](
            x2, r2, nw, h_out, w1, w2, parts, rows, h, ff, eps, x2.stride(0), x2.stride(1), r2.stride(0),
            w1.stride(0), w2.stride(0), parts.stride(0), parts.stride(1), SPLITS=x2.shape[0],
            M_PAD=1 << max(0, rows - 1).bit_length(), H_PAD=1 << max(0, h - 1).bit_length() if norm else 16,
            BLOCK_F=launch.block_f, BLOCK_K=launch.block_k, BLOCK_H=launch.block_h, NORM=norm is not None,
            PARTS=parts_in, num_warps=launch.warps, **gdc_launch(x2, pdl),
        )  # fmt: skip
    return sum_partials(parts, pdl).view(1, *shape[:-1], h), h_out.view(shape if norm is not None else (0, h))


@torch.library.custom_op("mcore_infer::fused_mlp_partials", mutates_args=())
def _fused_mlp_op(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    launch_values: list[int] | None,
    pdl: bool = False,
) -> torch.Tensor:
    if not _use_triton(x):
        return fused_mlp_reference(x, fc1_weight, fc2_weight).float()[None]
    return _run(x, None, None, fc1_weight, fc2_weight, launch_values, pdl)[0]


@_fused_mlp_op.register_fake
def _(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    launch_values: list[int] | None,
    pdl: bool = False,
) -> torch.Tensor:
    return x.new_empty(1, *x.shape[:-1], fc2_weight.shape[0], dtype=torch.float32)


def fused_mlp_partials(
    x: torch.Tensor,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    launch: MlpLaunch | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """A gated MLP, ``F.linear(silu(gate) * up, fc2_weight)`` for ``[gate | up] = F.linear(x, fc1_weight)``, of at
    most :data:`~mcore_infer.kernels.small_gemv.FMA_MAX_ROWS` rows (no biases), as its float32 sum ``[1, ..., H]``
    for a consumer that adds it where it reads it (:func:`~mcore_infer.kernels.small_gemv.add_deferred`): one kernel
    for the three ops and one that adds its partial sums. ``launch``: None is :func:`heuristic_mlp_launch`.
    ``pdl``: both launched as programmatic dependents on Hopper and later. Inference only."""
    _check(x, fc1_weight, fc2_weight)
    values = None if launch is None else list(launch.checked())
    result: torch.Tensor = _fused_mlp_op(x, fc1_weight, fc2_weight, values, bool(pdl))
    return result


def norm_mlp_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused computation of :func:`norm_mlp_partials` (PyTorch ops): ``(mlp(rms_norm(h)), h)``."""
    h = add_deferred(x, residual)
    return fused_mlp_reference(F.rms_norm(h, norm_weight.shape, norm_weight, eps), fc1_weight, fc2_weight), h


@torch.library.custom_op("mcore_infer::norm_mlp_partials", mutates_args=())
def _norm_mlp_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    launch_values: list[int] | None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not _use_triton(residual):
        out, h = norm_mlp_reference(x, residual, norm_weight, eps, fc1_weight, fc2_weight)
        return out.float()[None], h
    return _run(x, residual, (norm_weight, eps), fc1_weight, fc2_weight, launch_values, pdl)


@_norm_mlp_op.register_fake
def _(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    launch_values: list[int] | None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = residual.new_empty(1, *residual.shape[:-1], fc2_weight.shape[0], dtype=torch.float32)
    return out, residual.new_empty(residual.shape)


def norm_mlp_partials(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    fc1_weight: torch.Tensor,
    fc2_weight: torch.Tensor,
    launch: MlpLaunch | None = None,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add, the RMSNorm and the gated MLP of :func:`fused_mlp_partials` in the same two kernels:
    ``(mlp(rms_norm(h) * norm_weight) as [1, ..., H] float32, h)`` for ``h = x + residual`` (``x`` of the residual's
    shape or its float32 split-K partial sums ``[splits, *residual.shape]``, added in float32 and rounded once, as
    :func:`~mcore_infer.kernels.add_norm.add_rms_norm` adds them). Each program of the MLP kernel takes the rows'
    mean squares itself (a row is a few KB, read from the L2), so no norm kernel runs before it. Inference only."""
    _check(residual, fc1_weight, fc2_weight)
    check_deferred("norm_mlp_partials", x, residual)
    if norm_weight.shape != (residual.shape[-1],):
        raise ValueError(f"norm_mlp_partials: norm weight {tuple(norm_weight.shape)} for rows of {residual.shape[-1]}")
    values = None if launch is None else list(launch.checked())
    return _norm_mlp_op(x, residual, norm_weight, float(eps), fc1_weight, fc2_weight, values, bool(pdl))
