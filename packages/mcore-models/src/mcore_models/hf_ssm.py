"""Converters between mcore's global state dict and Hugging Face Mamba-2 and hybrid models: ``Mamba2ForCausalLM``
(every layer Mamba) and ``NemotronHForCausalLM`` (Mamba, attention and MLP layers), configs both ways and tensors one
at a time. :mod:`mcore_models.hf` dispatches here for configs with a ``hybrid_pattern``.

Layers: mcore's ``hybrid_pattern`` is NemotronH's ``hybrid_override_pattern`` (``M`` Mamba = HF ``linear_attention``,
``*`` attention = ``full_attention``, ``-`` MLP = ``mlp``; stage boundaries ``|`` are dropped). Every HF block is
``backbone.layers.{i}.norm`` + ``mixer``; mcore's norm is ``input_layernorm`` on Mamba and attention layers and
``pre_mlp_layernorm`` on MLP layers. The Mamba mixer's tensors have the same names and layouts on both sides
(``in_proj`` rows ``[z, x, B, C, dt]``, ``conv1d`` over ``[x, B, C]``, ``dt_bias``, ``A_log``, ``D``, the gated
``norm`` and ``out_proj``). Attention is mcore's grouped fused ``linear_qkv`` split into ``q_proj``/``k_proj``/
``v_proj`` (:mod:`mcore_models.hf`) and ``linear_proj`` = ``o_proj``; the MLP is ``linear_fc1`` = ``up_proj`` and
``linear_fc2`` = ``down_proj`` (squared ReLU, not gated).

Files use the hub's ``backbone.`` prefix (what ``save_pretrained`` writes for both classes); import also reads the
``transformers`` 5 module names of NemotronH (``model.``) and old Mamba-2 files' ``backbone.embedding``.

What transformers computes, and so what is exported or refused (:class:`~mcore_models.errors.ConversionError`):
the gated norm is always ``rmsnorm(y * silu(z))`` over ``n_groups`` groups (``norm_before_gate=False``; HF configs'
``norm_before_gate`` field is ignored by transformers and so on import too); one epsilon for every norm; no biases
on ``in_proj``/``out_proj``; both clamp the time step to ``time_step_limit`` (as the ``mamba_ssm`` kernels do; older
transformers releases clamped NemotronH's only from below, at ``time_step_min``, so an export writes both to the same
lower bound and keeps NemotronH's upper bound infinite); NemotronH's attention has no position embedding and no biases, its lm_head is never tied (a tied
mcore model is written with a copy of the embedding), and its MoE layers (``E``) are not mcore's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import torch

from mcore_models import hf as _hf
from mcore_models.config import TransformerConfig
from mcore_models.errors import ConversionError
from mcore_models.mamba_config import MambaConfig

__all__ = [
    "SSM_ARCHITECTURES",
    "SSM_MODEL_TYPES",
    "ssm_architecture",
    "ssm_config_to_hf",
    "ssm_config_from_hf",
    "ssm_mcore_to_hf",
    "ssm_hf_to_mcore",
]

logger = logging.getLogger(__name__)

MAMBA2, NEMOTRON_H = "Mamba2ForCausalLM", "NemotronHForCausalLM"
SSM_ARCHITECTURES = (MAMBA2, NEMOTRON_H)
SSM_MODEL_TYPES = {"mamba2": MAMBA2, "nemotron_h": NEMOTRON_H}
_MODEL_TYPE = {v: k for k, v in SSM_MODEL_TYPES.items()}
HF_BLOCK_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
"""mcore pattern character -> NemotronH ``layers_block_type`` entry."""
_PATTERN_CHAR = {v: k for k, v in HF_BLOCK_TYPES.items()}
_MAMBA_DEFAULTS = MambaConfig()
TINY = torch.finfo(torch.float32).tiny
"""NemotronH's ``time_step_min`` for mcore's unclamped time steps (``dt_limit`` from 0): float32's smallest normal
number, below which no float32 or bfloat16 time step is changed by the clamp (transformers takes its log, so not 0)."""


# ---------------------------------------------------------------------------------------------------- configs
def _layers(config: TransformerConfig) -> str:
    layers = config.hybrid_layers
    if layers is None:
        raise ConversionError("the config has no hybrid_pattern: not a Mamba or hybrid model")
    return layers


def _common_problems(c: TransformerConfig, layers: str) -> list[str]:
    p = []
    if c.normalization != "rmsnorm":
        p.append(f"normalization={c.normalization} (the HF Mamba models use RMSNorm)")
    if c.position_embedding == "learned_absolute":
        p.append("position_embedding=learned_absolute (the HF Mamba models have no position table)")
    if c.mamba is not None and "M" in layers and c.mamba.norm_before_gate:
        p.append("mamba.norm_before_gate=True (transformers gates before the norm: rmsnorm(y * silu(z)))")
    return p


def _nemotron_problems(c: TransformerConfig, layers: str) -> list[str]:
    p = []
    if "E" in layers:
        p.append("MoE layers ('E' in hybrid_pattern: NemotronH's experts, routed by sigmoid with latent projections, "
                 "are not mcore's MoE layer)")  # fmt: skip
    if "*" in layers:
        if c.position_embedding == "rope":
            p.append("position_embedding=rope (NemotronH's attention has no position embedding)")
        if c.qk_layernorm:
            p.append("qk_layernorm (NemotronH has no query/key normalisation)")
        if c.add_qkv_bias:
            p.append("add_qkv_bias (NemotronH's attention has no biases)")
    if ("*" in layers or "-" in layers) and c.add_bias_linear:
        p.append("add_bias_linear (NemotronH's attention and MLP layers have no biases)")
    if "-" in layers and c.activation != "squared_relu":
        what = " (a gated MLP)" if c.gated else ""
        p.append(f"activation={c.activation}{what}: NemotronH's MLP is up_proj, squared ReLU (relu2), down_proj")
    if c.mamba is not None and "M" in layers and math.isfinite(c.mamba.dt_limit[1]):
        p.append(f"mamba.dt_limit={c.mamba.dt_limit} with a finite upper bound (transformers before 5.25 clamp "
                 "NemotronH's time step only from below, at time_step_min)")  # fmt: skip
    return p


def ssm_architecture(config: TransformerConfig) -> str:
    """``Mamba2ForCausalLM`` (the one recorded at import in ``extra["hf_architecture"]``, else when every layer is
    ``M``) or ``NemotronHForCausalLM``, or a ConversionError naming every feature that class cannot represent."""
    c = config
    layers = _layers(c)
    hint = c.extra.get("hf_architecture")
    arch = str(hint) if hint in SSM_ARCHITECTURES else (MAMBA2 if set(layers) == {"M"} else NEMOTRON_H)
    p = _common_problems(c, layers)
    if arch == MAMBA2:
        others = sorted(set(layers) - {"M"})
        if others:
            p.append(f"layers {others} in hybrid_pattern={c.hybrid_pattern!r} (Mamba2ForCausalLM has only Mamba "
                     "layers; NemotronHForCausalLM takes M, * and -)")  # fmt: skip
    else:
        p += _nemotron_problems(c, layers)
    if p:
        raise ConversionError(f"{arch} cannot represent: " + "; ".join(p))
    return arch


def _mamba_to_hf(c: TransformerConfig, arch: str) -> dict[str, Any]:
    m = c.mamba
    if m is None:
        return {}
    names = ("state_size", "num_heads", "head_dim", "hidden_act") if arch == MAMBA2 else (
        "ssm_state_size", "mamba_num_heads", "mamba_head_dim", "mamba_hidden_act")  # fmt: skip
    # Both clamp dt to time_step_limit; older transformers clamped NemotronH's at time_step_min (its log must exist:
    # 0 becomes TINY), so NemotronH's time_step_min is the clamp's lower bound too
    t_min = m.dt_min if arch == MAMBA2 else max(m.dt_limit[0], TINY)
    return {
        **dict(zip(names, (m.d_state, m.nheads(c.hidden_size), m.head_dim, "silu"))),
        "expand": m.expand,
        "n_groups": m.n_groups,
        "conv_kernel": m.d_conv,
        "chunk_size": m.chunk_size,
        "use_conv_bias": m.conv_bias,
        "use_bias": False,
        "time_step_min": t_min,
        "time_step_max": m.dt_max,
        "time_step_floor": m.dt_init_floor,
        "time_step_limit": list(m.dt_limit),
    }


def ssm_config_to_hf(config: TransformerConfig) -> dict[str, Any]:
    """The HF ``config.json`` fields of a Mamba-2 or hybrid config (raises ConversionError naming what HF cannot
    represent)."""
    arch = ssm_architecture(config)
    c, layers = config, _layers(config)
    if c.hybrid_pattern is not None and "|" in c.hybrid_pattern:
        logger.info("hybrid_pattern %r: the pipeline-stage boundaries are not exported", c.hybrid_pattern)
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": _MODEL_TYPE[arch],
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "vocab_size": c.vocab_size,
        "layer_norm_epsilon": c.norm_eps,
        "initializer_range": c.init_method_std,
        "residual_in_fp32": False,  # mcore's residual stream is in params_dtype
        **_mamba_to_hf(c, arch),
    }
    if arch == MAMBA2:
        return {**out, "rms_norm": True, "norm_before_gate": False,
                "tie_word_embeddings": c.share_embeddings_and_output_weights}  # fmt: skip
    if c.share_embeddings_and_output_weights:
        logger.info("NemotronHForCausalLM never ties lm_head: it is written as a copy of the embedding")
    return {
        **out,
        "hybrid_override_pattern": layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.query_groups,
        "head_dim": c.head_dim,
        "attention_bias": False,
        "attention_dropout": c.attention_dropout,
        "hidden_dropout": c.hidden_dropout,
        "max_position_embeddings": c.max_position_embeddings,
        "intermediate_size": c.ffn_size,
        "mlp_hidden_act": "relu2",
        "mlp_bias": False,
        "sliding_window": None,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
    }


def _hf_arch(hf: dict[str, Any]) -> str:
    arch = (hf.get("architectures") or [None])[0]
    if arch in SSM_ARCHITECTURES:
        return str(arch)
    if arch is None and hf.get("model_type") in SSM_MODEL_TYPES:
        return SSM_MODEL_TYPES[hf["model_type"]]
    raise ConversionError(f"architecture {arch!r} is not one of {', '.join(SSM_ARCHITECTURES)}")


def _float(v: Any) -> float:
    """A number of a config.json (transformers 5 writes infinity as ``{"__float__": "Infinity"}``)."""
    return float(v["__float__"] if isinstance(v, dict) and "__float__" in v else v)


def _mamba_from_hf(arch: str, hf: dict[str, Any]) -> MambaConfig:
    """The MambaConfig of a Mamba2 / NemotronH config; refuses what mcore's mixer cannot reproduce, naming it."""
    mamba2 = arch == MAMBA2
    act_key, heads_key, dim_key, state_key = ("hidden_act", "num_heads", "head_dim", "state_size") if mamba2 else (
        "mamba_hidden_act", "mamba_num_heads", "mamba_head_dim", "ssm_state_size")  # fmt: skip
    if hf.get(act_key, "silu") != "silu":
        raise ConversionError(f"{act_key}={hf[act_key]!r}: mcore's Mamba mixer uses silu")
    if hf.get("use_bias", False):
        raise ConversionError("use_bias=True: mcore's Mamba mixer has no in_proj/out_proj biases")
    if mamba2 and not hf.get("rms_norm", True):
        raise ConversionError("rms_norm=False: mcore's Mamba mixer always has the gated RMSNorm")
    if mamba2 and hf.get("norm_before_gate"):
        logger.warning("norm_before_gate=True in the Mamba2 config is ignored, as transformers ignores it: the gate "
                       "is applied before the norm (mamba.norm_before_gate=False)")  # fmt: skip
    hidden, heads, head_dim = hf["hidden_size"], hf[heads_key], hf[dim_key]
    if (heads * head_dim) % hidden:
        raise ConversionError(f"{heads_key} * {dim_key} = {heads * head_dim} is not a multiple of hidden_size="
                              f"{hidden} (mcore's d_inner is expand * hidden_size)")  # fmt: skip
    expand = heads * head_dim // hidden
    if mamba2 and hf.get("expand", expand) != expand:
        raise ConversionError(f"expand={hf['expand']} but {heads_key} * {dim_key} = {heads * head_dim}")
    t_min, t_max = _float(hf.get("time_step_min", 0.001)), _float(hf.get("time_step_max", 0.1))
    low, high = (_float(v) for v in hf.get("time_step_limit", (0.0, math.inf)))
    limit = (0.0 if low <= TINY else low, high)
    return MambaConfig(
        d_state=hf[state_key],
        d_conv=hf.get("conv_kernel", 4),
        expand=expand,
        head_dim=head_dim,
        n_groups=hf.get("n_groups", 1),
        chunk_size=hf.get("chunk_size", 256),
        dt_min=t_min if TINY < t_min <= t_max else min(_MAMBA_DEFAULTS.dt_min, t_max),  # init only
        dt_max=t_max,
        dt_init_floor=_float(hf.get("time_step_floor", 1e-4)),
        dt_limit=limit,  # type: ignore[arg-type]
        conv_bias=bool(hf.get("use_conv_bias", True)),
        norm_before_gate=False,
    )


