"""Routed experts as stacked weights computed with grouped GEMM.

``linear_fc1.weight`` is ``[E_local, fc1_out / etp, hidden]`` and ``linear_fc2.weight`` ``[E_local, hidden,
ffn / etp]``: this rank's experts (``E_local = E / ep``) and its expert-tensor-parallel share of each (fc1 split by
output rows, ``[gate; up]`` with stride 2 for SwiGLU as in the dense MLP; fc2 by input columns, so fc2's outputs are
partial sums over the expert-tensor-parallel ranks). Globally each is one array ``[E, out, in]``: the parameters carry
``expert_shard = (ep_rank, ep_size)`` and ``global_shape`` so checkpoints hold every expert in one place whatever the
layout. Every expert's initial weights are drawn from a seed of its own global index, so they do not depend on ep.

:func:`grouped_linear` is ``torch.nn.functional.grouped_mm`` on CUDA (one kernel for every expert, offsets on the
device) and a loop over the experts' row blocks elsewhere (the CPU reference path, any dtype). With ``experts`` in
``TransformerConfig.fp8_modules`` an FP8 layer's experts run FP8 grouped GEMMs instead
(:func:`mcore_parallel.fp8.fp8_grouped_linear`: E4M3 with rowwise scales, the weight gradient in bf16).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from mcore_models.config import TransformerConfig
from mcore_models.transformer.context import ModelContext
from mcore_models.transformer.mlp import activation_fn
from mcore_models.transformer.swiglu import swiglu
from mcore_parallel import Group
from mcore_parallel.fp8 import Fp8Recipe, GroupedPlan, GroupedWeightCasts, fp8_grouped_linear, grouped_fp8_problem
from mcore_parallel.tensor import init_sharded_, normal_init, scaled_normal_init

__all__ = ["GroupedExperts", "grouped_linear", "grouped_mm_applies"]

logger = logging.getLogger(__name__)

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_applies(w: torch.Tensor) -> bool:
    """Whether :func:`grouped_linear` runs expert weights ``w`` ``[E, out, in]`` through ``grouped_mm`` (CUDA,
    16-bit floats, both widths multiples of 8: rows of 16-byte multiples); otherwise it loops over the experts, which
    reads the row counts on the host (an engine cannot capture such a step in a CUDA graph)."""
    return (
        _grouped_mm is not None
        and w.is_cuda
        and w.dtype in (torch.bfloat16, torch.float16)
        and w.shape[1] % 8 == 0
        and w.shape[2] % 8 == 0
    )


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    return grouped_mm_applies(w) and x.dtype == w.dtype and x.is_cuda and x.shape[-1] == w.shape[2]


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[M, out]``: rows ``x`` ``[M, in]`` grouped by expert (``counts`` ``[E]`` rows each) times their expert's
    ``w[e]`` ``[out, in]`` transposed."""
    if _grouped_mm_ok(x, w):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return _grouped_mm(x, w.transpose(1, 2), offs=offs)  # type: ignore[misc]
    sizes = counts.tolist()
    if sum(sizes) != x.shape[0]:
        raise ValueError(f"expert row counts {sizes} do not add up to the {x.shape[0]} rows")
    parts = [xi @ w[e].t() for e, xi in enumerate(x.split(sizes))]
    return torch.cat(parts) if parts else x.new_zeros(0, w.shape[1])


def _mark(p: nn.Parameter, global_shape: tuple[int, ...], ep: Group, etp: Group, dim: int, stride: int) -> None:
    p.expert_parallel = True  # type: ignore[attr-defined]
    p.expert_shard = (ep.rank, ep.size)  # type: ignore[attr-defined]
    p.global_shape = global_shape  # type: ignore[attr-defined]
    p.tensor_model_parallel = etp.size > 1  # type: ignore[attr-defined]
    if etp.size > 1:
        p.partition_dim = dim  # type: ignore[attr-defined]
        p.partition_stride = stride  # type: ignore[attr-defined]


