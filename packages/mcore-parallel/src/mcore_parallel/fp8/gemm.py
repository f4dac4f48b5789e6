"""The FP8 GEMMs of a linear layer ``y = x Wᵀ`` and their autograd function.

All three products go through :func:`scaled_mm` (``torch._scaled_mm``) with both operands stored ``[rows, K]``,
contraction dimension last, the second passed transposed, i.e. column-major, as cuBLASLt's FP8 GEMMs need:

| product | first operand | second operand |
|---|---|---|
| forward ``y = x Wᵀ`` | ``x`` ``[T, in]`` (E4M3) | ``W`` ``[out, in]`` (E4M3) |
| dgrad ``dx = g W`` | ``g`` ``[T, out]`` (E5M2 for hybrid) | ``Wᵀ`` ``[in, out]`` (the cached transpose) |
| wgrad ``dW = gᵀ x`` | ``gᵀ`` ``[out, T]`` | ``xᵀ`` ``[in, T]`` (saved from the forward) |

``K`` and the second operand's rows must be multiples of 16 on GPUs: the layers check ``in`` and ``out`` when they
are built (and fall back to bf16 otherwise); the token count ``T``, the wgrad's ``K``, is padded with zeros (exact).
Two E5M2 operands are refused (no such GEMM on GPUs). The forward accumulates with Hopper's fast accumulation, the
two gradient GEMMs without it (the split-accumulator choice of the published recipes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mcore_parallel.fp8.recipe import E4M3, E5M2, Fp8Recipe
from mcore_parallel.fp8.scaling import (
    DelayedScaling,
    Fp8Tensor,
    current_scale,
    quantize,
    quantize_with_transpose,
)
from mcore_parallel.state import Group
from mcore_parallel.tensor import _comm
from mcore_parallel.tensor.wgrad import keep_owner, weight_grad, wgrad_owner

__all__ = ["scaled_mm", "WeightCast", "LinearPlan", "fp8_linear", "fp8_weight_grad", "GEMM_ALIGNMENT"]

GEMM_ALIGNMENT = 16
"""``torch._scaled_mm`` on GPUs: the contraction dimension and the second operand's rows are multiples of this."""


def scaled_mm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """``a @ bᵀ`` for ``a`` ``[M, K]`` and ``b`` ``[N, K]`` (both row-major, so ``bᵀ`` is column-major) with their
    scales, in ``out_dtype``. Checks the GPU kernels' rules on every device (the CPU kernel is more lenient)."""
    if a.data.dim() != 2 or b.data.dim() != 2 or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"scaled_mm: operands [M, K] and [N, K] expected, got {tuple(a.data.shape)} and "
                         f"{tuple(b.data.shape)}")  # fmt: skip
    k, n = a.data.shape[1], b.data.shape[0]
    if k % GEMM_ALIGNMENT or n % GEMM_ALIGNMENT:
        raise ValueError(f"scaled_mm: K={k} and N={n} must be multiples of {GEMM_ALIGNMENT}")
    if not (a.data.is_contiguous() and b.data.is_contiguous()):
        raise ValueError("scaled_mm: both operands must be contiguous [rows, K] (the second is passed column-major)")
    if a.fmt is E5M2 and b.fmt is E5M2:
        raise ValueError("scaled_mm: two E5M2 operands (no such FP8 GEMM on GPUs)")
    if a.rowwise != b.rowwise:
        raise ValueError("scaled_mm: both operands tensorwise or both rowwise")
    if a.rowwise and (a.fmt is not E4M3 or b.fmt is not E4M3):
        raise ValueError("scaled_mm: rowwise scaling takes E4M3 operands only")
    if a.rowwise and a.data.is_cuda and out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"scaled_mm: rowwise-scaled GEMMs on GPUs write bf16 or fp16, not {out_dtype}; train with "
                         "model.params_dtype=bfloat16 or use model.fp8_recipe=tensorwise")  # fmt: skip
    scale_a, scale_b = a.scale_inv, b.scale_inv.reshape(1, -1) if b.rowwise else b.scale_inv
    if a.data.device.type == "cpu" and not a.rowwise and a.fmt is E4M3 and b.fmt is E4M3:
        # torch's CPU kernel for tensorwise E4M3 x E4M3 is a reference loop (~1000x slower than its rowwise one at
        # 256^3): the same scales, broadcast over the rows and columns
        scale_a, scale_b = scale_a.expand(a.data.shape[0], 1).contiguous(), scale_b.expand(1, n).contiguous()
    return torch._scaled_mm(a.data, b.data.t(), scale_a, scale_b, out_dtype=out_dtype, use_fast_accum=fast_accum)


