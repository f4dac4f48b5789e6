"""The FP8 MLP with its SwiGLU and FP8 casts fused (``model.fp8_fused_swiglu``).

In an FP8 MLP, ``fc2(swiglu(fc1(x)))``, two tensors are written in bf16 only to be read back by a cast:

- forward: the SwiGLU output ``a`` ``[T, ffn]``, fc2's input, which fc2 casts to E4M3 (``a`` and ``aᵀ``, the weight
  gradient's operand);
- backward: the SwiGLU input gradient ``dh`` ``[T, 2·ffn]``, fc1's output gradient, which fc1 casts to E5M2 (``dh``
  and ``dhᵀ``); for ``llama-1b`` at 32 k tokens a micro-batch that is a 1 GiB bf16 tensor per layer, written once
  and read once more by the cast.

With delayed scaling the scale of each is known before the tensor exists (it comes from earlier steps), so the
SwiGLU kernels can write the FP8 bytes themselves: :func:`swiglu_quantize` computes ``a`` and writes ``a`` and
``aᵀ`` in E4M3, :func:`swiglu_backward_quantize` computes ``dh`` and writes ``dh`` and ``dhᵀ`` in the gradient
format. Each folds its tensor's absolute maximum into the step's delayed-scaling record in the same pass. The
values are rounded as the unfused path rounds them: to the activation dtype first (as the bf16 tensor was stored),
then to FP8 by the same rounding as :func:`~mcore_parallel.fp8.cast_triton.cast_triton`.

:func:`fp8_swiglu_mlp` runs the MLP through them (one autograd function for fc1's GEMMs, the kernels and fc2's
GEMMs; the tensor-parallel collectives around it as in the FP8 linears) when it can: both linears run FP8 with
delayed scaling and a history, no biases, the FP8 weight gradient, the kernels' device (CUDA with Triton, or the
CPU under ``TRITON_INTERPRET=1``). Otherwise, e.g. in the first step (no history yet), it runs the unfused layers.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from mcore_parallel.fp8 import Fp8Tensor, LinearPlan, WeightCast, cast_triton, fp8_weight_grad, scaled_mm
from mcore_parallel.fp8.recipe import Fp8Format
from mcore_parallel.tensor.mappings import (
    copy_to_tp_region,
    gather_from_sp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
)

if TYPE_CHECKING:
    from mcore_parallel.fp8 import Fp8ColumnParallelLinear, Fp8RowParallelLinear

__all__ = ["swiglu_quantize", "swiglu_backward_quantize", "fp8_swiglu_mlp", "fusion_problem"]

FWD_TILE = (32, 256, 8)
"""(rows, columns of the activation, warps) per program of the forward cast (``swiglu_cast``);
``bench/fp8_linear_bench.py --tune-swiglu`` times others."""
BWD_TILE = (64, 64, 8)
"""(rows, columns of each half, warps) per program of the backward cast (``swiglu_bwd_cast``)."""
TILES = [
    (64, 64, 8),
    (64, 128, 8),
    (64, 128, 16),
    (32, 128, 4),
    (32, 256, 8),
    (128, 64, 8),
    (128, 128, 16),
    (64, 256, 16),
]
"""The tiles ``bench/fp8_linear_bench.py --tune-swiglu`` times for both casts (each tested against the reference)."""
_KERNELS: dict[str, Any] = {}
_quantize: Any = None  # cast_triton's helpers (installed here: Triton looks a kernel's callees up among its globals)
_abs_nan_inf: Any = None
_tile_amax: Any = None
_gate_up: Any = None  # this module's own helpers (set when the kernels are made)
_store: Any = None


def _define_helpers() -> None:
    """This module's Triton helpers, set as module globals: the kernels (defined in another function) then call them
    as globals, not as variables of an enclosing function, which inductor would not emit with a kernel it launches
    from a compiled graph."""
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[misc]
    def _gate_up(H, rows, ffn, h_row, BM: tl.constexpr, BN: tl.constexpr):  # type: ignore[no-untyped-def]
        """This program's rows ``rm`` and columns ``rn`` of the ``[rows, ffn]`` outputs, their mask, and the gate and
        up halves of ``h`` there (float32)."""
        rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
        rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
        mask = (rm[:, None] < rows) & (rn[None, :] < ffn)
        gate = tl.load(H + rm[:, None] * h_row + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(H + rm[:, None] * h_row + ffn + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        return rm, rn, mask, gate, up

    @triton.jit  # type: ignore[misc]
    def _store(Q, QT, q, rm, rn, mask, rows, col0, width, TRANSPOSE: tl.constexpr):  # type: ignore[no-untyped-def]
        """The FP8 tile ``q`` at columns ``col0 + rn`` of ``Q`` ``[rows, width]`` and, with ``TRANSPOSE``, at rows
        ``col0 + rn`` of ``QT`` ``[width, rows]``."""
        tl.store(Q + rm[:, None] * width + col0 + rn[None, :], q, mask=mask)
        if TRANSPOSE:
            tl.store(QT + (col0 + rn)[:, None] * rows + rm[None, :], tl.trans(q), mask=tl.trans(mask))

    globals().update(_gate_up=_gate_up, _store=_store)


def _kernels() -> dict[str, Any]:
    if _KERNELS:
        return _KERNELS
    import triton
    import triton.language as tl

    cast_triton.install(globals())
    _define_helpers()

    @triton.jit  # type: ignore[misc]
    def swiglu_cast(H, SCALE, Q, QT, AMAX, rows, ffn, h_row, fmax,  # type: ignore[no-untyped-def]
                    EMIN: tl.constexpr, MBITS: tl.constexpr, NATIVE: tl.constexpr, TRANSPOSE: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
        rm, rn, mask, gate, up = _gate_up(H, rows, ffn, h_row, BM, BN)
        a = (gate * tl.sigmoid(gate) * up).to(H.dtype.element_ty).to(tl.float32)  # as the activation is stored
        tl.atomic_max(AMAX, _tile_amax(_abs_nan_inf(a)))
        q = _quantize(a, tl.load(SCALE), fmax, Q.dtype.element_ty, EMIN, MBITS, NATIVE)
        _store(Q, QT, q, rm, rn, mask, rows, 0, ffn, TRANSPOSE)

    @triton.jit  # type: ignore[misc]
    def swiglu_bwd_cast(H, G, SCALE, Q, QT, AMAX, rows, ffn, h_row, g_row, fmax,  # type: ignore[no-untyped-def]
                        EMIN: tl.constexpr, MBITS: tl.constexpr, NATIVE: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr):  # fmt: skip
        rm, rn, mask, gate, up = _gate_up(H, rows, ffn, h_row, BM, BN)
        g = tl.load(G + rm[:, None] * g_row + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        d_gate = (g * up * sig * (1.0 + gate * (1.0 - sig))).to(H.dtype.element_ty).to(tl.float32)
        d_up = (g * gate * sig).to(H.dtype.element_ty).to(tl.float32)
        tl.atomic_max(AMAX, _tile_amax(tl.maximum(_abs_nan_inf(d_gate), _abs_nan_inf(d_up))))  # one reduction
        s = tl.load(SCALE)
        qg = _quantize(d_gate, s, fmax, Q.dtype.element_ty, EMIN, MBITS, NATIVE)
        qu = _quantize(d_up, s, fmax, Q.dtype.element_ty, EMIN, MBITS, NATIVE)
        _store(Q, QT, qg, rm, rn, mask, rows, 0, 2 * ffn, True)
        _store(Q, QT, qu, rm, rn, mask, rows, ffn, 2 * ffn, True)

    _KERNELS.update(swiglu_cast=swiglu_cast, swiglu_bwd_cast=swiglu_bwd_cast)
    return _KERNELS


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def swiglu_quantize(
    h: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, amax: torch.Tensor, transpose: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``a = silu(gate) * up`` of ``h = [gate; up]`` (last dimension, ``[..., 2·ffn]``), rounded to ``h``'s dtype,
    then scaled by ``scale`` (0-d float32) and cast to ``fmt``: ``(a [T, ffn], aᵀ [ffn, T] or None)``, FP8,
    contiguous. ``amax`` (one float32 element) becomes ``max(amax, max |a|)``."""
    h2 = _rows(h)
    rows, ffn = h2.shape[0], h2.shape[1] // 2
    q = torch.empty(rows, ffn, dtype=fmt.dtype, device=h.device)
    qt = torch.empty(ffn, rows, dtype=fmt.dtype, device=h.device) if transpose else None
    if rows and ffn:
        bm, bn, warps = FWD_TILE
        grid = (-(-rows // bm), -(-ffn // bn))
        _kernels()["swiglu_cast"][grid](h2, scale.reshape(1).to(torch.float32), q, q if qt is None else qt, amax, rows,
                                        ffn, h2.stride(0), float(fmt.max), TRANSPOSE=transpose, BM=bm, BN=bn,
                                        num_warps=warps, **cast_triton.quantize_args(fmt.dtype, h.dtype))  # fmt: skip
    return q, qt


def swiglu_backward_quantize(
    h: torch.Tensor, grad: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, amax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The input gradient ``dh = [d_gate; d_up]`` of ``silu(gate) * up`` for ``h = [gate; up]`` and the output
    gradient ``grad`` (``[..., ffn]``), rounded to ``h``'s dtype, scaled by ``scale`` and cast to ``fmt``:
    ``(dh [T, 2·ffn], dhᵀ [2·ffn, T])``, FP8, contiguous. ``amax`` becomes ``max(amax, max |dh|)``."""
    h2, g2 = _rows(h), _rows(grad)
    rows, ffn = h2.shape[0], h2.shape[1] // 2
    if g2.shape != (rows, ffn):
        raise ValueError(f"swiglu_backward_quantize: grad {tuple(grad.shape)} does not match h {tuple(h.shape)}")
    q = torch.empty(rows, 2 * ffn, dtype=fmt.dtype, device=h.device)
    qt = torch.empty(2 * ffn, rows, dtype=fmt.dtype, device=h.device)
    if rows and ffn:
        bm, bn, warps = BWD_TILE
        grid = (-(-rows // bm), -(-ffn // bn))
        _kernels()["swiglu_bwd_cast"][grid](h2, g2, scale.reshape(1).to(torch.float32), q, qt, amax, rows, ffn,
                                            h2.stride(0), g2.stride(0), float(fmt.max), BM=bm, BN=bn,
                                            num_warps=warps, **cast_triton.quantize_args(fmt.dtype, h.dtype))  # fmt: skip
    return q, qt


class _Fp8SwiGLUMLP(torch.autograd.Function):
    """``fc2(swiglu(fc1(x)))`` with FP8 GEMMs and the fused SwiGLU casts (module docstring); no biases."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, cast1: WeightCast,  # type: ignore[override]
                cast2: WeightCast, plan1: LinearPlan, plan2: LinearPlan, grad: bool) -> torch.Tensor:  # fmt: skip
        s1, s2 = plan1.state, plan2.state
        assert s1 is not None and s2 is not None, "the fused FP8 MLP runs with delayed scaling only"
        x2 = x.reshape(-1, x.shape[-1])
        xq, xt = plan1.quantize(x2, 0, plan1.x_group, grad)
        h = scaled_mm(xq, cast1.weight, x.dtype, fast_accum=True)
        fmt = s2.formats[0]
        scale, inv, amax = s2.kernel_scale(0)
        aq, at = swiglu_quantize(h, scale, fmt, amax, transpose=grad)
        y = scaled_mm(Fp8Tensor(aq, inv, fmt), cast2.weight, x.dtype, fast_accum=True)
        if grad:
            assert xt is not None and at is not None
            ctx.save_for_backward(xt.data, xt.scale_inv, h, at, inv)
            ctx.x_fmt, ctx.a_fmt = xt.fmt, fmt
            ctx.cast1, ctx.cast2, ctx.plan1, ctx.plan2 = cast1, cast2, plan1, plan2
            ctx.x_shape, ctx.dtypes = x.shape, (w1.dtype, w2.dtype)
            ctx.owner1, ctx.owner2 = (w1 if plan1.fuse else None), (w2 if plan2.fuse else None)
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xt_data, x_inv, h, at_data, a_inv = ctx.saved_tensors
        plan1, plan2 = ctx.plan1, ctx.plan2
        s1 = plan1.state
        g2 = g.reshape(-1, g.shape[-1])
        gq, gt = plan2.quantize(g2, 2, plan2.g_group, True)
        transposed2 = ctx.cast2.transposed
        assert transposed2 is not None, "the weight was cast without its transpose, but backward runs"
        da = scaled_mm(gq, transposed2, g.dtype)
        grad_w2 = None
        if ctx.needs_input_grad[2]:
            grad_w2 = fp8_weight_grad(gt, Fp8Tensor(at_data, a_inv, ctx.a_fmt), ctx.owner2, plan2.fuse, ctx.dtypes[1])
        fmt = s1.formats[2]
        scale, inv, amax = s1.kernel_scale(2)
        dhq, dht = swiglu_backward_quantize(h, da, scale, fmt, amax)
        grad_x = None
        if ctx.needs_input_grad[0]:
            transposed1 = ctx.cast1.transposed
            assert transposed1 is not None, "the weight was cast without its transpose, but backward runs"
            grad_x = scaled_mm(Fp8Tensor(dhq, inv, fmt), transposed1, g.dtype).view(ctx.x_shape)
        grad_w1 = None
        if ctx.needs_input_grad[1]:
            grad_w1 = fp8_weight_grad(Fp8Tensor(dht, inv, fmt), Fp8Tensor(xt_data, x_inv, ctx.x_fmt), ctx.owner1,
                                      plan1.fuse, ctx.dtypes[0])  # fmt: skip
        return grad_x, grad_w1, grad_w2, None, None, None, None, None


def fusion_problem(fc1: Any, fc2: Any) -> str | None:
    """Why ``fc1``/``fc2`` (an MLP's linears) cannot take the fused path at all (None when they can, given a
    delayed-scaling history at run time)."""
    from mcore_parallel.fp8 import Fp8ColumnParallelLinear, Fp8RowParallelLinear

    if not (isinstance(fc1, Fp8ColumnParallelLinear) and isinstance(fc2, Fp8RowParallelLinear)):
        return "fc1 and fc2 must both be FP8 linears (fp8_modules with fc1 and fc2, a layer not kept in bf16)"
    if not (fc1.runs_fp8 and fc2.runs_fp8):
        return f"a linear runs in bf16: {fc1.fp8_reason or fc2.fp8_reason}"
    r = fc1.recipe
    if not r.delayed or fc2.recipe != r:
        return "fp8_recipe must be delayed (the casts' scales must be known before the SwiGLU kernels run)"
    if not r.fp8_wgrad:
        return "fp8_wgrad must be true (the fused kernels write the FP8 transposes the weight gradients use)"
    if r.allgather and fc1.sequence_parallel:
        return "fp8_allgather casts fc1's input before the all-gather; the fused path gathers bf16"
    if fc1.bias is not None or fc2.bias is not None:
        return "the MLP's linears have biases (add_bias_linear); the fused path has none"
    if fc1.gather_output or not fc2.input_is_parallel:
        return "fc1 must keep its output split over tensor-parallel ranks and fc2 take it so"
    return None


def _kernels_run_on(t: torch.Tensor) -> bool:
    if not cast_triton.available():
        return False
    return t.is_cuda or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


@torch.compiler.disable
def fp8_swiglu_mlp(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    """``fc2(act(fc1(x)))`` of ``mlp`` (an :class:`~mcore_models.transformer.mlp.MLP` whose linears passed
    :func:`fusion_problem`): fused when both delayed-scaling states hold a history and the kernels run on ``x``'s
    device (counted in ``mlp.fp8_fused_calls``), else the unfused layers. Eager (a graph break in compiled layers,
    like the FP8 linears)."""
    fc1: Fp8ColumnParallelLinear = mlp.linear_fc1
    fc2: Fp8RowParallelLinear = mlp.linear_fc2
    s1, s2 = fc1.fp8_scaling, fc2.fp8_scaling
    if s1 is None or s2 is None or not (s1.ready() and s2.ready() and _kernels_run_on(x)):
        return fc2(mlp.act(fc1(x)))  # type: ignore[no-any-return]
    mlp.fp8_fused_calls += 1
    tp = fc1.tp
    if fc1.sequence_parallel:
        x = gather_from_sp_region(x, tp, tensor_parallel_output_grad=True)
    else:
        x = copy_to_tp_region(x, tp)
    w1, w2 = fc1.weight, fc2.weight
    assert w1 is not None  # an FP8 column-parallel linear owns its weight
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or w1.requires_grad or w2.requires_grad)
    # fc1's output gradient is split over tp (column parallel), fc2's input too (row parallel); with delayed scaling
    # the groups matter only to the casts before a history exists, which do not happen here
    plan1, plan2 = fc1._plan(None, tp, None), fc2._plan(tp, None, None)
    y = _Fp8SwiGLUMLP.apply(x, w1, w2, fc1.weight_cast(needs_grad), fc2.weight_cast(needs_grad),
                            plan1, plan2, needs_grad)  # fmt: skip
    return reduce_scatter_to_sp_region(y, tp) if fc2.sequence_parallel else reduce_from_tp_region(y, tp)