def _hf_pattern(hf: dict[str, Any]) -> str:
    """NemotronH's layers as an mcore pattern (``layers_block_type``, else ``hybrid_override_pattern``)."""
    types = hf.get("layers_block_type")
    if types:
        unknown = sorted(set(types) - set(_PATTERN_CHAR))
        if unknown:
            raise ConversionError(f"layers_block_type holds {unknown}: known are {sorted(_PATTERN_CHAR)}")
        pattern = "".join(_PATTERN_CHAR[t] for t in types)
    else:
        pattern = hf.get("hybrid_override_pattern") or ""
    bad = sorted(set(pattern) - set(HF_BLOCK_TYPES))
    if not pattern or bad:
        raise ConversionError(f"hybrid_override_pattern={pattern!r}: needs layers of M, *, - (unknown: {bad})")
    if "E" in pattern:
        raise ConversionError(
            f"MoE layers ('E' in hybrid_override_pattern={pattern!r}) are not supported: NemotronH's experts "
            "(sigmoid routing, latent projections) are not mcore's MoE layer"
        )
    return pattern


def _nemotron_fields(hf: dict[str, Any]) -> dict[str, Any]:
    pattern = _hf_pattern(hf)
    if hf.get("sliding_window") is not None:
        raise ConversionError(f"sliding_window={hf['sliding_window']}: mcore has no sliding-window attention")
    if hf.get("mlp_bias"):
        raise ConversionError("mlp_bias=True: mcore's MLP layers of a NemotronH model have no biases")
    if "-" in pattern and hf.get("mlp_hidden_act", "relu2") != "relu2":
        raise ConversionError(f"mlp_hidden_act={hf['mlp_hidden_act']!r}: only relu2 (squared ReLU) is supported")
    if hf.get("attention_bias"):
        logger.warning("attention_bias=True is ignored, as NemotronH's attention in transformers has no biases")
    if hf.get("num_nextn_predict_layers"):
        logger.warning("the %d multi-token-prediction layers are not imported (transformers does not run them)",
                       hf["num_nextn_predict_layers"])  # fmt: skip
    heads = hf.get("num_attention_heads", 32)
    return dict(
        num_layers=len(pattern),
        hybrid_pattern=pattern,
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf.get("intermediate_size"),
        activation="squared_relu",
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        hidden_dropout=float(hf.get("hidden_dropout", 0.0)),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        share_embeddings_and_output_weights=False,
        mamba=_mamba_from_hf(NEMOTRON_H, hf) if "M" in pattern else None,
    )


