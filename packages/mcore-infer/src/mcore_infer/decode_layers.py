"""The per-layer modules of a decode model (:func:`mcore_infer.decode.prepare_for_decode`) and what each fusion
needs of a layer.

Every wrapper is called as ``wrapper(hidden, rotary, inference_context, residual)`` and returns ``(out, residual)``:
with the deferred residual add, ``out + residual`` is the layer's output, added where the next layer's first norm
reads it (with compiled wrappers the add and the norm are one kernel); otherwise ``residual`` is None and ``out`` is
the output. :class:`FusedDecodeLayer` runs a :class:`~mcore_models.transformer.layer.TransformerLayer` with the fusions
its plan names (an attention or MLP other than the standard module, an MoE layer's say, is called whole, never
fused: :func:`skipped_fusions`), and a hybrid model's attention (``*``) and MLP (``-``) layers as the halves of one;
:class:`FusedMambaLayer` runs a Mamba layer's two projections with them (``M``); :class:`PlainDecodeLayer` adds a
pending residual and calls any layer plainly. Both hold
the caller's layer as a child module: the parameters are shared, never copied, and the layer itself is unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mcore_infer.kernels.add_norm import add_rms_norm
from mcore_infer.kernels.fused_mlp import fused_mlp_partials, norm_mlp_partials
from mcore_infer.kernels.gated_norm_gemv import gated_norm_partials, takes_group
from mcore_infer.kernels.norm_gemv import norm_row_linear
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
from mcore_models.hybrid import AttentionLayer, MLPLayer
from mcore_models.ssm.inference import mix_projected, scan_projected
from mcore_models.ssm.layer import MambaLayer
from mcore_models.ssm.mixer import Mamba2Mixer
from mcore_models.transformer.attention import InferenceContext, Rotary, SelfAttention
from mcore_models.transformer.layer import TransformerLayer
from mcore_models.transformer.mlp import MLP
from mcore_models.transformer.norm import RMSNorm

if TYPE_CHECKING:
    from mcore_infer.decode_plan import DecodeLaunches

__all__ = [
    "LAYER_FUSIONS",
    "FusedAttentionLayer",
    "FusedDecodeLayer",
    "FusedMLPLayer",
    "FusedMambaLayer",
    "PlainDecodeLayer",
    "fused_layer",
    "missing_for_fusions",
    "skipped_fusions",
]

LAYER_FUSIONS = (
    "defer_residual", "norm_linear", "swiglu_down", "proj_partials", "row_gemv", "norm_gemv", "fused_mlp", "row_fc1",
    "gated_norm_gemv", "pdl",
)  # fmt: skip
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


_MAMBA_FUSIONS = ("defer_residual", "row_gemv", "norm_gemv", "proj_partials", "gated_norm_gemv", "pdl")
"""The fusions of a Mamba layer (:class:`FusedMambaLayer`): the residual add and the norm inside the in-projection's
row GEMV, the out-projection as split-K partial sums (with the gated norm inside), the kernels launched as
programmatic dependents."""


def _halves(layer: nn.Module) -> tuple[bool, bool] | None:
    """Which halves of a Transformer layer ``layer`` has, (attention, MLP): both for a ``TransformerLayer``, one for
    a hybrid model's ``*`` (``AttentionLayer``) or ``-``/``E`` (``MLPLayer``) layer; None for any other layer."""
    return {TransformerLayer: (True, True), AttentionLayer: (True, False), MLPLayer: (False, True)}.get(type(layer))


def _standard_parts(layer: nn.Module) -> tuple[bool, bool]:
    """Whether ``layer`` has an attention and an MLP that are exactly the standard modules (``SelfAttention``,
    ``MLP``) whose pieces the fused forwards call; any other module is called whole, by its own forward."""
    has_attention, has_mlp = _halves(layer) or (False, False)
    return (has_attention and type(layer.self_attention) is SelfAttention, has_mlp and type(layer.mlp) is MLP)