@dataclass
class WeightCast:
    """A weight in FP8: ``weight`` ``[out, in]`` for the forward and ``transposed`` ``[in, out]`` for the input
    gradient (None when only the forward runs). Cached by the layer for a whole optimizer step."""

    weight: Fp8Tensor
    transposed: Fp8Tensor | None


@dataclass(frozen=True)
class LinearPlan:
    """What one FP8 linear call does besides its GEMMs: the groups its input's and its output gradient's absolute
    maxima are reduced over (their elements are split over those ranks), the sequence-parallel group its FP8 input
    is all-gathered over first (``fp8_allgather``), whether the weight gradient goes into ``main_grad``, and the
    layer's delayed-scaling state."""

    recipe: Fp8Recipe
    x_group: Group | None = None
    g_group: Group | None = None
    gather: Group | None = None
    fuse: bool = False
    state: DelayedScaling | None = None

    def quantize(self, t: torch.Tensor, role: int, group: Group | None, transpose: bool) -> tuple[Fp8Tensor, Any]:
        """``t`` ``[rows, K]`` in its role's format (and its transpose, tensorwise only)."""
        r = self.recipe
        fmt = r.backward_format if role == 2 else r.forward_format
        if self.state is not None:
            return self.state.quantize(role, t, group, transpose)
        scale = current_scale(t, fmt, r.rowwise, r.margin, group)
        if transpose:
            return quantize_with_transpose(t, fmt, scale)
        return quantize(t, fmt, scale), None


def _gather_fp8(q: Fp8Tensor, group: Group) -> Fp8Tensor:
    """Every rank's rows of ``q`` in rank order (the FP8 bytes travel; rowwise scales travel with them)."""
    data = _comm.all_gather(q.data.view(torch.uint8), group, 0).view(q.data.dtype)
    scale = _comm.all_gather(q.scale_inv, group, 0) if q.rowwise else q.scale_inv
    return Fp8Tensor(data, scale, q.fmt)


def _pad_k(t: Fp8Tensor) -> Fp8Tensor:
    """``t`` with zero columns up to a multiple of :data:`GEMM_ALIGNMENT` (they add nothing to the product)."""
    k = t.data.shape[1]
    pad = -k % GEMM_ALIGNMENT
    if not pad:
        return t
    raw = torch.nn.functional.pad(t.data.view(torch.uint8), (0, pad))  # byte 0 is +0.0 in both formats
    return Fp8Tensor(raw.view(t.data.dtype), t.scale_inv, t.fmt)


