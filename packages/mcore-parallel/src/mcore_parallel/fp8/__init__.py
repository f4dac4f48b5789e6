"""FP8 training in pure PyTorch: scaled casts and ``torch._scaled_mm`` GEMMs for the tensor-parallel linears.

>>> import torch
>>> from mcore_parallel import Group
>>> from mcore_parallel.fp8 import Fp8ColumnParallelLinear, Fp8Recipe, fp8_step
>>> layer = Fp8ColumnParallelLinear(64, 32, tp=Group.single(), recipe=Fp8Recipe("hybrid"))
>>> with fp8_step([layer]):
...     y = layer(torch.randn(8, 2, 64))
>>> tuple(y.shape)
(8, 2, 32)

:mod:`~mcore_parallel.fp8.recipe` (formats, the recipe), :mod:`~mcore_parallel.fp8.scaling` (amax, scales, casts,
delayed scaling), :mod:`~mcore_parallel.fp8.gemm` (the three GEMMs and their autograd function),
:mod:`~mcore_parallel.fp8.layers` (the FP8 column/row-parallel linears), :mod:`~mcore_parallel.fp8.grouped` (FP8
grouped GEMMs for routed experts), :mod:`~mcore_parallel.fp8.step` (one
optimizer step: the weight-cast cache, the delayed-scaling update).
"""

from mcore_parallel.fp8.gemm import GEMM_ALIGNMENT, LinearPlan, WeightCast, fp8_linear, fp8_weight_grad, scaled_mm
from mcore_parallel.fp8.grouped import (
    GroupedPlan,
    GroupedWeightCasts,
    fp8_grouped_linear,
    grouped_fp8_device_problem,
    grouped_fp8_problem,
    scaled_grouped_mm,
)
from mcore_parallel.fp8.layers import Fp8ColumnParallelLinear, Fp8Linear, Fp8RowParallelLinear
from mcore_parallel.fp8.recipe import AMAX_ALGOS, E4M3, E5M2, FP8_FORMATS, FP8_SCALINGS, Fp8Format, Fp8Recipe
from mcore_parallel.fp8.scaling import DelayedScaling, Fp8Tensor, amax_of, current_scale, quantize, scale_from_amax
from mcore_parallel.fp8.step import fp8_device_problem, fp8_linears, fp8_step, roll_delayed_scaling

__all__ = [
    "Fp8Format",
    "E4M3",
    "E5M2",
    "FP8_FORMATS",
    "FP8_SCALINGS",
    "AMAX_ALGOS",
    "Fp8Recipe",
    "Fp8Tensor",
    "DelayedScaling",
    "amax_of",
    "scale_from_amax",
    "current_scale",
    "quantize",
    "scaled_mm",
    "WeightCast",
    "LinearPlan",
    "fp8_linear",
    "fp8_weight_grad",
    "GroupedPlan",
    "GroupedWeightCasts",
    "fp8_grouped_linear",
    "grouped_fp8_problem",
    "grouped_fp8_device_problem",
    "scaled_grouped_mm",
    "GEMM_ALIGNMENT",
    "Fp8Linear",
    "Fp8ColumnParallelLinear",
    "Fp8RowParallelLinear",
    "fp8_step",
    "fp8_linears",
    "roll_delayed_scaling",
    "fp8_device_problem",
]
