"""FP8 formats and the recipe an FP8 linear follows.

Two OCP FP8 formats exist in PyTorch as dtypes: E4M3 (``float8_e4m3fn``: 3 mantissa bits, no infinities, largest
finite value 448) and E5M2 (``float8_e5m2``: 2 mantissa bits, largest finite value 57344). The published FP8 training
recipes (Micikevicius et al., "FP8 Formats for Deep Learning", 2022; Transformer Engine's ``Format.HYBRID``) use E4M3
for the forward pass (activations and weights: precision matters) and E5M2 for gradients (range matters):
``format="hybrid"``. ``format="e4m3"`` uses E4M3 everywhere.

Scaling (how a tensor is brought into the format's range before the cast):

- ``tensorwise``: one scale per tensor from the tensor's own absolute maximum ("current scaling");
- ``rowwise``: one scale per row along the contraction dimension (per token of an activation, per output feature of
  a weight): finer, so less error from outliers; every operand E4M3 (the rowwise-scaled GEMMs of ``torch._scaled_mm``
  take E4M3 operands only, so ``hybrid`` is refused) and the weight gradient in bf16;
- ``delayed``: one scale per tensor from the history of its absolute maxima over the last ``amax_history_len``
  optimizer steps (``max`` of the history, or its ``most_recent`` entry), as Transformer Engine's ``DelayedScaling``;
  the cast need not wait for this tensor's own maximum. Before any history exists a tensor is scaled by its own
  maximum.

``margin`` lowers every scale by ``2**margin`` (headroom against growth between steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_parallel.errors import ParallelConfigError

__all__ = ["Fp8Format", "E4M3", "E5M2", "FP8_FORMATS", "FP8_SCALINGS", "AMAX_ALGOS", "Fp8Recipe"]


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 format: its name, its torch dtype, its largest finite value and its unit roundoff (half the distance
    from 1 to the next value: the largest relative error of rounding a normal number to nearest)."""

    name: str
    dtype: torch.dtype
    max: float
    mantissa_bits: int
    min_normal: float

    @property
    def unit_roundoff(self) -> float:
        return 2.0 ** -(self.mantissa_bits + 1)

    @property
    def subnormal_spacing(self) -> float:
        """The distance between neighbouring values below ``min_normal`` (the rounding error there is at most half
        of it, absolute)."""
        return self.min_normal * 2.0**-self.mantissa_bits


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 3, 2.0**-6)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2, 2.0**-14)

FP8_FORMATS = ("e4m3", "hybrid")
"""``model.fp8``: E4M3 everywhere, or E4M3 forward and E5M2 gradients."""
FP8_SCALINGS = ("tensorwise", "rowwise", "delayed")
AMAX_ALGOS = ("max", "most_recent")


@dataclass(frozen=True)
class Fp8Recipe:
    """How an FP8 linear quantises its operands (see the module docstring)."""

    format: str = "hybrid"
    """e4m3 (every operand E4M3) or hybrid (E4M3 forward, E5M2 gradients)."""
    scaling: str = "tensorwise"
    """tensorwise, rowwise or delayed."""
    amax_history_len: int = 1024
    """Delayed scaling: optimizer steps of absolute maxima kept per tensor."""
    amax_compute_algo: str = "max"
    """Delayed scaling: the scale comes from the history's max, or from its most_recent entry."""
    margin: int = 0
    """Scales are lowered by 2**margin."""
    allgather: bool = False
    """Under sequence parallelism, cast a column-parallel layer's input to FP8 before the all-gather (half the bytes
    on the wire) instead of gathering bf16 and casting after."""
    wgrad: bool = True
    """Weight gradients in FP8 (tensorwise and delayed scaling); false: a bf16 GEMM of the output gradient and the
    saved FP8 input."""

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ParallelConfigError(problems, header="invalid FP8 recipe")

    def problems(self) -> list[str]:
        p = []
        if self.format not in FP8_FORMATS:
            p.append(f"fp8={self.format!r} is not one of {', '.join(FP8_FORMATS)}")
        if self.scaling not in FP8_SCALINGS:
            p.append(f"fp8_recipe={self.scaling!r} is not one of {', '.join(FP8_SCALINGS)}")
        if self.amax_compute_algo not in AMAX_ALGOS:
            p.append(f"fp8_amax_compute_algo={self.amax_compute_algo!r} is not one of {', '.join(AMAX_ALGOS)}")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            p.append(f"fp8_amax_history_len={self.amax_history_len!r} must be a positive integer")
        if not isinstance(self.margin, int) or self.margin < 0:
            p.append(f"fp8_margin={self.margin!r} must be a non-negative integer")
        if self.scaling == "rowwise" and self.format == "hybrid":
            p.append("fp8=hybrid with fp8_recipe=rowwise: torch._scaled_mm's rowwise-scaled GEMMs take E4M3 operands "
                     "only; set fp8=e4m3 (gradients in E4M3 too) or use fp8_recipe=tensorwise or delayed")  # fmt: skip
        return p

    @property
    def forward_format(self) -> Fp8Format:
        """Activations and weights."""
        return E4M3

    @property
    def backward_format(self) -> Fp8Format:
        """Gradients."""
        return E5M2 if self.format == "hybrid" else E4M3

    @property
    def rowwise(self) -> bool:
        return self.scaling == "rowwise"

    @property
    def delayed(self) -> bool:
        return self.scaling == "delayed"

    @property
    def fp8_wgrad(self) -> bool:
        """Whether the weight gradient is an FP8 GEMM (rowwise scaling keeps it in bf16: its scales would run along
        the token dimension, a second quantisation of both operands)."""
        return self.wgrad and not self.rowwise

    def describe(self) -> str:
        grads = self.backward_format.name.upper()
        text = f"{self.format} (E4M3 forward, {grads} gradients), {self.scaling} scaling"
        if self.delayed:
            text += f" (amax history {self.amax_history_len}, {self.amax_compute_algo})"
        if self.margin:
            text += f", margin {self.margin}"
        wgrad = "FP8" if self.fp8_wgrad else "bf16"
        return text + f", weight gradient {wgrad}, {'FP8' if self.allgather else 'bf16'} sequence all-gather"