def skipped_fusions(layer: nn.Module) -> dict[str, str]:
    """The fusions of :data:`LAYER_FUSIONS` that do not concern ``layer``, each with why: the part of the layer the
    fusion rewrites is not the standard module (exactly ``TransformerLayer`` or a hybrid model's attention or MLP
    layer, ``SelfAttention``, ``MLP``; a ``MambaLayer`` of a ``Mamba2Mixer``), or the layer has no such part, so that
    part runs its own forward. They stay off under any plan, and are never an error: a new layer type, attention or
    MLP (an MoE layer, say) is served as it is. ``norm_linear`` only needs the standard attention of a whole
    Transformer layer: with another MLP it fuses the first norm into the QKV projection and leaves the MLP and its
    norm alone."""
    if type(layer) is MambaLayer:
        if type(layer.mixer) is not Mamba2Mixer:
            return dict.fromkeys(LAYER_FUSIONS, f"its mixer is a {type(layer.mixer).__name__}, not a Mamba2Mixer")
        return {f: "a Mamba layer has no attention or MLP" for f in LAYER_FUSIONS if f not in _MAMBA_FUSIONS}
    halves = _halves(layer)
    if halves is None:
        return dict.fromkeys(LAYER_FUSIONS, f"it is a {type(layer).__name__}, not a TransformerLayer")
    attn_ok, mlp_ok = _standard_parts(layer)
    skipped: dict[str, str] = {"gated_norm_gemv": "it has no Mamba mixer"}
    if type(layer) is not TransformerLayer:
        skipped["norm_linear"] = f"it is a hybrid model's {type(layer).__name__} (norm_linear fuses whole layers)"
    if not attn_ok:
        why = (f"self_attention is a {type(layer.self_attention).__name__}, not a SelfAttention" if halves[0]
               else "it has no attention")  # fmt: skip
        skipped.update(dict.fromkeys(("row_gemv", "proj_partials", "norm_linear"), why))
        if halves[0]:  # (without attention, norm_gemv is still the norm inside the up projection's GEMV)
            skipped["norm_gemv"] = why
    if not mlp_ok:
        why = f"mlp is a {type(layer.mlp).__name__}, not an MLP" if halves[1] else "it has no MLP"
        skipped.update(dict.fromkeys(("swiglu_down", "fused_mlp", "row_fc1"), why))
    return skipped


