"""Converters between mcore's global state dict and Hugging Face Llama / GPT-2 layouts, in one place.

Configs with ``moe`` (Mixtral, Qwen2-MoE, Qwen3-MoE) are handled by :mod:`mcore_models.hf_moe`, configs with a
``hybrid_pattern`` (Mamba-2, NemotronH) by :mod:`mcore_models.hf_ssm`; ``hf_architecture``, ``mcore_to_hf`` and
``hf_to_mcore`` dispatch there.

Both directions work tensor by tensor (``get`` returns one global tensor by key), so exporters can stream a
checkpoint without holding more than one tensor. Configs convert both ways too. Features a Hugging Face class
cannot represent are refused with :class:`~mcore_models.errors.ConversionError` naming the feature.

Layouts handled here:
- mcore's fused QKV is grouped (per key/value group: its query heads, key, value); HF Llama has separate
  ``q_proj``/``k_proj``/``v_proj``; HF GPT-2 has one ``c_attn`` with all queries, then all keys, then all values, as a
  ``Conv1D`` (weights stored ``[in, out]``).
- mcore's SwiGLU ``linear_fc1`` is ``[gate; up]``; HF Llama has ``gate_proj`` and ``up_proj``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from mcore_models.config import RopeScaling, TransformerConfig
from mcore_models.errors import ConversionError

__all__ = [
    "llama_config_from_hf",
    "llama_config_to_hf",
    "gpt2_config_from_hf",
    "gpt2_config_to_hf",
    "mcore_to_hf",
    "hf_to_mcore",
    "hf_architecture",
]

Getter = Callable[[str], torch.Tensor]


# ---------------------------------------------------------------------------------------------------- configs
def hf_architecture(config: TransformerConfig) -> str:
    """``LlamaForCausalLM`` or ``GPT2LMHeadModel`` (for an MoE config: ``Mixtral``/``Qwen2Moe``/``Qwen3Moe`` +
    ``ForCausalLM``; with a ``hybrid_pattern``: ``Mamba2ForCausalLM`` or ``NemotronHForCausalLM``), or a
    ConversionError naming what the class cannot represent."""
    c = config
    if not c.attention_causal:
        raise ConversionError("attention_causal=False: the Hugging Face decoder classes attend causally")
    if c.hybrid_pattern is not None:
        from mcore_models.hf_ssm import ssm_architecture  # hf_ssm builds on this module

        return ssm_architecture(c)
    if c.moe is not None:
        from mcore_models.hf_moe import moe_architecture  # hf_moe builds on this module

        return moe_architecture(c)
    if c.position_embedding == "rope" and c.normalization == "rmsnorm" and c.activation == "swiglu":
        problems = []
        if c.qk_layernorm:
            problems.append("qk_layernorm (HF Llama has no query/key normalisation)")
        if c.add_bias_linear:
            problems.append("add_bias_linear (HF Llama has no MLP biases)")
        if c.add_qkv_bias:
            problems.append("add_qkv_bias (HF Llama's attention_bias also biases o_proj; that is Qwen-2's layout)")
        if c.rotary_percent != 1.0:
            problems.append(f"rotary_percent={c.rotary_percent} (HF Llama rotates the whole head)")
        if problems:
            raise ConversionError("LlamaForCausalLM cannot represent: " + "; ".join(problems))
        return "LlamaForCausalLM"
    if c.position_embedding == "learned_absolute" and c.normalization == "layernorm":
        problems = []
        if c.activation not in ("gelu", "gelu_tanh"):
            problems.append(f"activation={c.activation} (GPT-2 uses gelu)")
        if not c.add_bias_linear:
            problems.append("add_bias_linear=False (GPT-2 has biases everywhere)")
        if c.query_groups != c.num_attention_heads:
            problems.append("grouped-query attention (GPT-2 is multi-head only)")
        if c.qk_layernorm:
            problems.append("qk_layernorm")
        if not c.share_embeddings_and_output_weights:
            problems.append("untied output layer (GPT2LMHeadModel ties it to the embedding)")
        if c.head_dim * c.num_attention_heads != c.hidden_size:
            problems.append("kv_channels * heads != hidden_size")
        if c.ffn_size != 4 * c.hidden_size:
            problems.append(f"ffn_hidden_size={c.ffn_size} (GPT-2 uses 4 * hidden_size)")
        if problems:
            raise ConversionError("GPT2LMHeadModel cannot represent: " + "; ".join(problems))
        return "GPT2LMHeadModel"
    raise ConversionError(
        f"no Hugging Face class for position_embedding={c.position_embedding}, normalization={c.normalization}, "
        f"activation={c.activation}; supported: Llama (rope+rmsnorm+swiglu) and GPT-2 (learned+layernorm+gelu)"
    )


def rope_body_to_hf(c: TransformerConfig) -> dict[str, Any]:
    """The ``config.json`` fields every RoPE + RMSNorm + SwiGLU HF decoder states the same way (the inverse of
    :func:`rope_body_from_hf`)."""
    return {
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.query_groups,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rotary_base,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": c.share_embeddings_and_output_weights,
        "attention_dropout": c.attention_dropout,
        "initializer_range": c.init_method_std,
    }


def llama_config_to_hf(config: TransformerConfig) -> dict[str, Any]:
    hf_architecture(config)
    c = config
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **rope_body_to_hf(c),
        "intermediate_size": c.ffn_size,
        "attention_bias": False,
        "mlp_bias": False,
    }
    if c.rope_scaling is not None:
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": c.rope_scaling.factor,
            "low_freq_factor": c.rope_scaling.low_freq_factor,
            "high_freq_factor": c.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": c.rope_scaling.original_max_position_embeddings,
        }
    return out


def rope_body_from_hf(hf: dict[str, Any], rotary_base: float) -> dict[str, Any]:
    """The TransformerConfig fields every RoPE + RMSNorm + SwiGLU HF decoder (Llama, Mixtral, Qwen) states the same
    way: sizes, heads, norm epsilon, positions, vocabulary, tied embeddings, init."""
    heads = hf["num_attention_heads"]
    return dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"],
        activation="swiglu",
        normalization="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        add_bias_linear=False,
        position_embedding="rope",
        rotary_base=rotary_base,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        vocab_size=hf["vocab_size"],
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        init_method_std=hf.get("initializer_range", 0.02),
    )


def llama_config_from_hf(hf: dict[str, Any], **overrides: Any) -> TransformerConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) Llama models are supported")
    for flag in ("mlp_bias", "attention_bias"):
        if hf.get(flag, False):
            raise ConversionError(f"{flag}=True is not supported (mcore's Llama layout has no such biases)")
    scaling = hf.get("rope_scaling") or (
        hf.get("rope_parameters") if "rope_type" in (hf.get("rope_parameters") or {}) else None
    )
    rope = None
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        if scaling.get("rope_type", scaling.get("type")) != "llama3":
            raise ConversionError(f"rope_scaling type {scaling.get('rope_type')!r} is not supported (only llama3)")
        rope = RopeScaling(
            factor=scaling["factor"],
            low_freq_factor=scaling["low_freq_factor"],
            high_freq_factor=scaling["high_freq_factor"],
            original_max_position_embeddings=scaling["original_max_position_embeddings"],
        )
    theta = hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    fields: dict[str, Any] = dict(
        rope_body_from_hf(hf, float(theta)),
        rope_scaling=rope,
        extra={"hf_architecture": "LlamaForCausalLM"},
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def gpt2_config_to_hf(config: TransformerConfig) -> dict[str, Any]:
    hf_architecture(config)
    c = config
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": c.hidden_size,
        "n_layer": c.num_layers,
        "n_head": c.num_attention_heads,
        "n_inner": c.ffn_size,
        "n_positions": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "activation_function": "gelu_new" if c.activation == "gelu_tanh" else "gelu",
        "layer_norm_epsilon": c.norm_eps,
        "tie_word_embeddings": True,
        "initializer_range": c.init_method_std,
        "attn_pdrop": c.attention_dropout,
        "resid_pdrop": c.hidden_dropout,
        "embd_pdrop": c.hidden_dropout,
    }


def gpt2_config_from_hf(hf: dict[str, Any], **overrides: Any) -> TransformerConfig:
    act = hf.get("activation_function", "gelu_new")
    acts = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    if act not in acts:
        raise ConversionError(f"activation_function={act!r} is not supported; use one of {sorted(acts)}")
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
        raise ConversionError("scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported")
    h = hf["n_embd"]
    fields: dict[str, Any] = dict(
        num_layers=hf["n_layer"],
        hidden_size=h,
        num_attention_heads=hf["n_head"],
        ffn_hidden_size=hf.get("n_inner") or 4 * h,
        activation=acts[act],
        normalization="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        add_bias_linear=True,
        position_embedding="learned_absolute",
        max_position_embeddings=hf.get("n_positions", 1024),
        vocab_size=hf["vocab_size"],
        share_embeddings_and_output_weights=True,
        init_method_std=hf.get("initializer_range", 0.02),
        extra={"hf_architecture": "GPT2LMHeadModel"},
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


# ---------------------------------------------------------------------------------------------------- QKV
def _split_qkv(fused: torch.Tensor, c: TransformerConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = c.query_groups, c.head_dim
    per = c.num_attention_heads // g
    t = fused.reshape(g, per + 2, d, *fused.shape[1:])
    q = t[:, :per].reshape(g * per * d, *fused.shape[1:])
    return q, t[:, per].reshape(g * d, *fused.shape[1:]), t[:, per + 1].reshape(g * d, *fused.shape[1:])


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: TransformerConfig) -> torch.Tensor:
    g, d = c.query_groups, c.head_dim
    per = c.num_attention_heads // g
    rest = q.shape[1:]
    qg = q.reshape(g, per, d, *rest)
    return torch.cat([qg, k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)], dim=1).reshape(-1, *rest)


# ---------------------------------------------------------------------------------------------- state dicts
def _layer_map_llama(c: TransformerConfig, i: int) -> list[tuple[str, str]]:
    m, h = f"decoder.layers.{i}", f"model.layers.{i}"
    return [
        (f"{m}.input_layernorm.weight", f"{h}.input_layernorm.weight"),
        (f"{m}.self_attention.linear_proj.weight", f"{h}.self_attn.o_proj.weight"),
        (f"{m}.pre_mlp_layernorm.weight", f"{h}.post_attention_layernorm.weight"),
        (f"{m}.mlp.linear_fc2.weight", f"{h}.mlp.down_proj.weight"),
    ]


def mcore_to_hf(
    config: TransformerConfig, get: Getter, *, expert_layout: str = "hub"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_key, tensor)`` for every tensor of the HF model, reading mcore global tensors via ``get``.
    ``expert_layout`` (MoE models only): ``hub`` (per-expert tensors, as ``save_pretrained`` writes) or ``fused``
    (the ``transformers`` module's own ``experts.gate_up_proj`` / ``down_proj``)."""
    arch = hf_architecture(config)
    c = config
    if c.hybrid_pattern is not None:
        from mcore_models.hf_ssm import ssm_mcore_to_hf

        yield from ssm_mcore_to_hf(c, get)
        return
    if c.moe is not None:
        from mcore_models.hf_moe import moe_mcore_to_hf

        yield from moe_mcore_to_hf(c, get, expert_layout)
        return
    if arch == "LlamaForCausalLM":
        yield "model.embed_tokens.weight", get("embedding.word_embeddings.weight")
        for i in range(c.num_layers):
            for mk, hk in _layer_map_llama(c, i):
                yield hk, get(mk)
            m, h = f"decoder.layers.{i}", f"model.layers.{i}.self_attn"
            q, k, v = _split_qkv(get(f"{m}.self_attention.linear_qkv.weight"), c)
            yield f"{h}.q_proj.weight", q
            yield f"{h}.k_proj.weight", k
            yield f"{h}.v_proj.weight", v
            del q, k, v  # streaming: drop the fused tensor before the next read
            gate, up = get(f"{m}.mlp.linear_fc1.weight").chunk(2, dim=0)
            yield f"model.layers.{i}.mlp.gate_proj.weight", gate
            yield f"model.layers.{i}.mlp.up_proj.weight", up
            del gate, up
        yield "model.norm.weight", get("decoder.final_layernorm.weight")
        if not c.share_embeddings_and_output_weights:
            yield "lm_head.weight", get("output_layer.weight")
        return
    yield "transformer.wte.weight", get("embedding.word_embeddings.weight")
    yield "transformer.wpe.weight", get("embedding.position_embeddings.weight")
    for i in range(c.num_layers):
        m, h = f"decoder.layers.{i}", f"transformer.h.{i}"
        for mk, hk in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            yield f"{h}.{hk}.weight", get(f"{m}.{mk}.weight")
            yield f"{h}.{hk}.bias", get(f"{m}.{mk}.bias")
        q, k, v = _split_qkv(get(f"{m}.self_attention.linear_qkv.weight"), c)
        yield f"{h}.attn.c_attn.weight", torch.cat([q, k, v], dim=0).t().contiguous()
        del q, k, v  # streaming: drop the fused tensor before the next read
        qb, kb, vb = _split_qkv(get(f"{m}.self_attention.linear_qkv.bias"), c)
        yield f"{h}.attn.c_attn.bias", torch.cat([qb, kb, vb])
        del qb, kb, vb
        yield f"{h}.attn.c_proj.weight", get(f"{m}.self_attention.linear_proj.weight").t().contiguous()
        yield f"{h}.attn.c_proj.bias", get(f"{m}.self_attention.linear_proj.bias")
        yield f"{h}.mlp.c_fc.weight", get(f"{m}.mlp.linear_fc1.weight").t().contiguous()
        yield f"{h}.mlp.c_fc.bias", get(f"{m}.mlp.linear_fc1.bias")
        yield f"{h}.mlp.c_proj.weight", get(f"{m}.mlp.linear_fc2.weight").t().contiguous()
        yield f"{h}.mlp.c_proj.bias", get(f"{m}.mlp.linear_fc2.bias")
    yield "transformer.ln_f.weight", get("decoder.final_layernorm.weight")
    yield "transformer.ln_f.bias", get("decoder.final_layernorm.bias")


