"""The per-layer modules of a decode model (:func:`mcore_infer.decode.prepare_for_decode`) and what each fusion
needs of a layer.

Every wrapper is called as ``wrapper(hidden, rotary, inference_context, residual)`` and returns ``(out, residual)``:
with the deferred residual add, ``out + residual`` is the layer's output, added where the next layer's first norm
reads it (with compiled wrappers the add and the norm are one kernel); otherwise ``residual`` is None and ``out`` is
the output. :class:`FusedDecodeLayer` runs a standard :class:`~mcore_models.transformer.layer.TransformerLayer` with
the fusions its plan names; :class:`PlainDecodeLayer` adds a pending residual and calls any layer plainly. Both hold
the caller's layer as a child module: the parameters are shared, never copied, and the layer itself is unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mcore_infer.kernels.norm_linear import MAX_ROWS, norm_linear
from mcore_infer.kernels.small_gemv import (
    FMA_MAX_ROWS,
    add_deferred,
    linear_partials,
    row_linear,
    swiglu_down,
    swiglu_down_partials,
)
from mcore_models import TransformerConfig
from mcore_models.transformer.attention import InferenceContext, Rotary, SelfAttention
from mcore_models.transformer.layer import TransformerLayer
from mcore_models.transformer.mlp import MLP
from mcore_models.transformer.norm import RMSNorm

if TYPE_CHECKING:
    from mcore_infer.decode import DecodeLaunches

__all__ = ["LAYER_FUSIONS", "FusedDecodeLayer", "PlainDecodeLayer", "missing_for_fusions"]

LAYER_FUSIONS = ("defer_residual", "norm_linear", "swiglu_down", "proj_partials", "row_gemv")
"""The plan's fusions that change a layer's forward (RoPE and the KV write are the attention context's)."""


def _plain_linear(lin: Any, name: str, column: bool = False) -> list[str]:
    """What keeps ``lin`` from being read as one bias-free weight matrix by a row kernel."""
    problems = []
    if getattr(lin, "weight", None) is None:
        problems.append(f"{name} has no weight of its own")
    if getattr(lin, "bias", None) is not None:
        problems.append(f"{name} has a bias (add_bias_linear / add_qkv_bias)")
    if column and (getattr(lin, "sequence_parallel", False) or getattr(lin, "gather_output", False)):
        problems.append(f"{name} is sequence-parallel or gathers its output")
    return problems


def missing_for_fusions(layer: nn.Module, config: TransformerConfig, tp: int) -> dict[str, list[str]]:
    """For each of :data:`LAYER_FUSIONS`, what ``layer`` lacks for it (an empty list: it applies). The fused forwards
    are written for the standard layer (exactly ``TransformerLayer`` with ``SelfAttention`` and ``MLP``): any other
    module is run by its own forward, whatever it is built of."""
    if type(layer) is not TransformerLayer:
        why = [f"it is a {type(layer).__name__}, not a TransformerLayer (its own forward runs)"]
        return dict.fromkeys(LAYER_FUSIONS, why)
    attn, mlp = layer.self_attention, layer.mlp
    bad_attn = (
        [] if type(attn) is SelfAttention else [f"self_attention is a {type(attn).__name__} (needs SelfAttention)"]
    )
    bad_mlp = [] if type(mlp) is MLP else [f"mlp is a {type(mlp).__name__} (needs MLP)"]

    def sharded(what: str) -> list[str]:
        return [f"tensor parallelism (tp={tp}; {what})"] if tp > 1 else []

    missing: dict[str, list[str]] = {"defer_residual": []}
    missing["row_gemv"] = bad_attn or _plain_linear(attn.linear_qkv, "linear_qkv") + sharded("tensor-parallel shards")
    missing["proj_partials"] = bad_attn or (
        _plain_linear(attn.linear_proj, "linear_proj") + sharded("the output projection's all-reduce")
    )
    swiglu = [] if getattr(mlp, "is_swiglu", False) else [f"activation={config.activation!r} (needs swiglu)"]
    missing["swiglu_down"] = bad_mlp or (
        swiglu + _plain_linear(mlp.linear_fc2, "linear_fc2") + sharded("the down projection's all-reduce")
    )
    norms = [
        f"{name} is a {type(norm).__name__} (needs RMSNorm; normalization={config.normalization!r})"
        for name, norm in (("input_layernorm", layer.input_layernorm), ("pre_mlp_layernorm", layer.pre_mlp_layernorm))
        if not isinstance(norm, RMSNorm)
    ]
    missing["norm_linear"] = norms + bad_attn + bad_mlp
    if not (bad_attn or bad_mlp):
        missing["norm_linear"] += _plain_linear(attn.linear_qkv, "linear_qkv", column=True)
        missing["norm_linear"] += _plain_linear(mlp.linear_fc1, "linear_fc1", column=True)
    return missing


class PlainDecodeLayer(nn.Module):
    """Any layer, run by its own forward (after the previous layer's deferred residual add, if any)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(
        self, x: torch.Tensor, rotary: Rotary, inference_context: InferenceContext, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if residual is not None:
            x = add_deferred(x, residual)
        return self.layer(x, rotary, inference_context), None


class FusedDecodeLayer(nn.Module):
    """A standard ``TransformerLayer``'s inference forward with the given fusions (the same results up to rounding).

    Steps of at most :data:`~mcore_infer.kernels.small_gemv.FMA_MAX_ROWS` tokens run the one-row kernels (the QKV
    projection summed, the output projection as partial sums the residual add sums, SwiGLU inside the down
    projection); steps of at most :data:`~mcore_infer.kernels.norm_linear.MAX_ROWS` tokens with ``norm_linear`` run
    each norm inside the projection after it. Longer steps (prefill chunks) run the layer's own modules.
    """

    def __init__(self, layer: TransformerLayer, fusions: dict[str, bool], launches: DecodeLaunches) -> None:
        super().__init__()
        self.layer = layer
        # plain attributes, constants to torch.compile (no shape guard is taken for a fusion that is off)
        self.defer, self.norm_linear = fusions["defer_residual"], fusions["norm_linear"]
        self.swiglu_down, self.proj_partials, self.row_gemv = (
            fusions["swiglu_down"],
            fusions["proj_partials"],
            fusions["row_gemv"],
        )
        self.launches = launches

    def forward(
        self, x: torch.Tensor, rotary: Rotary, inference_context: InferenceContext, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.norm_linear and x.numel() // x.shape[-1] <= MAX_ROWS:
            return self._norm_linear_forward(x, rotary, inference_context, residual)
        layer: Any = self.layer
        attn: Any = layer.self_attention
        mlp: Any = layer.mlp
        launches = self.launches
        if residual is not None:
            x = add_deferred(x, residual)  # the previous layer's output may be partial sums (swiglu_down)
        h = layer.input_layernorm(x)
        # (the flags first: with none set the row count is never compared, so no shape guard enters compiled graphs)
        small = (self.row_gemv or self.proj_partials or self.swiglu_down) and h.numel() // h.shape[-1] <= FMA_MAX_ROWS
        if self.row_gemv and small:
            qkv = row_linear(h, attn.linear_qkv.weight, launches.row_gemv)
        else:
            qkv = attn.linear_qkv(h)
        out = attn.attend(qkv, rotary, inference_context)
        if self.proj_partials and small:  # split-K partial sums, summed by the residual add
            x = add_deferred(linear_partials(out, attn.linear_proj.weight, launches.proj_partials), x)
        else:
            x = x + attn.linear_proj(out)
        h = layer.pre_mlp_layernorm(x)
        if self.swiglu_down and small:  # with the deferred add: partial sums, summed where the next layer adds them
            fused = swiglu_down_partials if self.defer else swiglu_down
            out = fused(mlp.linear_fc1(h), mlp.linear_fc2.weight, launches.swiglu_down)
        else:
            out = mlp(h)
        return (out, x) if self.defer else (x + out, None)

    def _norm_linear_forward(
        self, x: torch.Tensor, rotary: Rotary, inference_context: InferenceContext, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Both norms inside the projections after them (:func:`~mcore_infer.kernels.norm_linear.norm_linear`): the
        QKV projection adds the residual and normalises, the up projection adds the attention output and (SwiGLU)
        applies the activation."""
        layer: Any = self.layer
        attn: Any = layer.self_attention
        mlp: Any = layer.mlp
        ln1, ln2 = layer.input_layernorm, layer.pre_mlp_layernorm
        launch = self.launches.norm_linear
        qkv, h = norm_linear(x, residual, ln1.weight, ln1.eps, attn.linear_qkv.weight, launch=launch)
        a = attn.linear_proj(attn.attend(qkv, rotary, inference_context))
        act, h = norm_linear(a, h, ln2.weight, ln2.eps, mlp.linear_fc1.weight, swiglu=mlp.is_swiglu, launch=launch)
        out = mlp.linear_fc2(act if mlp.is_swiglu else mlp.act(act))
        return (out, h) if self.defer else (h + out, None)
