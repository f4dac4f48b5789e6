"""Tiny Hugging Face Mamba-2 and NemotronH configs and models (random weights, float32) and native mcore hybrid
configs, shared by the converter tests (``tests/models/test_hf_ssm.py``) and the export tests
(``tests/export/test_hf_ssm.py``).

The sequences the tests feed (21 tokens) are not a multiple of the chunk size (8): several chunks and a padded one.
Random ``dt_bias`` (about N(0, 0.2)) gives time steps around 0.7, so the cases' clamps (Mamba-2's
``time_step_limit``, from below only for NemotronH) change some of them.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_models import TransformerConfig
from mcore_models.hf_ssm import ssm_config_from_hf
from mcore_models.mamba_config import MambaConfig

_MAMBA2: dict[str, Any] = dict(
    vocab_size=97, hidden_size=64, head_dim=16, num_heads=8, state_size=16, chunk_size=8, layer_norm_epsilon=1e-5
)
_NEMOTRON: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    mamba_num_heads=8,
    mamba_head_dim=16,
    ssm_state_size=16,
    chunk_size=8,
    max_position_embeddings=64,
    layer_norm_epsilon=1e-6,
)
_CLAMPED = dict(tie_word_embeddings=True, use_conv_bias=False, time_step_limit=(0.05, 0.8))
_MHA = dict(
    n_groups=1,
    num_key_value_heads=4,
    use_conv_bias=False,
    time_step_min=0.3,
    time_step_limit=(0.3, float("inf")),
    conv_kernel=3,
)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mamba2-g1": ("Mamba2Config", dict(_MAMBA2, num_hidden_layers=3, n_groups=1)),
    "mamba2-g2-tied-clamped": ("Mamba2Config", dict(_MAMBA2, num_hidden_layers=2, n_groups=2, **_CLAMPED)),
    "nemotron-h": ("NemotronHConfig", dict(_NEMOTRON, hybrid_override_pattern="M*-M-", n_groups=2)),
    "nemotron-h-mha": ("NemotronHConfig", dict(_NEMOTRON, hybrid_override_pattern="*-M", **_MHA)),
}
ARCHS = {"Mamba2Config": "Mamba2ForCausalLM", "NemotronHConfig": "NemotronHForCausalLM"}
TOKENS = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(3))


def _transformers() -> Any:
    import transformers

    return transformers


def hf_config(name: str) -> Any:
    cls, kw = CASES[name]
    return getattr(_transformers(), cls)(**kw)


def arch(name: str) -> str:
    return ARCHS[CASES[name][0]]


def randomize_hf(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter random (norms around 1), in eval mode."""
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0, 0.2 if p.dim() == 1 else 0.08)
            if p.dim() == 1 and "norm" in n:
                p.add_(1.0)
    return model.eval()


def hf_model(name: str) -> torch.nn.Module:
    """An HF model of case ``name`` with every parameter random, float32, in eval mode."""
    return randomize_hf(_transformers().AutoModelForCausalLM.from_config(hf_config(name)))


def mcore_config(name: str) -> TransformerConfig:
    return ssm_config_from_hf(hf_config(name).to_dict())


def hf_logits(model: torch.nn.Module, ids: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def native(pattern: str, tied: bool = True, **kw: Any) -> TransformerConfig:
    """An mcore hybrid config written directly (no ``hf_architecture`` hint): squared-ReLU MLP, attention without
    position embedding, RMSNorm, no biases."""
    base: dict[str, Any] = dict(
        num_layers=len(pattern.replace("|", "")),
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        activation="squared_relu",
        normalization="rmsnorm",
        norm_eps=1e-5,
        add_bias_linear=False,
        position_embedding="none",
        vocab_size=101,
        max_position_embeddings=64,
        share_embeddings_and_output_weights=tied,
        hybrid_pattern=pattern,
        mamba=MambaConfig(d_state=16, head_dim=16, n_groups=2, chunk_size=8, dt_limit=(0.0, float("inf"))),
    )
    base.update(kw)
    return TransformerConfig(**base)
