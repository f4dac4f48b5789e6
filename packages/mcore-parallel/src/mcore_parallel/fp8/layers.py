"""FP8 column- and row-parallel linears: :class:`~mcore_parallel.tensor.ColumnParallelLinear` and
:class:`~mcore_parallel.tensor.RowParallelLinear` whose GEMMs run in FP8 (:mod:`mcore_parallel.fp8.gemm`).

They are the same modules with the same parameters (``weight``, ``bias``, the same initialisation, TP attributes and
names), so a checkpoint of one loads into the other; the master weights stay in their dtype (fp32 in the optimizer).
What they add:

- the weight's FP8 cast (and its transpose, the input gradient's operand), made at the first forward of an
  optimizer step and reused by the step's other micro-batches inside :func:`~mcore_parallel.fp8.fp8_step`; outside
  it every forward casts afresh, so a weight changed between two calls is never used stale;
- with ``recipe.scaling == "delayed"``, a :class:`~mcore_parallel.fp8.scaling.DelayedScaling` child
  ``fp8_scaling`` whose buffers (amax histories, scales) are saved with the model;
- tensor parallelism: absolute maxima are reduced over the tensor-parallel group wherever a tensor's elements are
  split over it (a row-parallel layer's input, a column-parallel layer's output gradient, both weights), so every
  rank scales like one process holding the whole tensor; under sequence parallelism the input is all-gathered in
  bf16 and cast after (default), or cast first and gathered as FP8 bytes (``recipe.allgather``).

A layer whose dimensions are not multiples of 16 (the FP8 GEMMs' rule) runs in bf16, with the reason logged and kept
in ``fp8_reason``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from mcore_parallel.fp8.gemm import GEMM_ALIGNMENT, LinearPlan, WeightCast, fp8_linear
from mcore_parallel.fp8.recipe import E4M3, Fp8Recipe
from mcore_parallel.fp8.scaling import DelayedScaling, current_scale, quantize, quantize_with_transpose
from mcore_parallel.state import Group
from mcore_parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from mcore_parallel.tensor.mappings import (
    copy_to_tp_region,
    gather_from_sp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
    scatter_to_tp_region,
)
from mcore_parallel.tensor.wgrad import fuses_wgrad

__all__ = ["Fp8Linear", "Fp8ColumnParallelLinear", "Fp8RowParallelLinear"]

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()


def _fallback_reason(kind: str, k: int, n: int) -> str | None:
    bad = [f"{what}={v}" for what, v in (("in", k), ("out", n)) if v % GEMM_ALIGNMENT]
    if not bad:
        return None
    return (f"{kind} with {', '.join(bad)} per rank: the FP8 GEMMs need both widths to be multiples of "
            f"{GEMM_ALIGNMENT}, so this layer runs in bf16")  # fmt: skip


class Fp8Linear:
    """What the two FP8 linears share: the recipe, the weight cast and its cache, the delayed-scaling state."""

    recipe: Fp8Recipe
    fp8_reason: str | None
    """Why this layer runs in bf16 (None: it runs in FP8)."""
    fp8_scaling: DelayedScaling | None
    weight_casts: int
    """How many times the weight was cast to FP8 (diagnostics, tests)."""
    weight: Any  # the layer's parameter (a column-parallel layer built with its own weight)
    tp: Group
    training: bool

    def _setup_fp8(self, recipe: Fp8Recipe, kind: str, k: int, n: int, k_split: bool, n_split: bool) -> None:
        self.recipe, self._k_split, self._n_split = recipe, k_split, n_split
        self.fp8_reason = _fallback_reason(kind, k, n)
        if self.fp8_reason is not None and self.fp8_reason not in _WARNED:
            _WARNED.add(self.fp8_reason)
            logger.warning("FP8 off for a layer: %s", self.fp8_reason)
        self.fp8_scaling = None
        if recipe.delayed and self.fp8_reason is None:
            formats = (E4M3, E4M3, recipe.backward_format)
            self.fp8_scaling = DelayedScaling(recipe.amax_history_len, recipe.amax_compute_algo, recipe.margin,
                                              formats, self.weight.device)  # fmt: skip
        self._fp8_caching = False
        self._fp8_cache: WeightCast | None = None
        self.weight_casts = 0

    @property
    def runs_fp8(self) -> bool:
        return self.fp8_reason is None

    # ---------------------------------------------------------------------------------------- the weight cast
    def begin_weight_cache(self) -> None:
        """From now on the weight's first cast is kept and reused (the weight must not change until
        :meth:`end_weight_cache`: one optimizer step's forward and backward passes)."""
        self._fp8_caching, self._fp8_cache = True, None

    def end_weight_cache(self) -> None:
        self._fp8_caching, self._fp8_cache = False, None

    def weight_cast(self, transposed: bool) -> WeightCast:
        """The weight in FP8 (with its transpose when ``transposed``): the cached cast inside a step, else a new
        one."""
        cached = self._fp8_cache
        if cached is not None and (cached.transposed is not None or not transposed):
            return cached
        cast = self._cast_weight(transposed)
        self.weight_casts += 1
        if self._fp8_caching:
            self._fp8_cache = cast
        return cast

    def _cast_weight(self, transposed: bool) -> WeightCast:
        w = self.weight.detach()
        r = self.recipe
        tp = self.tp if self.tp.size > 1 else None
        if r.rowwise:  # per output row for the forward, per input column (rows of Wᵀ) for the input gradient
            fwd = quantize(w, E4M3, current_scale(w, E4M3, True, r.margin, tp if self._k_split else None))
            if not transposed:
                return WeightCast(fwd, None)
            wt = w.t().contiguous()
            return WeightCast(fwd, quantize(wt, E4M3, current_scale(wt, E4M3, True, r.margin,
                                                                    tp if self._n_split else None)))  # fmt: skip
        if self.fp8_scaling is not None:
            return WeightCast(*self.fp8_scaling.quantize(1, w, tp, transposed))
        scale = current_scale(w, E4M3, False, r.margin, tp)
        if transposed:
            return WeightCast(*quantize_with_transpose(w, E4M3, scale))
        return WeightCast(quantize(w, E4M3, scale), None)

    def _plan(self, x_group: Group | None, g_group: Group | None, gather: Group | None) -> LinearPlan:
        fuse = self.training and fuses_wgrad(self.weight)
        return LinearPlan(self.recipe, x_group, g_group, gather, fuse, self.fp8_scaling)

    def _needs_grad(self, x: torch.Tensor) -> bool:
        return torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)

    def fp8_repr(self) -> str:
        return f"fp8={self.recipe.format}/{self.recipe.scaling}" if self.fp8_reason is None else "fp8=off (bf16)"


