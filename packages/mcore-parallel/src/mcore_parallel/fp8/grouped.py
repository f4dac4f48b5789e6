"""FP8 grouped GEMMs for routed experts: ``x Wₑᵀ`` for the rows of each expert ``e`` in one call.

PyTorch's FP8 grouped GEMM, ``torch._scaled_grouped_mm`` (CUDA, compute capability 9.0+), takes E4M3 operands with
rowwise scales: the rows ``[M, K]`` (row-major, one scale per row) and the experts' weights ``[E, N, K]`` passed as
``[E, K, N]`` column-major (one scale per expert and output feature), the rows grouped by expert through the
cumulative row counts ``offs``. :class:`_Fp8GroupedLinear` runs an expert layer's two products through it:

| product | first operand (rowwise scales) | second operand (rowwise scales) |
|---|---|---|
| forward ``y = x Wₑᵀ`` | ``x`` ``[M, K]`` (per row) | ``W`` ``[E, N, K]`` (per expert and output feature) |
| input gradient ``dx = g Wₑ`` | ``g`` ``[M, N]`` (per row) | ``Wᵀ`` ``[E, K, N]`` (per expert and input feature) |

The weight gradient ``dWₑ = gₑᵀ xₑ`` contracts over each expert's rows, a dimension rowwise scales cannot run along:
it is a bf16 grouped GEMM of the exact output gradient and the saved FP8 input dequantised (as the dense rowwise
recipe does, :mod:`mcore_parallel.fp8.gemm`). The weight's casts are made once an optimizer step
(:class:`GroupedWeightCasts`). Every operand is E4M3 whatever the dense layers' recipe (the grouped
GEMM takes no E5M2), scaled by its own rows' maxima (current scaling); widths must be multiples of 16.

With the expert weights split over expert-tensor-parallel ranks (``k_group``: fc2's input features; ``n_group``:
fc1's output features), the rowwise maxima along the split dimension are reduced over that group, so the ranks
quantise like one process. On the CPU the same quantised products run as float32 matmuls, one per expert (tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mcore_parallel.autograd import as_dtype
from mcore_parallel.fp8.gemm import GEMM_ALIGNMENT
from mcore_parallel.fp8.recipe import E4M3
from mcore_parallel.fp8.scaling import Fp8Tensor, current_scale, quantize
from mcore_parallel.state import Group

__all__ = [
    "GroupedPlan",
    "fp8_grouped_linear",
    "scaled_grouped_mm",
    "grouped_fp8_problem",
    "grouped_fp8_device_problem",
]


@dataclass(frozen=True)
class GroupedPlan:
    """The groups the rowwise maxima of one expert layer are reduced over (see the module docstring), and the
    recipe's margin."""

    k_group: Group | None = None
    n_group: Group | None = None
    margin: int = 0


def grouped_fp8_problem(k: int, n: int) -> str | None:
    """Why expert weights of ``[E, n, k]`` cannot run FP8 grouped GEMMs (None when they can)."""
    bad = [f"{what}={v}" for what, v in (("in", k), ("out", n)) if v % GEMM_ALIGNMENT]
    if bad:
        return f"expert weights with {', '.join(bad)} per rank: FP8 grouped GEMMs need multiples of {GEMM_ALIGNMENT}"
    return None


def grouped_fp8_device_problem(device: torch.device | str | None) -> str | None:
    """Why FP8 grouped GEMMs cannot run on ``device`` (None when they can): CUDA needs compute capability 9.0 or
    newer (Hopper, Blackwell) and a PyTorch with ``torch._scaled_grouped_mm``; the CPU runs the products one expert
    at a time (tests)."""
    dev = torch.device(device if device is not None else "cpu")
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        return f"FP8 grouped GEMMs run on CUDA GPUs (and the CPU), not on {dev.type}"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"this PyTorch ({torch.__version__}) has no torch._scaled_grouped_mm"
    major, minor = torch.cuda.get_device_capability(dev)
    if major < 9:
        return (f"{torch.cuda.get_device_name(dev)} has compute capability {major}.{minor}; FP8 grouped GEMMs need "
                "9.0 or newer (H100/H200, B200)")  # fmt: skip
    return None


def _rowwise(t: torch.Tensor, group: Group | None, margin: int) -> Fp8Tensor:
    return quantize(t, E4M3, current_scale(t, E4M3, True, margin, group))