class _Weight(nn.Module):
    """A module holding one parameter (so the names read ``linear_fc1.weight`` like the dense MLP's)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


class GroupedExperts(nn.Module):
    """This rank's routed experts (see the module docstring)."""

    def __init__(self, config: TransformerConfig, ctx: ModelContext, prefix: str, fp8: Fp8Recipe | None = None) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        ep, etp = ctx.expert_parallel, ctx.expert_tensor_parallel
        e, h, f = moe.num_experts, config.hidden_size, moe.expert_ffn(config.ffn_size)
        if e % ep.size:
            raise ValueError(f"moe.num_experts={e} is not divisible by the expert-parallel size ep={ep.size}")
        if f % etp.size:
            raise ValueError(f"the expert ffn width {f} is not divisible by the expert tensor-parallel size {etp.size}")
        self.num_local, self.first = e // ep.size, ep.rank * (e // ep.size)
        fc1_out = 2 * f if config.gated else f
        kw = dict(dtype=config.dtype, device=ctx.device)
        self.linear_fc1 = _Weight(nn.Parameter(torch.empty(self.num_local, fc1_out // etp.size, h, **kw)))  # type: ignore[arg-type]
        self.linear_fc2 = _Weight(nn.Parameter(torch.empty(self.num_local, h, f // etp.size, **kw)))  # type: ignore[arg-type]
        stride = 2 if config.gated else 1
        _mark(self.linear_fc1.weight, (e, fc1_out, h), ep, etp, 1, stride)
        _mark(self.linear_fc2.weight, (e, h, f), ep, etp, 2, 1)
        out_init = (scaled_normal_init(config.init_method_std, config.num_layers) if config.scaled_output_init
                    else normal_init(config.init_method_std))  # fmt: skip
        for j in range(self.num_local):
            g = self.first + j
            init_sharded_(self.linear_fc1.weight[j], (fc1_out, h), 0, etp.rank, etp.size,
                          normal_init(config.init_method_std), ctx.seed_for(f"{prefix}.linear_fc1.weight.{g}"),
                          stride=stride)  # fmt: skip
            init_sharded_(self.linear_fc2.weight[j], (h, f), 1, etp.rank, etp.size, out_init,
                          ctx.seed_for(f"{prefix}.linear_fc2.weight.{g}"))  # fmt: skip
        self.act = (swiglu if config.activation == "swiglu" and config.swiglu_backward == "triton"
                    else activation_fn(config.activation))  # fmt: skip
        self.fp8_casts = (GroupedWeightCasts(), GroupedWeightCasts())
        """fc1's and fc2's FP8 weight casts, kept for an optimizer step inside ``fp8_step``."""
        self.fp8_plans: tuple[GroupedPlan, GroupedPlan] | None = None
        """With an FP8 recipe: fc1's and fc2's :class:`~mcore_parallel.fp8.GroupedPlan` (FP8 grouped GEMMs)."""
        self.fp8_reason: str | None = None
        """Why the experts run in bf16 although FP8 was asked for (None otherwise)."""
        if fp8 is not None:
            self.fp8_reason = grouped_fp8_problem(h, fc1_out // etp.size) or grouped_fp8_problem(f // etp.size, h)
            if self.fp8_reason is None:
                split = etp if etp.size > 1 else None  # fc1's output features / fc2's input features are split
                self.fp8_plans = (GroupedPlan(n_group=split, margin=fp8.margin),
                                  GroupedPlan(k_group=split, margin=fp8.margin))  # fmt: skip
            else:
                logger.warning("FP8 off for the routed experts of %s: %s, so they run in bf16", prefix, self.fp8_reason)

    def begin_weight_cache(self) -> None:
        """(``fp8_step``) From now on the FP8 casts of the expert weights are kept until :meth:`end_weight_cache`."""
        for c in self.fp8_casts:
            c.begin_weight_cache()

    def end_weight_cache(self) -> None:
        for c in self.fp8_casts:
            c.end_weight_cache()

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``[M, hidden]`` outputs (partial sums over expert-tensor-parallel ranks) of rows ``x`` grouped by local
        expert, ``counts`` ``[E_local]`` rows each."""
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        if self.fp8_plans is not None:
            hidden = fp8_grouped_linear(x, w1, counts, self.fp8_plans[0], self.fp8_casts[0])
            return fp8_grouped_linear(self.act(hidden), w2, counts, self.fp8_plans[1], self.fp8_casts[1])  # type: ignore[operator]
        hidden = grouped_linear(x, w1, counts)
        return grouped_linear(self.act(hidden), w2, counts)  # type: ignore[operator]