def missing_for_fusions(layer: nn.Module, config: TransformerConfig, tp: int) -> dict[str, list[str]]:
    """For each of :data:`LAYER_FUSIONS` that concerns ``layer`` (see :func:`skipped_fusions`), what its standard
    parts lack for it (an empty list: it applies); the fusions that do not concern it map to empty lists."""
    missing: dict[str, list[str]] = {name: [] for name in LAYER_FUSIONS}

    def sharded(what: str) -> list[str]:
        return [f"tensor parallelism (tp={tp}; {what})"] if tp > 1 else []

    if type(layer) is MambaLayer and type(layer.mixer) is Mamba2Mixer:
        mixer, ln = layer.mixer, layer.input_layernorm
        missing["row_gemv"] = _plain_linear(mixer.in_proj, "mixer.in_proj", column=True) + sharded(
            "tensor-parallel shards"
        )
        rms = [] if isinstance(ln, RMSNorm) else [f"input_layernorm is a {type(ln).__name__} (needs RMSNorm)"]
        missing["norm_gemv"] = missing["row_gemv"] + rms
        missing["proj_partials"] = _plain_linear(mixer.out_proj, "mixer.out_proj") + sharded(
            "the output projection's all-reduce"
        )
        group = mixer.norm.group_size
        steps = [] if takes_group(group) else [f"the gated norm's groups of {group} (need a power-of-two factor >= 16)"]
        missing["gated_norm_gemv"] = missing["proj_partials"] + steps
        return missing
    if _halves(layer) is None:
        return missing
    attn: Any = getattr(layer, "self_attention", None)
    mlp: Any = getattr(layer, "mlp", None)
    attn_ok, mlp_ok = _standard_parts(layer)
    if attn_ok:
        missing["row_gemv"] = _plain_linear(attn.linear_qkv, "linear_qkv") + sharded("tensor-parallel shards")
        norm = layer.input_layernorm
        rms = [] if isinstance(norm, RMSNorm) else [f"input_layernorm is a {type(norm).__name__} (needs RMSNorm)"]
        missing["norm_gemv"] = missing["row_gemv"] + rms
        missing["proj_partials"] = _plain_linear(attn.linear_proj, "linear_proj") + sharded(
            "the output projection's all-reduce"
        )
    if mlp_ok:
        swiglu = [] if getattr(mlp, "is_swiglu", False) else [f"activation={config.activation!r} (needs swiglu)"]
        missing["swiglu_down"] = (
            swiglu + _plain_linear(mlp.linear_fc2, "linear_fc2") + sharded("the down projection's all-reduce")
        )
        missing["fused_mlp"] = missing["swiglu_down"] + _plain_linear(mlp.linear_fc1, "linear_fc1", column=True)
        missing["row_fc1"] = _plain_linear(mlp.linear_fc1, "linear_fc1", column=True) + sharded(
            "tensor-parallel shards"
        )
    if attn_ok and mlp is not None:  # norm_linear: the first norm into the QKV projection, and with the standard MLP
        # the second into fc1
        norms = [("input_layernorm", layer.input_layernorm)] + ([("pre_mlp_layernorm", layer.pre_mlp_layernorm)]
                                                                 if mlp_ok else [])  # fmt: skip
        missing["norm_linear"] = [
            f"{name} is a {type(norm).__name__} (needs RMSNorm; normalization={config.normalization!r})"
            for name, norm in norms
            if not isinstance(norm, RMSNorm)
        ] + _plain_linear(attn.linear_qkv, "linear_qkv", column=True)
        if mlp_ok:
            missing["norm_linear"] += _plain_linear(mlp.linear_fc1, "linear_fc1", column=True)
    return missing