def scaled_grouped_mm(
    a: Fp8Tensor, b: Fp8Tensor, offs: torch.Tensor, experts: int, out_dtype: torch.dtype, fast_accum: bool = False
) -> Any:
    """``[M, N]``: the rows of ``a`` (``[M, K]``, rowwise E4M3) ending at ``offs[e]`` (int32, cumulative) times
    expert ``e``'s rows of ``b`` (``[E * N, K]``, rowwise E4M3: expert ``e`` holds rows ``e N .. (e + 1) N``)
    transposed, in ``out_dtype``; ``fast_accum``: Hopper's fast accumulation (the forward's, as the dense FP8
    linears; not the gradient's)."""
    m, k = a.data.shape
    n = b.data.shape[0] // experts
    if b.data.shape != (experts * n, k) or offs.shape != (experts,):
        raise ValueError(f"scaled_grouped_mm: a [M, K], b [E*N, K], offs [E] expected, got {tuple(a.data.shape)}, "
                         f"{tuple(b.data.shape)}, {tuple(offs.shape)} for E={experts}")  # fmt: skip
    problem = grouped_fp8_problem(k, n)
    if problem is not None:
        raise ValueError(f"scaled_grouped_mm: {problem}")
    if not (a.rowwise and b.rowwise and a.fmt is E4M3 and b.fmt is E4M3):
        raise ValueError("scaled_grouped_mm: both operands E4M3 with rowwise scales")
    if a.data.is_cuda:
        return torch._scaled_grouped_mm(a.data, b.data.view(experts, n, k).transpose(-2, -1),
                                        a.scale_inv.reshape(-1), b.scale_inv.reshape(experts, n), offs=offs,
                                        out_dtype=out_dtype, use_fast_accum=fast_accum)  # fmt: skip
    ad, bd = a.dequantize(torch.float32), b.dequantize(torch.float32).view(experts, n, k)
    out = torch.empty(m, n, dtype=torch.float32, device=ad.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = ad[start:end] @ bd[e].t()
        start = end
    if start != m:
        raise ValueError(f"scaled_grouped_mm: the expert row counts add up to {start}, not the {m} rows")
    return as_dtype(out, out_dtype)


def _weight_grad(g: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, experts: int) -> torch.Tensor:
    """``[E, N, K]``: ``gₑᵀ xₑ`` for each expert's rows (``g`` ``[M, N]``, ``x`` ``[M, K]``, one dtype)."""
    if g.is_cuda and g.dtype in (torch.bfloat16, torch.float16):
        return torch._grouped_mm(g.t(), x, offs=offs)  # two 2-D operands: grouped along the contraction
    out = g.new_zeros(experts, g.shape[1], x.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[e] = g[start:end].t() @ x[start:end]
        start = end
    return out


class GroupedWeightCasts:
    """The FP8 casts of one expert weight ``[E, N, K]``: rowwise over ``K`` (the forward's operand) and, of its
    transpose, over ``N`` (the input gradient's). Inside an optimizer step (:func:`~mcore_parallel.fp8.fp8_step`
    calls :meth:`begin_weight_cache` / :meth:`end_weight_cache`) each is made once and reused by the step's
    micro-batches and backward passes, as the dense FP8 linears' casts are; outside, every call casts afresh."""

    def __init__(self) -> None:
        self._caching = False
        self._cache: list[Fp8Tensor | None] = [None, None]
        self.casts = 0
        """How many casts were made (diagnostics, tests)."""

    def begin_weight_cache(self) -> None:
        self._caching, self._cache = True, [None, None]

    def end_weight_cache(self) -> None:
        self._caching, self._cache = False, [None, None]

    def get(self, w: torch.Tensor, plan: GroupedPlan, transposed: bool) -> Fp8Tensor:
        """``w`` rowwise in E4M3 (``transposed``: ``wᵀ`` per expert, ``[E * K, N]``), else ``[E * N, K]``."""
        cached = self._cache[transposed]
        if cached is not None:
            return cached
        e, n, k = w.shape
        w = w.detach()
        if transposed:
            q = _rowwise(w.transpose(1, 2).reshape(e * k, n), plan.n_group, plan.margin)
        else:
            q = _rowwise(w.reshape(e * n, k), plan.k_group, plan.margin)
        self.casts += 1
        if self._caching:
            self._cache[transposed] = q
        return q


class _Fp8GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, plan: GroupedPlan,  # type: ignore[override]
                casts: GroupedWeightCasts, grad: bool) -> torch.Tensor:  # fmt: skip
        e = w.shape[0]
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        xq = _rowwise(x.contiguous(), plan.k_group, plan.margin)
        y = scaled_grouped_mm(xq, casts.get(w, plan, False), offs, e, x.dtype, fast_accum=True)
        if grad:
            ctx.save_for_backward(xq.data, xq.scale_inv, w, offs)
            ctx.plan, ctx.casts = plan, casts
        return y  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_data, x_inv, w, offs = ctx.saved_tensors
        plan: GroupedPlan = ctx.plan
        e = w.shape[0]
        g = g.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gq = _rowwise(g, plan.n_group, plan.margin)
            grad_x = scaled_grouped_mm(gq, ctx.casts.get(w, plan, True), offs, e, g.dtype)
        if ctx.needs_input_grad[1]:
            x = Fp8Tensor(x_data, x_inv, E4M3).dequantize(g.dtype)
            grad_w = _weight_grad(g, x, offs, e).to(w.dtype)
        return grad_x, grad_w, None, None, None, None


def fp8_grouped_linear(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, plan: GroupedPlan, casts: GroupedWeightCasts | None = None
) -> torch.Tensor:
    """``[M, N]``: rows ``x`` ``[M, K]`` grouped by expert (``counts`` ``[E]`` rows each, on ``x``'s device) times
    their expert's ``w[e]`` ``[N, K]`` transposed, through FP8 grouped GEMMs (see the module docstring); ``casts``:
    the weight's cast cache (None: cast at this call)."""
    grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
    return _Fp8GroupedLinear.apply(x, w, counts, plan, casts or GroupedWeightCasts(), grad)  # type: ignore[no-any-return]