class _Fp8Linear(torch.autograd.Function):
    """``x Wᵀ`` with FP8 forward, input-gradient and (optionally) weight-gradient GEMMs (see the module docstring).
    ``x`` is ``[..., in]`` (this rank's sequence chunk when ``plan.gather`` is set); the bias is added outside.
    ``grad``: whether a backward will run (autograd's ``needs_input_grad`` does not know about ``no_grad``)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, cast: WeightCast, plan: LinearPlan, grad: bool
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        fp8_wgrad = grad and plan.recipe.fp8_wgrad
        # the input's transpose is the weight gradient's second operand: one cast pass writes both (tensorwise)
        xq, xt = plan.quantize(x2, 0, plan.x_group, fp8_wgrad and plan.gather is None)
        if plan.gather is not None:
            xq = _gather_fp8(xq, plan.gather)
            xt = xq.t() if fp8_wgrad else None
        y = scaled_mm(xq, cast.weight, x.dtype, fast_accum=True)
        if grad:
            saved = xt if xt is not None else xq
            ctx.save_for_backward(saved.data, saved.scale_inv)
            ctx.fmt, ctx.cast, ctx.plan = saved.fmt, cast, plan
            ctx.x_shape, ctx.w_dtype = x.shape, weight.dtype
            keep_owner(ctx, weight, plan.fuse)
        rows = x.shape[0] * (plan.gather.size if plan.gather is not None else 1)
        return y.view(rows, *x.shape[1:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        data, scale_inv = ctx.saved_tensors
        plan: LinearPlan = ctx.plan
        saved = Fp8Tensor(data, scale_inv, ctx.fmt)
        g2 = g.reshape(-1, g.shape[-1])
        fp8_wgrad = plan.recipe.fp8_wgrad and ctx.needs_input_grad[1]
        gq, gt = plan.quantize(g2, 2, plan.g_group, fp8_wgrad)
        grad_x = handle = None
        if ctx.needs_input_grad[0]:
            transposed = ctx.cast.transposed
            assert transposed is not None, "the weight was cast without its transpose, but backward runs"
            dx = scaled_mm(gq, transposed, g.dtype)
            if plan.gather is not None:  # the input was gathered: its gradient is reduce-scattered back
                dx, handle = _comm.reduce_scatter_start(dx, plan.gather)
            grad_x = dx.view(ctx.x_shape)
        grad_w = None
        if ctx.needs_input_grad[1]:
            owner = wgrad_owner(ctx, g2)  # the parameter when the gradient goes into its main_grad
            if fp8_wgrad:
                grad_w = fp8_weight_grad(gt, saved, owner, plan.fuse, ctx.w_dtype)
            else:  # bf16 GEMM of the exact output gradient and the FP8 input, dequantised
                grad_w = weight_grad(owner, g2, saved.dequantize(g2.dtype), plan.fuse)
        if handle is not None:
            handle.wait()
        return grad_x, grad_w, None, None, None


def fp8_weight_grad(
    gt: Fp8Tensor, xt: Fp8Tensor, owner: torch.Tensor | None, fuse: bool, dtype: torch.dtype
) -> torch.Tensor:
    """The weight gradient ``gᵀ x`` as an FP8 GEMM of the output gradient's transpose ``gt`` ``[out, T]`` and the
    input's ``xt`` ``[in, T]`` (``T`` padded to the GEMMs' alignment): added into ``owner.main_grad`` with ``fuse``
    (``owner``: the parameter; a placeholder returned), else returned in ``dtype``."""
    dw = scaled_mm(_pad_k(gt), _pad_k(xt), torch.float32)
    if fuse:
        assert owner is not None, "a fused weight gradient needs its parameter"
        return _add_weight_grad(owner, dw)
    return dw.to(dtype)


def _add_weight_grad(weight: torch.Tensor, dw: torch.Tensor) -> torch.Tensor:
    """A float32 weight gradient added into ``weight.main_grad``; an empty placeholder returned, as
    :func:`~mcore_parallel.tensor.wgrad.weight_grad` does, so autograd's accumulation hooks still run."""
    weight.main_grad.add_(dw)  # type: ignore[attr-defined]
    weight.grad_added_to_main_grad = True  # type: ignore[attr-defined]
    return torch.empty_like(weight)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, cast: WeightCast, plan: LinearPlan) -> torch.Tensor:
    """``x Wᵀ`` (no bias) through the FP8 GEMMs; ``weight`` is the parameter (its gradient), ``cast`` its FP8 form."""
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return _Fp8Linear.apply(x, weight, cast, plan, grad)