def _add_norm(
    norm: nn.Module, out: torch.Tensor, residual: torch.Tensor | None, kernel: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(h), h)`` for ``h = out + residual`` (``out`` possibly partial sums; no residual: ``h = out``): one
    :func:`~mcore_infer.kernels.add_norm.add_rms_norm` kernel with ``kernel`` (an RMSNorm, ``pdl``), else the
    deferred add and the norm module."""
    if kernel:
        return add_rms_norm(out, residual, norm.weight, norm.eps, pdl=True)  # type: ignore[arg-type]
    h = out if residual is None else add_deferred(out, residual)
    return norm(h), h


def _small_step(fused_any: bool, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether a layer with a row-kernel fusion on (``fused_any``) takes the one-row kernels in this step: at most
    ``FMA_MAX_ROWS`` tokens. The flag first: with no fusion on the row count is never compared, so no shape guard
    enters compiled graphs. The previous layer's output ``x`` may be partial sums (``[splits, *h.shape]``): the rows
    are counted on ``residual`` where there is one."""
    return fused_any and (residual if residual is not None else x).numel() // x.shape[-1] <= FMA_MAX_ROWS


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
    each norm inside the projection after it. Longer steps (prefill chunks) run the layer's own modules. An attention
    or MLP that is not the standard module (an MoE layer's ``mlp``) is called whole and never fused
    (:func:`skipped_fusions`: the plan gives it none of the fusions that would reach into it).
    """

    def __init__(self, layer: nn.Module, fusions: dict[str, bool], launches: DecodeLaunches) -> None:
        super().__init__()
        self.layer = layer
        ln1, ln2 = getattr(layer, "input_layernorm", None), getattr(layer, "pre_mlp_layernorm", None)
        # plain attributes, constants to torch.compile (no shape guard is taken for a fusion that is off)
        self.defer, self.norm_linear = fusions["defer_residual"], fusions["norm_linear"]
        self.swiglu_down, self.proj_partials, self.row_gemv = (
            fusions["swiglu_down"],
            fusions["proj_partials"],
            fusions["row_gemv"],
        )
        self.norm_gemv = fusions["norm_gemv"]  # (with row_gemv: the plan checks it)
        self.fused_mlp = fusions["fused_mlp"]
        self.row_fc1 = fusions["row_fc1"]
        # with norm_gemv and row_fc1: the add and the norm before the MLP inside the up projection's row GEMV
        self.norm_gemv_mlp = self.norm_gemv and self.row_fc1 and isinstance(ln2, RMSNorm)
        self.norm_in_mlp = self.fused_mlp and isinstance(ln2, RMSNorm)  # (the kernel's norm)
        self.pdl = fusions["pdl"]  # small steps: the norms by add_rms_norm; every kernel launched as a dependent
        self.pdl_norms = self.pdl and isinstance(ln1, RMSNorm)
        self.pdl_norms_mlp = self.pdl and isinstance(ln2, RMSNorm)
        self.standard_attention, standard_mlp = _standard_parts(layer)
        self.norm_linear_mlp = self.norm_linear and standard_mlp  # the second norm inside the up projection too
        self.launches = launches

    def forward(
        self, x: torch.Tensor, rotary: Rotary, inference_context: InferenceContext, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.norm_linear and x.numel() // x.shape[-1] <= MAX_ROWS:
            return self._norm_linear_forward(x, rotary, inference_context, residual)
        small = self._small(x, residual)
        proj, x = self._attention_half(x, rotary, inference_context, residual, small)
        return self._mlp_half(proj, x, small)

    def _small(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        # (norm_gemv comes with row_gemv)
        fused_any = (self.row_gemv or self.proj_partials or self.swiglu_down or self.fused_mlp or self.row_fc1
                     or self.pdl)  # fmt: skip
        return _small_step(fused_any, x, residual)

    def _attention_half(
        self,
        x: torch.Tensor,
        rotary: Rotary,
        inference_context: InferenceContext,
        residual: torch.Tensor | None,
        small: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attention output, h)`` for ``h = x + residual``: the output possibly partial sums (proj_partials)."""
        layer: Any = self.layer
        attn: Any = layer.self_attention
        launches, pdl = self.launches, self.pdl and small
        if self.norm_gemv and small:  # the add (if any) and the norm inside the QKV projection
            ln1 = layer.input_layernorm
            qkv, x = norm_row_linear(x, residual, ln1.weight, ln1.eps, attn.linear_qkv.weight, launches.row_gemv, pdl)
        else:
            h, x = _add_norm(layer.input_layernorm, x, residual, self.pdl_norms and small)
            if not self.standard_attention:
                return attn(h, rotary, inference_context), x
            if self.row_gemv and small:
                qkv = row_linear(h, attn.linear_qkv.weight, launches.row_gemv, pdl)
            else:
                qkv = attn.linear_qkv(h)
        out = attn.attend(qkv, rotary, inference_context)
        if self.proj_partials and small:  # split-K partial sums, summed by the residual add
            return linear_partials(out, attn.linear_proj.weight, launches.proj_partials, pdl), x
        return attn.linear_proj(out), x

    def _mlp_half(
        self, proj: torch.Tensor, x: torch.Tensor | None, small: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's output after its attention: ``(out, h)`` with the deferred residual add, else ``(h + out,
        None)``, for ``h = proj + x`` (``h = proj`` without ``x``: a hybrid model's first layer)."""
        layer: Any = self.layer
        mlp: Any = layer.mlp
        launches, pdl = self.launches, self.pdl and small
        if self.norm_in_mlp and small and x is not None:  # the residual add, the norm and the MLP: its sum and h
            ln2 = layer.pre_mlp_layernorm
            w1, w2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight
            out, x = norm_mlp_partials(proj, x, ln2.weight, ln2.eps, w1, w2, launches.fused_mlp, pdl)
        elif self.norm_gemv_mlp and small:  # the residual add and the norm inside the up projection's row GEMV
            ln2 = layer.pre_mlp_layernorm
            up, x = norm_row_linear(proj, x, ln2.weight, ln2.eps, mlp.linear_fc1.weight, launches.row_fc1, pdl)
            out = self._down(up, pdl)
        else:
            h, x = _add_norm(layer.pre_mlp_layernorm, proj, x, self.pdl_norms_mlp and small)
            if self.fused_mlp and small:  # the whole MLP: its float32 sum
                out = fused_mlp_partials(h, mlp.linear_fc1.weight, mlp.linear_fc2.weight, launches.fused_mlp, pdl)
            elif (self.swiglu_down or self.row_fc1) and small:
                up = row_linear(h, mlp.linear_fc1.weight, launches.row_fc1, pdl) if self.row_fc1 else mlp.linear_fc1(h)
                out = self._down(up, pdl)
            else:
                out = mlp(h)
        # partial sums are added where the next layer adds the residual, or here (in float32, rounded once)
        return (out, x) if self.defer else (add_deferred(out, x), None)

    def _down(self, up: torch.Tensor, pdl: bool) -> torch.Tensor:
        """The MLP after its up projection in a small step: SwiGLU inside the down projection (with the deferred add:
        its partial sums), else the activation and the down projection."""
        mlp: Any = self.layer.mlp
        if self.swiglu_down:
            fused = swiglu_down_partials if self.defer else swiglu_down
            return fused(up, mlp.linear_fc2.weight, self.launches.swiglu_down, pdl)  # type: ignore[no-any-return]
        return mlp.linear_fc2(mlp.act(up))  # type: ignore[no-any-return]

    def _norm_linear_forward(
        self, x: torch.Tensor, rotary: Rotary, inference_context: InferenceContext, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Both norms inside the projections after them (:func:`~mcore_infer.kernels.norm_linear.norm_linear`): the
        QKV projection adds the residual and normalises, the up projection adds the attention output and (SwiGLU)
        applies the activation. Another MLP than the standard one keeps its own norm and forward."""
        layer: Any = self.layer
        attn: Any = layer.self_attention
        mlp: Any = layer.mlp
        ln1, ln2 = layer.input_layernorm, layer.pre_mlp_layernorm
        launch = self.launches.norm_linear
        qkv, h = norm_linear(x, residual, ln1.weight, ln1.eps, attn.linear_qkv.weight, launch=launch)
        a = attn.linear_proj(attn.attend(qkv, rotary, inference_context))
        if not self.norm_linear_mlp:
            h = h + a
            out = mlp(ln2(h))
        else:
            act, h = norm_linear(a, h, ln2.weight, ln2.eps, mlp.linear_fc1.weight, swiglu=mlp.is_swiglu, launch=launch)
            out = mlp.linear_fc2(act if mlp.is_swiglu else mlp.act(act))
        return (out, h) if self.defer else (h + out, None)


class FusedMambaLayer(nn.Module):
    """A ``MambaLayer`` (of a ``Mamba2Mixer``) with the plan's fusions that concern it (the same results up to
    rounding): in steps of at most :data:`~mcore_infer.kernels.small_gemv.FMA_MAX_ROWS` tokens the in-projection
    runs through the one-row GEMV (``row_gemv``; with ``norm_gemv`` the residual add and the norm inside it), the
    out-projection as split-K partial sums the next residual add sums (``proj_partials``; with ``gated_norm_gemv``
    the gated norm inside it), and with ``pdl`` these and the add + norm kernel are launched as programmatic
    dependents. Between the projections the mixer's own inference step runs
    (:func:`~mcore_models.ssm.inference.mix_projected`: the conv and SSM states, the gated norm). Longer steps
    (prefill chunks) run the layer's own modules."""

    def __init__(self, layer: MambaLayer, fusions: dict[str, bool], launches: DecodeLaunches) -> None:
        super().__init__()
        self.layer = layer
        self.defer, self.row_gemv, self.norm_gemv = (fusions[k] for k in ("defer_residual", "row_gemv", "norm_gemv"))
        self.proj_partials, self.pdl = fusions["proj_partials"], fusions["pdl"]
        self.gated_norm_gemv = fusions["gated_norm_gemv"]
        self.pdl_norms = self.pdl and isinstance(layer.input_layernorm, RMSNorm)
        self.launches = launches

    def forward(
        self, x: torch.Tensor, rotary: Rotary, inference_context: InferenceContext, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        layer: Any = self.layer
        mixer, launches = layer.mixer, self.launches
        small = _small_step(self.row_gemv or self.proj_partials or self.gated_norm_gemv or self.pdl, x, residual)
        pdl = self.pdl and small
        if self.norm_gemv and small:  # the add (if any) and the norm inside the in-projection
            ln = layer.input_layernorm
            zxbcdt, x = norm_row_linear(x, residual, ln.weight, ln.eps, mixer.in_proj.weight, launches.row_gemv, pdl)
        else:
            h, x = _add_norm(layer.input_layernorm, x, residual, self.pdl_norms and small)
            if self.row_gemv and small:
                zxbcdt = row_linear(h, mixer.in_proj.weight, launches.row_gemv, pdl)
            else:
                zxbcdt = mixer.in_proj(h)
        if self.gated_norm_gemv and small:  # the gated norm inside the out-projection: its partial sums
            y, z = scan_projected(mixer, zxbcdt[:, 0], inference_context)  # [T, 1, d] each
            norm = mixer.norm
            out = gated_norm_partials(y, z, norm.weight, norm.eps, norm.group_size, norm.norm_before_gate,
                                      mixer.out_proj.weight, launches.gated_norm_gemv, pdl)  # fmt: skip
        elif self.proj_partials and small:  # split-K partial sums, summed by the residual add
            y = mix_projected(mixer, zxbcdt[:, 0], inference_context)  # [T, 1, d]
            out = linear_partials(y, mixer.out_proj.weight, launches.proj_partials, pdl)
        else:
            out = mixer.out_proj(mix_projected(mixer, zxbcdt[:, 0], inference_context))
        return (out, x) if self.defer else (add_deferred(out, x), None)


class FusedAttentionLayer(FusedDecodeLayer):
    """A hybrid model's attention layer (``*``, ``AttentionLayer``): :class:`FusedDecodeLayer`'s attention half.

    Each half has its own ``forward`` because ``torch.compile`` keeps at most ``torch._dynamo.config.recompile_limit``
    (8) graphs for one function, over every instance: the two kinds of half at their step sizes outgrew the one
    ``forward`` they shared (``hybrid-1b`` on an H100), and the layers past the limit ran uncompiled."""

    def forward(
        self, x: torch.Tensor, rotary: Rotary, inference_context: InferenceContext, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        proj, x = self._attention_half(x, rotary, inference_context, residual, self._small(x, residual))
        return (proj, x) if self.defer else (add_deferred(proj, x), None)


class FusedMLPLayer(FusedDecodeLayer):
    """A hybrid model's MLP layer (``-``/``E``, ``MLPLayer``): :class:`FusedDecodeLayer`'s MLP half, ``h = x +
    residual`` (``h = x`` first in the model), with its own ``forward`` (see :class:`FusedAttentionLayer`)."""

    def forward(
        self, x: torch.Tensor, rotary: Rotary, inference_context: InferenceContext, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._mlp_half(x, residual, self._small(x, residual))


def fused_layer(layer: nn.Module, fusions: dict[str, bool], launches: DecodeLaunches) -> nn.Module:
    """The wrapper running ``layer`` with ``fusions`` (those it takes, at least one on): a :class:`FusedMambaLayer`
    for a Mamba layer, a :class:`FusedDecodeLayer` for a Transformer layer, a :class:`FusedAttentionLayer` or
    :class:`FusedMLPLayer` for a hybrid model's half of one."""
    if type(layer) is MambaLayer:
        return FusedMambaLayer(layer, fusions, launches)
    halves = _halves(layer)
    if halves is None:
        raise TypeError(f"no fused decode wrapper for a {type(layer).__name__}: serve it with PlainDecodeLayer")
    wrapper = {(True, True): FusedDecodeLayer, (True, False): FusedAttentionLayer, (False, True): FusedMLPLayer}
    return wrapper[halves](layer, fusions, launches)