class Fp8ColumnParallelLinear(ColumnParallelLinear, Fp8Linear):
    """:class:`~mcore_parallel.tensor.ColumnParallelLinear` with FP8 GEMMs (same arguments, plus ``recipe``)."""

    def __init__(self, in_features: int, out_features: int, *, recipe: Fp8Recipe, **kwargs: Any) -> None:
        super().__init__(in_features, out_features, **kwargs)
        if self.weight is None:
            raise ValueError("Fp8ColumnParallelLinear needs its own weight (skip_weight_allocation is for a tied "
                             "output layer, which stays a ColumnParallelLinear)")  # fmt: skip
        self._setup_fp8(recipe, "ColumnParallelLinear", in_features, self.out_per_rank, False, self.tp.size > 1)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        if self.fp8_reason is not None or weight is not None:
            return super().forward(x, weight)
        return _column_forward(self, x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.fp8_repr()}"


@torch.compiler.disable
def _column_forward(layer: Fp8ColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """Eager (a graph break inside compiled layers, like the other linears' collectives): the cast cache and the
    collectives stay out of compiled graphs; on CUDA the casts run as compiled kernels of their own."""
    tp = layer.tp
    fp8_gather = layer.sequence_parallel and layer.recipe.allgather
    if layer.sequence_parallel and not fp8_gather:
        x = gather_from_sp_region(x, tp, tensor_parallel_output_grad=True)
    elif not layer.sequence_parallel:
        x = copy_to_tp_region(x, tp)
    # a rowwise scale covers a whole token row, which each rank holds entirely: only a tensorwise cast before the
    # gather needs the maximum over the group
    x_group = tp if fp8_gather and not layer.recipe.rowwise else None
    plan = layer._plan(x_group, tp, tp if fp8_gather else None)
    weight = layer.weight
    assert weight is not None  # checked when built
    y = fp8_linear(x, weight, layer.weight_cast(layer._needs_grad(x)), plan)
    if layer.bias is not None:
        y = y + layer.bias
    return gather_from_tp_region(y, tp) if layer.gather_output else y


class Fp8RowParallelLinear(RowParallelLinear, Fp8Linear):
    """:class:`~mcore_parallel.tensor.RowParallelLinear` with FP8 GEMMs (same arguments, plus ``recipe``)."""

    def __init__(self, in_features: int, out_features: int, *, recipe: Fp8Recipe, **kwargs: Any) -> None:
        super().__init__(in_features, out_features, **kwargs)
        self._setup_fp8(recipe, "RowParallelLinear", self.in_per_rank, out_features, self.tp.size > 1, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_reason is not None:
            return super().forward(x)
        return _row_forward(self, x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.fp8_repr()}"


@torch.compiler.disable
def _row_forward(layer: Fp8RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    tp = layer.tp
    if not layer.input_is_parallel:
        x = scatter_to_tp_region(x, tp)
    plan = layer._plan(tp, None, None)  # the input's features are split over tp; the output gradient is whole
    y = fp8_linear(x, layer.weight, layer.weight_cast(layer._needs_grad(x)), plan)
    y = reduce_scatter_to_sp_region(y, tp) if layer.sequence_parallel else reduce_from_tp_region(y, tp)
    return y if layer.bias is None else y + layer.bias
