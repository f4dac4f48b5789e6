"""Converters between mcore's global state dict and Hugging Face mixture-of-experts GPTs: Mixtral, Qwen2-MoE and
Qwen3-MoE (configs both ways, tensors one at a time). :mod:`mcore_models.hf` dispatches here for configs with ``moe``.

Attention, norms and embeddings are the Llama layout (:mod:`mcore_models.hf`), plus Qwen2-MoE's q/k/v biases (mcore's
fused, grouped ``linear_qkv.bias``) and Qwen3-MoE's per-head ``q_norm``/``k_norm`` (mcore's ``q_layernorm`` /
``k_layernorm``). Each MoE layer's experts are two global tensors in mcore, ``experts.linear_fc1.weight``
``[E, 2F, hidden]`` (per expert ``[gate; up]``) and ``experts.linear_fc2.weight`` ``[E, hidden, F]``. Two HF layouts:

- ``hub`` (what ``save_pretrained`` writes and the Hub stores): one tensor per expert and projection, Mixtral's
  ``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down) and ``block_sparse_moe.gate`` (router);
  Qwen's ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` and ``mlp.gate``.
- ``fused`` (the ``transformers`` 5 module's own state dict): ``mlp.experts.gate_up_proj`` ``[E, 2F, hidden]`` and
  ``mlp.experts.down_proj`` ``[E, hidden, F]``, the same tensors as mcore's, and the router at ``mlp.gate``.

Export writes either (``hub`` by default); import reads either, layer by layer.

Routing: Mixtral (always) and Qwen with ``norm_topk_prob=true`` renormalise the top-k softmax probabilities, which is
mcore's ``router_pre_softmax=False`` (softmax over the top-k logits); Qwen with ``norm_topk_prob=false`` is
``router_pre_softmax=True``. Qwen's sparse layers (``decoder_sparse_step``, ``mlp_only_layers``) become a
``layer_freq`` list.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from mcore_models import hf as _hf
from mcore_models.config import TransformerConfig
from mcore_models.errors import ConversionError
from mcore_models.moe import MoEConfig

__all__ = [
    "MOE_ARCHITECTURES",
    "MOE_MODEL_TYPES",
    "moe_architecture",
    "moe_config_to_hf",
    "moe_config_from_hf",
    "moe_mcore_to_hf",
    "moe_hf_to_mcore",
    "hf_moe_layers",
]

logger = logging.getLogger(__name__)

MIXTRAL, QWEN2, QWEN3 = "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"
MOE_ARCHITECTURES = (MIXTRAL, QWEN2, QWEN3)
MOE_MODEL_TYPES = {"mixtral": MIXTRAL, "qwen2_moe": QWEN2, "qwen3_moe": QWEN3}
_MODEL_TYPE = {v: k for k, v in MOE_MODEL_TYPES.items()}
EXPERT_LAYOUTS = ("hub", "fused")


# ---------------------------------------------------------------------------------------------------- configs
def _common_problems(c: TransformerConfig, moe: MoEConfig) -> list[str]:
    p = []
    if (c.position_embedding, c.normalization, c.activation) != ("rope", "rmsnorm", "swiglu"):
        p.append(
            f"position_embedding={c.position_embedding}, normalization={c.normalization}, "
            f"activation={c.activation} (needs rope, rmsnorm, swiglu)"
        )
    if c.rotary_percent != 1.0:
        p.append(f"rotary_percent={c.rotary_percent} (HF rotates the whole head)")
    if c.rope_scaling is not None:
        p.append("rope_scaling (only plain RoPE is exported for MoE models)")
    if moe.router_score_function != "softmax":
        p.append(f"moe.router_score_function={moe.router_score_function!r} (HF routes by softmax)")
    if moe.router_topk_scaling_factor not in (None, 1.0):
        p.append(f"moe.router_topk_scaling_factor={moe.router_topk_scaling_factor} (HF does not scale)")
    if moe.router_num_groups is not None:
        p.append("moe.router_num_groups / router_group_topk (HF has no group-limited routing)")
    if moe.router_enable_expert_bias:
        p.append("moe.router_enable_expert_bias (the router's expert_bias has no HF equivalent)")
    return p


def _guess_architecture(c: TransformerConfig, moe: MoEConfig) -> str:
    hint = c.extra.get("hf_architecture")
    if hint in MOE_ARCHITECTURES:
        return str(hint)
    if moe.shared_expert_ffn_hidden_size is not None or c.add_qkv_bias:
        return QWEN2
    if c.qk_layernorm:
        return QWEN3
    return MIXTRAL


def moe_architecture(config: TransformerConfig) -> str:
    """``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` or ``Qwen3MoeForCausalLM`` (the imported one, recorded in
    ``extra["hf_architecture"]``, else the one the config's features point to), or a ConversionError naming every
    feature that class cannot represent."""
    c, moe = config, config.moe
    if moe is None:
        raise ConversionError("the config has no moe section: not a mixture-of-experts model")
    arch = _guess_architecture(c, moe)
    p = _common_problems(c, moe)
    shared = moe.shared_expert_ffn_hidden_size is not None
    if arch == MIXTRAL:
        p += [f for f, bad in (
            ("qk_layernorm (Mixtral has no query/key normalisation)", c.qk_layernorm),
            ("add_qkv_bias (Mixtral's attention has no biases)", c.add_qkv_bias),
            ("moe.shared_expert_ffn_hidden_size (Mixtral has no shared expert)", shared),
            ("moe.router_pre_softmax=True (Mixtral always renormalises the top-k probabilities)",
             moe.router_pre_softmax),
            ("dense layers in moe.layer_freq (every Mixtral layer is MoE)",
             not all(moe.is_moe_layer(i) for i in range(c.num_layers))),
        ) if bad]  # fmt: skip
    elif arch == QWEN2:
        if c.qk_layernorm:
            p.append("qk_layernorm (Qwen2-MoE has no query/key normalisation; Qwen3-MoE has)")
        if not shared or not moe.shared_expert_gate:
            p.append("no gated shared expert (Qwen2-MoE needs moe.shared_expert_ffn_hidden_size and "
                     "moe.shared_expert_gate=True)")  # fmt: skip
    else:
        if not c.qk_layernorm:
            p.append("qk_layernorm=False (Qwen3-MoE always normalises queries and keys)")
        if c.add_qkv_bias:
            p.append("add_qkv_bias (Qwen3-MoE's attention_bias also biases o_proj)")
        if shared:
            p.append("moe.shared_expert_ffn_hidden_size (Qwen3-MoE has no shared expert)")
    if p:
        raise ConversionError(f"{arch} cannot represent: " + "; ".join(p))
    return arch


def hf_moe_layers(decoder_sparse_step: int, mlp_only_layers: list[int], num_layers: int) -> list[int]:
    """HF Qwen's rule: layer ``i`` is sparse iff not in ``mlp_only_layers`` and ``(i + 1) % step == 0``."""
    return [int(i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0) for i in range(num_layers)]


def _sparse_step(flags: list[int]) -> tuple[int, list[int]]:
    """``(decoder_sparse_step, mlp_only_layers)`` giving ``flags``: a step alone if one does, else step 1 + list."""
    n = len(flags)
    for step in range(1, n + 1):
        if hf_moe_layers(step, [], n) == flags:
            return step, []
    return 1, [i for i, f in enumerate(flags) if not f]


def moe_config_to_hf(config: TransformerConfig) -> dict[str, Any]:
    """The HF ``config.json`` fields of an MoE config (raises ConversionError naming what HF cannot represent)."""
    arch = moe_architecture(config)
    c, moe = config, config.moe
    assert moe is not None
    if moe.capacity_factor is not None:
        logger.warning("moe.capacity_factor=%s is not exported: HF MoE layers are dropless", moe.capacity_factor)
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": _MODEL_TYPE[arch],
        **_hf.rope_body_to_hf(c),
        "num_experts_per_tok": moe.router_topk,
        "router_aux_loss_coef": moe.aux_loss_coeff,
    }
    expert_ffn = moe.expert_ffn(c.ffn_size)
    if arch == MIXTRAL:
        return {**out, "num_local_experts": moe.num_experts, "intermediate_size": expert_ffn, "sliding_window": None,
                "router_jitter_noise": moe.input_jitter_eps or 0.0}  # fmt: skip
    if moe.input_jitter_eps is not None:
        logger.warning("moe.input_jitter_eps=%s is not exported: %s has no router jitter", moe.input_jitter_eps, arch)
    step, mlp_only = _sparse_step([int(moe.is_moe_layer(i)) for i in range(c.num_layers)])
    out.update(
        num_experts=moe.num_experts,
        moe_intermediate_size=expert_ffn,
        intermediate_size=c.ffn_size,
        norm_topk_prob=not moe.router_pre_softmax,
        decoder_sparse_step=step,
        mlp_only_layers=mlp_only,
        use_sliding_window=False,
    )
    if arch == QWEN2:
        out.update(shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size, qkv_bias=c.add_qkv_bias)
    else:
        out["attention_bias"] = False
    return out


def _rope_theta(hf: dict[str, Any], default: float) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or (params if "rope_type" in params else None)
    kind = None if not scaling else scaling.get("rope_type", scaling.get("type"))
    if kind not in (None, "default"):
        raise ConversionError(f"rope_scaling type {kind!r} is not supported for MoE models (only plain RoPE)")
    return float(hf.get("rope_theta") or params.get("rope_theta") or default)


def _hf_arch(hf: dict[str, Any]) -> str:
    arch = (hf.get("architectures") or [None])[0]
    if arch in MOE_ARCHITECTURES:
        return str(arch)
    if arch is None and hf.get("model_type") in MOE_MODEL_TYPES:
        return MOE_MODEL_TYPES[hf["model_type"]]
    raise ConversionError(f"architecture {arch!r} is not one of {', '.join(MOE_ARCHITECTURES)}")


def _moe_from_hf(arch: str, hf: dict[str, Any], num_layers: int) -> MoEConfig:
    """The MoEConfig of an HF MoE config; refuses settings mcore's layer cannot reproduce, naming the field."""
    common: dict[str, Any] = dict(router_topk=hf["num_experts_per_tok"],
                                  aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))  # fmt: skip
    if arch == MIXTRAL:
        if hf.get("sliding_window") is not None:
            raise ConversionError(f"sliding_window={hf['sliding_window']}: mcore has no sliding-window attention "
                                  "(set it to null if the model never sees longer sequences)")  # fmt: skip
        jitter = hf.get("router_jitter_noise") or 0.0
        return MoEConfig(num_experts=hf["num_local_experts"], ffn_hidden_size=hf["intermediate_size"],
                         input_jitter_eps=jitter or None, **common)  # fmt: skip
    if hf.get("use_sliding_window"):
        raise ConversionError("use_sliding_window=True: mcore has no sliding-window attention")
    experts = hf["num_experts"] if "num_experts" in hf else hf.get("num_local_experts")  # transformers 5 (Qwen3)
    if not experts:
        raise ConversionError(f"num_experts={hf.get('num_experts')!r}: a dense model, not mixture of experts")
    flags = hf_moe_layers(hf.get("decoder_sparse_step") or 1, list(hf.get("mlp_only_layers") or []), num_layers)
    shared: dict[str, Any] = {}
    if arch == QWEN2:
        size = hf.get("shared_expert_intermediate_size")
        if not size:
            raise ConversionError(f"shared_expert_intermediate_size={size!r} must be positive")
        shared = dict(shared_expert_ffn_hidden_size=size, shared_expert_gate=True)
    return MoEConfig(
        num_experts=experts,
        ffn_hidden_size=hf["moe_intermediate_size"],
        layer_freq=1 if all(flags) else flags,
        router_pre_softmax=not hf.get("norm_topk_prob", False),
        **shared,
        **common,
    )


def moe_config_from_hf(hf: dict[str, Any], **overrides: Any) -> TransformerConfig:
    """The TransformerConfig of an HF Mixtral / Qwen2-MoE / Qwen3-MoE ``config.json``; ``overrides`` replace fields."""
    arch = _hf_arch(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) experts are supported")
    if arch == QWEN3 and hf.get("attention_bias"):
        raise ConversionError("attention_bias=True is not supported (mcore biases q/k/v only, not o_proj)")
    fields: dict[str, Any] = dict(
        _hf.rope_body_from_hf(hf, _rope_theta(hf, 1e6 if arch == MIXTRAL else 10000.0)),
        add_qkv_bias=arch == QWEN2 and bool(hf.get("qkv_bias", True)),
        qk_layernorm=arch == QWEN3,
        moe=_moe_from_hf(arch, hf, hf["num_hidden_layers"]),
        extra={"hf_architecture": arch},
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


# ---------------------------------------------------------------------------------------------- state dicts
def _attention_to_hf(c: TransformerConfig, i: int, get: _hf.Getter) -> Iterator[tuple[str, torch.Tensor]]:
    m, h = f"decoder.layers.{i}", f"model.layers.{i}"
    a = f"{m}.self_attention"
    yield f"{h}.input_layernorm.weight", get(f"{m}.input_layernorm.weight")
    q, k, v = _hf._split_qkv(get(f"{a}.linear_qkv.weight"), c)
    yield from ((f"{h}.self_attn.{n}_proj.weight", t) for n, t in zip("qkv", (q, k, v)))
    del q, k, v  # streaming: drop the fused tensor before the next read
    if c.add_qkv_bias:
        qb, kb, vb = _hf._split_qkv(get(f"{a}.linear_qkv.bias"), c)
        yield from ((f"{h}.self_attn.{n}_proj.bias", t) for n, t in zip("qkv", (qb, kb, vb)))
    yield f"{h}.self_attn.o_proj.weight", get(f"{a}.linear_proj.weight")
    if c.qk_layernorm:
        yield f"{h}.self_attn.q_norm.weight", get(f"{a}.q_layernorm.weight")
        yield f"{h}.self_attn.k_norm.weight", get(f"{a}.k_layernorm.weight")
    yield f"{h}.post_attention_layernorm.weight", get(f"{m}.pre_mlp_layernorm.weight")


def _attention_to_mcore(c: TransformerConfig, i: int, get: _hf.Getter) -> Iterator[tuple[str, torch.Tensor]]:
    m, h = f"decoder.layers.{i}", f"model.layers.{i}"
    a = f"{m}.self_attention"
    yield f"{m}.input_layernorm.weight", get(f"{h}.input_layernorm.weight")
    q, k, v = (get(f"{h}.self_attn.{n}_proj.weight") for n in "qkv")
    yield f"{a}.linear_qkv.weight", _hf._fuse_qkv(q, k, v, c)
    if c.add_qkv_bias:
        qb, kb, vb = (get(f"{h}.self_attn.{n}_proj.bias") for n in "qkv")
        yield f"{a}.linear_qkv.bias", _hf._fuse_qkv(qb, kb, vb, c)
    yield f"{a}.linear_proj.weight", get(f"{h}.self_attn.o_proj.weight")
    if c.qk_layernorm:
        yield f"{a}.q_layernorm.weight", get(f"{h}.self_attn.q_norm.weight")
        yield f"{a}.k_layernorm.weight", get(f"{h}.self_attn.k_norm.weight")
    yield f"{m}.pre_mlp_layernorm.weight", get(f"{h}.post_attention_layernorm.weight")


def _names(arch: str) -> tuple[str, str, str, str]:
    """The hub layout's MoE block name and its gate / up / down projection names."""
    return ("block_sparse_moe", "w1", "w3", "w2") if arch == MIXTRAL else ("mlp", "gate_proj", "up_proj", "down_proj")


def _dense_mlp(src: str, dst: str, get: _hf.Getter, to_hf: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """A SwiGLU MLP: mcore ``{src|dst}.linear_fc1`` ``[gate; up]`` / ``linear_fc2`` and HF gate/up/down_proj."""
    if to_hf:
        gate, up = get(f"{src}.linear_fc1.weight").chunk(2, dim=0)
        yield f"{dst}.gate_proj.weight", gate
        yield f"{dst}.up_proj.weight", up
        del gate, up
        yield f"{dst}.down_proj.weight", get(f"{src}.linear_fc2.weight")
    else:
        yield f"{dst}.linear_fc1.weight", torch.cat([get(f"{src}.gate_proj.weight"), get(f"{src}.up_proj.weight")])
        yield f"{dst}.linear_fc2.weight", get(f"{src}.down_proj.weight")


def _experts_to_hf(arch: str, c: TransformerConfig, i: int, get: _hf.Getter, layout: str
                   ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    m, h = f"decoder.layers.{i}.mlp", f"model.layers.{i}"
    block, w_gate, w_up, w_down = _names(arch)
    block = block if layout == "hub" else "mlp"
    yield f"{h}.{block}.gate.weight", get(f"{m}.router.weight")
    if layout == "fused":
        yield f"{h}.mlp.experts.gate_up_proj", get(f"{m}.experts.linear_fc1.weight")
        yield f"{h}.mlp.experts.down_proj", get(f"{m}.experts.linear_fc2.weight")
    else:
        gate, up = get(f"{m}.experts.linear_fc1.weight").chunk(2, dim=1)
        for e in range(gate.shape[0]):
            yield f"{h}.{block}.experts.{e}.{w_gate}.weight", gate[e]
            yield f"{h}.{block}.experts.{e}.{w_up}.weight", up[e]
        del gate, up
        down = get(f"{m}.experts.linear_fc2.weight")
        for e in range(down.shape[0]):
            yield f"{h}.{block}.experts.{e}.{w_down}.weight", down[e]
        del down
    if arch == QWEN2:
        yield from _dense_mlp(f"{m}.shared_experts", f"{h}.mlp.shared_expert", get, to_hf=True)
        yield f"{h}.mlp.shared_expert_gate.weight", get(f"{m}.shared_experts.gate.weight")


def _stacked(get: _hf.Getter, names: list[list[str]], fused: str) -> torch.Tensor:
    """``[E, ...]``: per expert the hub tensors ``names[e]`` concatenated, or the ``fused`` tensor when the first
    hub tensor is missing (re-raising the hub layout's KeyError when neither is there)."""
    try:
        first = get(names[0][0])
    except KeyError as hub_missing:
        try:
            return get(fused)
        except KeyError:
            raise hub_missing from None
    parts = [[first if (e, j) == (0, 0) else get(n) for j, n in enumerate(row)] for e, row in enumerate(names)]
    return torch.stack([torch.cat(row) for row in parts])


def _first_of(get: _hf.Getter, *keys: str) -> torch.Tensor:
    """The first of ``keys`` the source has (the first key's KeyError when none)."""
    try:
        return get(keys[0])
    except KeyError as first_missing:
        for key in keys[1:]:
            try:
                return get(key)
            except KeyError:
                pass
        raise first_missing from None


def _experts_to_mcore(arch: str, c: TransformerConfig, i: int, get: _hf.Getter
                      ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    assert c.moe is not None
    m, h = f"decoder.layers.{i}.mlp", f"model.layers.{i}"
    block, w_gate, w_up, w_down = _names(arch)
    experts = f"{h}.{block}.experts"
    yield f"{m}.router.weight", _first_of(get, f"{h}.{block}.gate.weight", f"{h}.mlp.gate.weight")
    n = range(c.moe.num_experts)
    fc1 = [[f"{experts}.{e}.{w_gate}.weight", f"{experts}.{e}.{w_up}.weight"] for e in n]
    yield f"{m}.experts.linear_fc1.weight", _stacked(get, fc1, f"{h}.mlp.experts.gate_up_proj")
    fc2 = [[f"{experts}.{e}.{w_down}.weight"] for e in n]
    yield f"{m}.experts.linear_fc2.weight", _stacked(get, fc2, f"{h}.mlp.experts.down_proj")
    if arch == QWEN2:
        yield from _dense_mlp(f"{h}.mlp.shared_expert", f"{m}.shared_experts", get, to_hf=False)
        yield f"{m}.shared_experts.gate.weight", get(f"{h}.mlp.shared_expert_gate.weight")


def moe_mcore_to_hf(config: TransformerConfig, get: _hf.Getter, expert_layout: str = "hub"
                    ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """Yield ``(hf_key, tensor)`` for every tensor of the HF MoE model, reading mcore global tensors via ``get``;
    ``expert_layout`` is ``hub`` (per-expert tensors, as ``save_pretrained`` writes) or ``fused``."""
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout={expert_layout!r} is not one of {', '.join(EXPERT_LAYOUTS)}")
    arch = moe_architecture(config)
    c, moe = config, config.moe
    assert moe is not None
    yield "model.embed_tokens.weight", get("embedding.word_embeddings.weight")
    for i in range(c.num_layers):
        yield from _attention_to_hf(c, i, get)
        if moe.is_moe_layer(i):
            yield from _experts_to_hf(arch, c, i, get, expert_layout)
        else:
            yield from _dense_mlp(f"decoder.layers.{i}.mlp", f"model.layers.{i}.mlp", get, to_hf=True)
    yield "model.norm.weight", get("decoder.final_layernorm.weight")
    if not c.share_embeddings_and_output_weights:
        yield "lm_head.weight", get("output_layer.weight")


def moe_hf_to_mcore(config: TransformerConfig, get: _hf.Getter) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(mcore_key, global tensor)`` for every mcore parameter, reading HF tensors (either expert layout,
    decided per layer by which keys exist; a missing key raises the getter's KeyError) via ``get``."""
    arch = moe_architecture(config)
    c, moe = config, config.moe
    assert moe is not None
    yield "embedding.word_embeddings.weight", get("model.embed_tokens.weight")
    for i in range(c.num_layers):
        yield from _attention_to_mcore(c, i, get)
        if moe.is_moe_layer(i):
            yield from _experts_to_mcore(arch, c, i, get)
        else:
            yield from _dense_mlp(f"model.layers.{i}.mlp", f"decoder.layers.{i}.mlp", get, to_hf=False)
    yield "decoder.final_layernorm.weight", get("model.norm.weight")
    if not c.share_embeddings_and_output_weights:
        yield "output_layer.weight", get("lm_head.weight")
