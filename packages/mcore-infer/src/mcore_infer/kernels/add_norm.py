"""The deferred residual add and the RMSNorm after it as one Triton kernel for steps of a few rows (batch-1
decoding), launched as a programmatic dependent where the GPU has them.

A decode layer's norms sit between weight-streaming GEMVs: ``h = out + residual`` (``out`` possibly the split-K
partial sums of the projection before, added in float32 and rounded once, as
:func:`~mcore_infer.kernels.small_gemv.add_deferred` adds them), then ``rms_norm(h) * weight`` (as ``F.rms_norm``
computes it: float32 statistics, the normalised row rounded to the input dtype before the weight multiplies it).
Compiled layers get both from one Inductor kernel; this one does the same with grid-dependency control
(:func:`~mcore_infer.kernels.norm_linear.gdc_launch`): it signals the next kernel at its start and loads the norm
weight before waiting for the kernel before it, so in a chain of such kernels each launch overlaps the end of the
previous one (the row GEMVs and the attention kernels do the same).

The op ``mcore_infer::add_rms_norm`` returns ``(normed, h)``; without Triton, or on the CPU outside
``TRITON_INTERPRET=1``, it computes the same with PyTorch ops.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mcore_infer.kernels.norm_linear import _use_triton, gdc_launch
from mcore_infer.kernels.small_gemv import add_deferred, check_deferred

__all__ = ["MAX_ROWS", "add_rms_norm", "add_rms_norm_reference"]

MAX_ROWS = 64  # one program per row: more rows are the compiled norm's job
_KERNEL: Any = None


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit  # type: ignore[misc]
    def add_rms_norm_kernel(  # type: ignore[no-untyped-def]
        X,
        R,
        NW,
        OUT,
        H,
        D,
        eps,
        stride_xs,
        stride_xm,
        stride_rm,
        SPLITS: tl.constexpr,
        PARTS: tl.constexpr,
        HAS_R: tl.constexpr,
        D_PAD: tl.constexpr,
        GDC: tl.constexpr,
    ):
        row = tl.program_id(0)
        if GDC:
            gdc_launch_dependents()
        d = tl.arange(0, D_PAD)
        mask = d < D
        nw = tl.load(NW + d, mask=mask, other=0.0)  # a weight: written before this step, read before the wait
        if GDC:
            gdc_wait()
        dtype = OUT.dtype.element_ty
        if PARTS:  # float32 partial sums added to the residual in float32, rounded once
            h = tl.load(R + row * stride_rm + d, mask=mask, other=0.0).to(tl.float32)
            for s in range(SPLITS):
                h += tl.load(X + s * stride_xs + row * stride_xm + d, mask=mask, other=0.0)
            h = h.to(dtype)
        else:
            h = tl.load(X + row * stride_xm + d, mask=mask, other=0.0)
            if HAS_R:  # a plain add in the input dtype (rounded once)
                h = h.to(tl.float32) + tl.load(R + row * stride_rm + d, mask=mask, other=0.0).to(tl.float32)
                h = h.to(dtype)
        hf = h.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / D + eps)
        normed = (hf * inv).to(dtype).to(tl.float32) * nw.to(tl.float32)
        tl.store(OUT + row * D + d, normed.to(dtype), mask=mask)
        tl.store(H + row * D + d, h, mask=mask)

    _KERNEL = add_rms_norm_kernel
    return _KERNEL


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused computation (PyTorch ops): what the kernel must equal up to rounding."""
    h = x.clone() if residual is None else add_deferred(x, residual)  # (an op's output never aliases its input)
    return F.rms_norm(h, weight.shape, weight, eps), h


@torch.library.custom_op("mcore_infer::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, pdl: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    parts = residual is not None and x.dim() == residual.dim() + 1
    shape = residual.shape if residual is not None else x.shape
    if not _use_triton(residual if residual is not None else x):
        return add_rms_norm_reference(x, residual, weight, eps)
    d = shape[-1]
    rows = int(torch.Size(shape).numel()) // d
    dtype = residual.dtype if residual is not None else x.dtype
    x2 = x.reshape(x.shape[0], rows, d) if parts else x.reshape(rows, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = residual.reshape(rows, d).contiguous() if residual is not None else x2
    out = torch.empty(rows, d, dtype=dtype, device=x.device)
    h = torch.empty_like(out)
    if rows:
        _kernel()[(rows,)](
            x2, r2, weight, out, h, d, eps, x2.stride(0) if parts else 0, x2.stride(-2), r2.stride(0),
            SPLITS=x.shape[0] if parts else 1, PARTS=parts, HAS_R=residual is not None,
            D_PAD=1 << (d - 1).bit_length(), num_warps=4 if d <= 4096 else 8, **gdc_launch(x2, pdl),
        )  # fmt: skip
    return out.view(shape), h.view(shape)


@_add_rms_norm_op.register_fake
def _(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, pdl: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = residual.shape if residual is not None else x.shape
    dtype = residual.dtype if residual is not None else x.dtype
    return x.new_empty(shape, dtype=dtype), x.new_empty(shape, dtype=dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(h) * weight, h)`` for ``h = x + residual`` (``x`` either the same shape as ``residual`` or its
    float32 split-K partial sums ``[splits, *residual.shape]``; no residual: ``h = x``), at most :data:`MAX_ROWS`
    rows. ``pdl``: launched as a programmatic dependent on Hopper and later. Inference only."""
    shape = residual.shape if residual is not None else x.shape
    rows = int(torch.Size(shape).numel()) // max(1, shape[-1])
    if rows > MAX_ROWS:
        raise ValueError(f"add_rms_norm takes at most {MAX_ROWS} rows, got {rows}: use the residual add and RMSNorm")
    check_deferred("add_rms_norm", x, residual)
    if weight.shape != (shape[-1],):
        raise ValueError(f"add_rms_norm: norm weight {tuple(weight.shape)} for rows of {shape[-1]}")
    return _add_rms_norm_op(x, residual, weight, float(eps), bool(pdl))
