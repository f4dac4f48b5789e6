"""GPTModel against Hugging Face transformers models built from configs (random weights, no download).

Weights go from the HF model into GPTModel through the converters in ``mcore_models.hf``; logits and loss must match
in fp32 (tolerance 1e-5), for MHA and GQA, tied and untied, with and without Llama-3 RoPE scaling. The reverse conversion must
reproduce the HF state dict exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_models import ConversionError, GPTModel, TransformerConfig
from mcore_models.hf import (
    gpt2_config_from_hf,
    gpt2_config_to_hf,
    hf_architecture,
    hf_to_mcore,
    llama_config_from_hf,
    llama_config_to_hf,
    mcore_to_hf,
)
from tests._model_configs import gpt2, llama

transformers = pytest.importorskip("transformers")


def _hf_model(config: TransformerConfig) -> torch.nn.Module:
    arch = hf_architecture(config)
    if arch == "LlamaForCausalLM":
        hf_cfg = transformers.LlamaConfig(**llama_config_to_hf(config))
        model = transformers.LlamaForCausalLM(hf_cfg)
    else:
        hf_cfg = transformers.GPT2Config(**gpt2_config_to_hf(config))
        model = transformers.GPT2LMHeadModel(hf_cfg)
    torch.manual_seed(0)
    with torch.no_grad():  # HF initialises norms to 1 / biases to 0: randomise everything so nothing is trivial
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() == 1 else 0.05)
            if p.dim() == 1 and "norm" in "".join(n for n, q in model.named_parameters() if q is p):
                p.add_(1.0)
    return model.eval()


def _compare(config: TransformerConfig) -> None:
    hf = _hf_model(config)
    hf_sd = hf.state_dict()
    model = GPTModel(config.replace(params_dtype="float32")).eval()
    model.load_global_state_dict(dict(hf_to_mcore(config, lambda k: hf_sd[k])))
    torch.manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (3, 12))
    labels = torch.randint(0, config.vocab_size, (3, 12))
    with torch.no_grad():
        ref_logits = hf(input_ids=ids).logits
        logits = model(ids, gather_logits=True)
        loss = model(ids, labels=labels)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, config.vocab_size), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(loss, ref_loss.view(3, 12), rtol=1e-5, atol=1e-5)
    # and back: mcore -> HF reproduces every HF tensor (and nothing else)
    ours = model.global_state_dict()
    back = dict(mcore_to_hf(config, lambda k: ours[k]))
    expected = {
        k: v for k, v in hf_sd.items() if not (k == "lm_head.weight" and config.share_embeddings_and_output_weights)
    }
    expected = {k: v for k, v in expected.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    assert set(back) == set(expected)
    for k, v in expected.items():
        assert torch.equal(back[k], v), k


@pytest.mark.parametrize(
    "config",
    [
        llama(),
        llama(num_query_groups=4),
        llama(num_query_groups=1, share_embeddings_and_output_weights=True),
        llama(
            rope_scaling={
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            rotary_base=500000.0,
        ),
        llama(kv_channels=16),
    ],
    ids=["gqa-untied", "mha-untied", "mqa-tied", "llama3-rope-scaling", "headdim16"],
)
def test_llama_matches_hf(config: TransformerConfig) -> None:
    _compare(config)


@pytest.mark.parametrize("config", [gpt2(), gpt2(activation="gelu", num_layers=3)], ids=["gelu-new", "gelu-exact"])
def test_gpt2_matches_hf(config: TransformerConfig) -> None:
    _compare(config)


def test_config_round_trip_through_hf() -> None:
    for c in (llama(), llama(share_embeddings_and_output_weights=True, num_query_groups=4)):
        back = llama_config_from_hf(transformers.LlamaConfig(**llama_config_to_hf(c)).to_dict())
        for field in ("num_layers", "hidden_size", "num_query_groups", "ffn_size", "vocab_size", "rotary_base",
                      "share_embeddings_and_output_weights", "head_dim", "norm_eps"):  # fmt: skip
            assert getattr(back, field) == getattr(c, field), field
    g = gpt2()
    back = gpt2_config_from_hf(transformers.GPT2Config(**gpt2_config_to_hf(g)).to_dict())
    assert (back.num_layers, back.hidden_size, back.activation, back.ffn_size) == (2, 32, "gelu_tanh", 128)


def test_unrepresentable_features_are_refused_by_name() -> None:
    with pytest.raises(ConversionError, match="qk_layernorm"):
        hf_architecture(llama(qk_layernorm=True))
    with pytest.raises(ConversionError, match="add_qkv_bias"):
        hf_architecture(llama(add_qkv_bias=True))
    with pytest.raises(ConversionError, match="grouped-query attention"):
        hf_architecture(gpt2(num_query_groups=2))
    with pytest.raises(ConversionError, match="no Hugging Face class"):
        hf_architecture(llama(normalization="layernorm"))
    with pytest.raises(ConversionError, match="hidden_act='gelu'"):
        llama_config_from_hf({**llama_config_to_hf(llama()), "hidden_act": "gelu"})
