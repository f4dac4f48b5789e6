"""Tiny Hugging Face Mixtral, Qwen2-MoE and Qwen3-MoE configs and models (random weights) shared by the MoE
converter tests (``tests/models/test_hf_moe.py``) and the export tests (``tests/export/test_hf_moe.py``)."""

from __future__ import annotations

from typing import Any

import torch

from mcore_models import TransformerConfig
from mcore_models.hf_moe import moe_config_from_hf

_ATTN: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=50000.0,
)
_MIX = dict(_ATTN, intermediate_size=32, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
_QWEN = dict(_ATTN, intermediate_size=48, moe_intermediate_size=32, num_experts_per_tok=2)
_Q2 = dict(_QWEN, shared_expert_intermediate_size=40)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("mixtral", _MIX),
    "mixtral-tied-top1": ("mixtral", dict(_MIX, num_experts_per_tok=1, tie_word_embeddings=True)),
    "qwen2-moe-step2": (
        "qwen2_moe",
        dict(_Q2, num_hidden_layers=4, num_experts=8, decoder_sparse_step=2, norm_topk_prob=False),
    ),
    "qwen2-moe-mlp-only-norm": (
        "qwen2_moe",
        dict(_Q2, num_hidden_layers=3, num_experts=4, mlp_only_layers=[0], norm_topk_prob=True),
    ),
    "qwen3-moe": (
        "qwen3_moe",
        dict(_QWEN, num_hidden_layers=3, head_dim=32, num_experts=8, norm_topk_prob=True, mlp_only_layers=[1]),
    ),
    "qwen3-moe-no-norm": ("qwen3_moe", dict(_QWEN, num_hidden_layers=2, num_experts=4, norm_topk_prob=False)),
}
CONFIG_CLASSES = {"mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig"}


def _transformers() -> Any:
    import transformers

    return transformers


def hf_config(name: str) -> Any:
    model_type, kw = CASES[name]
    return getattr(_transformers(), CONFIG_CLASSES[model_type])(**kw)


def hf_model(name: str) -> torch.nn.Module:
    """An HF model of case ``name`` with every parameter random (norms around 1), float32, in eval mode."""
    model = _transformers().AutoModelForCausalLM.from_config(hf_config(name))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0, 0.2 if p.dim() == 1 else 0.08)
            if p.dim() == 1 and "norm" in n:
                p.add_(1.0)
    return model.eval()


def mcore_config(name: str) -> TransformerConfig:
    return moe_config_from_hf(hf_config(name).to_dict())