def hf_to_mcore(config: TransformerConfig, get: Getter) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(mcore_key, global tensor)`` for every mcore parameter, reading HF tensors via ``get``."""
    arch = hf_architecture(config)
    c = config
    if c.hybrid_pattern is not None:
        from mcore_models.hf_ssm import ssm_hf_to_mcore

        yield from ssm_hf_to_mcore(c, get)
        return
    if c.moe is not None:
        from mcore_models.hf_moe import moe_hf_to_mcore

        yield from moe_hf_to_mcore(c, get)
        return
    if arch == "LlamaForCausalLM":
        yield "embedding.word_embeddings.weight", get("model.embed_tokens.weight")
        for i in range(c.num_layers):
            for mk, hk in _layer_map_llama(c, i):
                yield mk, get(hk)
            m, h = f"decoder.layers.{i}", f"model.layers.{i}.self_attn"
            q, k, v = (get(f"{h}.{p}_proj.weight") for p in "qkv")
            yield f"{m}.self_attention.linear_qkv.weight", _fuse_qkv(q, k, v, c)
            mlp = f"model.layers.{i}.mlp"
            yield (
                f"{m}.mlp.linear_fc1.weight",
                torch.cat([get(f"{mlp}.gate_proj.weight"), get(f"{mlp}.up_proj.weight")]),
            )
        yield "decoder.final_layernorm.weight", get("model.norm.weight")
        if not c.share_embeddings_and_output_weights:
            yield "output_layer.weight", get("lm_head.weight")
        return
    h_size = c.hidden_size
    yield "embedding.word_embeddings.weight", get("transformer.wte.weight")
    yield "embedding.position_embeddings.weight", get("transformer.wpe.weight")
    for i in range(c.num_layers):
        m, h = f"decoder.layers.{i}", f"transformer.h.{i}"
        for mk, hk in (("input_layernorm", "ln_1"), ("pre_mlp_layernorm", "ln_2")):
            yield f"{m}.{mk}.weight", get(f"{h}.{hk}.weight")
            yield f"{m}.{mk}.bias", get(f"{h}.{hk}.bias")
        q, k, v = get(f"{h}.attn.c_attn.weight").t().split(h_size, dim=0)
        yield f"{m}.self_attention.linear_qkv.weight", _fuse_qkv(q, k, v, c).contiguous()
        qb, kb, vb = get(f"{h}.attn.c_attn.bias").split(h_size)
        yield f"{m}.self_attention.linear_qkv.bias", _fuse_qkv(qb, kb, vb, c)
        yield f"{m}.self_attention.linear_proj.weight", get(f"{h}.attn.c_proj.weight").t().contiguous()
        yield f"{m}.self_attention.linear_proj.bias", get(f"{h}.attn.c_proj.bias")
        yield f"{m}.mlp.linear_fc1.weight", get(f"{h}.mlp.c_fc.weight").t().contiguous()
        yield f"{m}.mlp.linear_fc1.bias", get(f"{h}.mlp.c_fc.bias")
        yield f"{m}.mlp.linear_fc2.weight", get(f"{h}.mlp.c_proj.weight").t().contiguous()
        yield f"{m}.mlp.linear_fc2.bias", get(f"{h}.mlp.c_proj.bias")
    yield "decoder.final_layernorm.weight", get("transformer.ln_f.weight")
    yield "decoder.final_layernorm.bias", get("transformer.ln_f.bias")