def _mamba2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    mamba = _mamba_from_hf(MAMBA2, hf)
    hidden, layers = hf["hidden_size"], hf["num_hidden_layers"]
    heads = mamba.nheads(hidden)  # no attention: heads only set what tensor-parallel sizes the checks accept
    return dict(
        num_layers=layers,
        hybrid_pattern="M" * layers,
        num_attention_heads=heads,
        kv_channels=mamba.head_dim,
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        mamba=mamba,
    )


def ssm_config_from_hf(hf: dict[str, Any], **overrides: Any) -> TransformerConfig:
    """The TransformerConfig of an HF Mamba2 / NemotronH ``config.json``; ``overrides`` replace fields."""
    arch = _hf_arch(hf)
    fields: dict[str, Any] = dict(
        hidden_size=hf["hidden_size"],
        vocab_size=hf["vocab_size"],
        normalization="rmsnorm",
        norm_eps=_float(hf.get("layer_norm_epsilon", 1e-5)),
        add_bias_linear=False,
        position_embedding="none",
        init_method_std=_float(hf.get("initializer_range", 0.02)),
        **(_mamba2_fields(hf) if arch == MAMBA2 else _nemotron_fields(hf)),
        extra={"hf_architecture": arch},
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


# ---------------------------------------------------------------------------------------------- state dicts
_MIXER = ("in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")


def _layer_pairs(c: TransformerConfig, kind: str, i: int) -> list[tuple[str, str]]:
    """``(mcore key, HF key)`` of layer ``i``'s tensors that map one to one (all but the attention's q/k/v)."""
    m, h = f"decoder.layers.{i}", f"backbone.layers.{i}"
    if kind == "M":
        assert c.mamba is not None
        names = (*_MIXER, "conv1d.bias") if c.mamba.conv_bias else _MIXER
        return [(f"{m}.input_layernorm.weight", f"{h}.norm.weight")] + [
            (f"{m}.mixer.{n}", f"{h}.mixer.{n}") for n in names
        ]
    if kind == "*":
        return [(f"{m}.input_layernorm.weight", f"{h}.norm.weight"),
                (f"{m}.self_attention.linear_proj.weight", f"{h}.mixer.o_proj.weight")]  # fmt: skip
    if kind == "-":
        return [(f"{m}.pre_mlp_layernorm.weight", f"{h}.norm.weight"),
                (f"{m}.mlp.linear_fc1.weight", f"{h}.mixer.up_proj.weight"),
                (f"{m}.mlp.linear_fc2.weight", f"{h}.mixer.down_proj.weight")]  # fmt: skip
    raise ConversionError(f"layer {i}: kind {kind!r} has no Hugging Face layout")


def ssm_mcore_to_hf(config: TransformerConfig, get: _hf.Getter) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_key, tensor)`` for every tensor of the HF model (hub names, ``backbone.``), reading mcore global
    tensors via ``get``."""
    arch = ssm_architecture(config)
    c = config
    yield "backbone.embeddings.weight", get("embedding.word_embeddings.weight")
    for i, kind in enumerate(_layers(c)):
        for mk, hk in _layer_pairs(c, kind, i):
            yield hk, get(mk)
        if kind == "*":
            q, k, v = _hf._split_qkv(get(f"decoder.layers.{i}.self_attention.linear_qkv.weight"), c)
            yield from ((f"backbone.layers.{i}.mixer.{n}_proj.weight", t) for n, t in zip("qkv", (q, k, v)))
            del q, k, v  # streaming: drop the fused tensor before the next read
    yield "backbone.norm_f.weight", get("decoder.final_layernorm.weight")
    if not c.share_embeddings_and_output_weights:
        yield "lm_head.weight", get("output_layer.weight")
    elif arch == NEMOTRON_H:
        yield "lm_head.weight", get("embedding.word_embeddings.weight")


def _hub_or_module(get: _hf.Getter) -> _hf.Getter:
    """``get`` that falls back from a hub ``backbone.`` key to the module's ``model.`` one (NemotronH in
    transformers 5) and from ``backbone.embeddings`` to old Mamba-2 files' ``backbone.embedding``; a key found under
    none of them raises the hub key's KeyError."""

    def read(key: str) -> torch.Tensor:
        try:
            return get(key)
        except KeyError as missing:
            alternatives = ["model." + key.removeprefix("backbone.")] if key.startswith("backbone.") else []
            if key == "backbone.embeddings.weight":
                alternatives.append("backbone.embedding.weight")
            for alt in alternatives:
                try:
                    return get(alt)
                except KeyError:
                    pass
            raise missing from None

    return read


def ssm_hf_to_mcore(config: TransformerConfig, get: _hf.Getter) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(mcore_key, global tensor)`` for every mcore parameter, reading HF tensors (hub or module names) via
    ``get``; a missing key raises the getter's KeyError."""
    ssm_architecture(config)
    c, read = config, _hub_or_module(get)
    yield "embedding.word_embeddings.weight", read("backbone.embeddings.weight")
    for i, kind in enumerate(_layers(c)):
        for mk, hk in _layer_pairs(c, kind, i):
            yield mk, read(hk)
        if kind == "*":
            q, k, v = (read(f"backbone.layers.{i}.mixer.{n}_proj.weight") for n in "qkv")
            yield f"decoder.layers.{i}.self_attention.linear_qkv.weight", _hf._fuse_qkv(q, k, v, c)
            del q, k, v
    yield "decoder.final_layernorm.weight", read("backbone.norm_f.weight")
    if not c.share_embeddings_and_output_weights:
        yield "output_layer.weight", read("lm_head.weight")
