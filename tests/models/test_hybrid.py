"""Hybrid models from a layer pattern: the pattern's syntax and stage boundaries, a pattern of attention + MLP pairs
equal to the GPT model with the same weights, parameter and FLOP counts against the built model, tensor parallelism
and pipeline stages against one process (CPU, gloo)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_models import GPTModel, TransformerConfig, preset
from mcore_models.errors import ConfigError
from mcore_models.flops import num_parameters, padded_vocab_size, training_flops_per_token
from mcore_models.hybrid import (
    AttentionLayer,
    MLPLayer,
    gpt_layer_names,
    layer_kinds,
    pattern_stage_counts,
    stage_layers,
)
from mcore_parallel import Group, ParallelConfig, ParallelState
from mcore_parallel.testing import run_distributed
from tests.models.test_new_layer_type import _train_step  # loss, global weights and gradients of one step

TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def tiny(**kw: Any) -> TransformerConfig:
    return preset("hybrid-tiny", **kw)


def test_pattern_syntax_and_stage_boundaries() -> None:
    assert layer_kinds("M*-|M-E") == "M*-M-E"
    with pytest.raises(ValueError, match=r"holds \['x'\]: use M \(Mamba\)"):
        layer_kinds("M*x")
    assert pattern_stage_counts("M*-M-", 1) is None
    assert pattern_stage_counts("M*|-M-", 2) == [2, 3]
    with pytest.raises(ValueError, match="has 2 pipeline stages .* but the layout has 4"):
        pattern_stage_counts("M*|-M-", 4)
    with pytest.raises(ValueError, match="stage 1 holds no layer"):
        pattern_stage_counts("M*||-M-", 3)
    config = tiny(hybrid_pattern="M*|-M|-", num_layers=5)
    assert [stage_layers(config, 3, r) for r in range(3)] == [range(0, 2), range(2, 4), range(4, 5)]
    # virtual stages: chunk v of rank p holds segment v * pp + p
    config = tiny(hybrid_pattern="M|*|-|M|-|M", num_layers=6)
    assert [stage_layers(config, 2, p, 3, v) for v in range(3) for p in range(2)] == [range(i, i + 1)
                                                                                     for i in range(6)]  # fmt: skip
    with pytest.raises(ValueError, match="boundaries place the layers"):
        stage_layers(tiny(hybrid_pattern="M*|-M-"), 2, 0, first_stage_layers=1)
    # without boundaries: the usual even split
    assert [stage_layers(tiny(num_layers=4, hybrid_pattern="M*-M"), 2, r) for r in range(2)] == [range(0, 2),
                                                                                                 range(2, 4)]  # fmt: skip


def test_config_refuses_a_pattern_that_does_not_fit() -> None:
    with pytest.raises(ConfigError, match="hybrid_pattern='M\\*-M-' has 5 layers .* but num_layers=4"):
        tiny(num_layers=4)
    with pytest.raises(ConfigError, match="mamba"):
        tiny(mamba=None)


def _llama_pair_config(**kw: Any) -> TransformerConfig:
    return preset("hybrid-tiny", hybrid_pattern=None, mamba=None, num_layers=2, **kw)


def test_attention_and_mlp_pairs_are_the_gpt_model() -> None:
    """``*-*-`` with a GPT model's weights moved by :func:`gpt_layer_names` gives that model's logits and loss."""
    torch.manual_seed(0)
    gpt = GPTModel(_llama_pair_config(), device="cpu").eval()
    hybrid = GPTModel(_llama_pair_config().replace(num_layers=4, hybrid_pattern="*-*-"), device="cpu").eval()
    kinds = [type(layer) for layer in hybrid.decoder.layers.values()]
    assert kinds == [AttentionLayer, MLPLayer, AttentionLayer, MLPLayer]
    names = gpt_layer_names(2, "*-*-")
    moved = {}
    for key, value in gpt.state_dict().items():
        new = next((key.replace(a, b) for a, b in names.items() if key.startswith(a)), key)
        moved[new] = value
    assert set(moved) == set(hybrid.state_dict())
    hybrid.load_state_dict(moved)
    with torch.no_grad():
        assert torch.equal(hybrid(TOKENS), gpt(TOKENS))
    with pytest.raises(ValueError, match="has 1 attention \\+ MLP pairs"):
        gpt_layer_names(2, "*-M-")


@pytest.mark.parametrize("name", ["hybrid-tiny", "mamba2-130m", "hybrid-1b", "nemotron-h-8b"])
def test_parameter_count_is_the_built_model(name: str) -> None:
    config = preset(name)
    model = GPTModel(config, device="meta")
    assert num_parameters(config) == sum(p.numel() for p in model.parameters())


def test_flops_count_each_layer_kind() -> None:
    c = tiny()
    h, s = c.hidden_size, 64
    m = c.mamba
    assert m is not None
    di, heads = m.expand * h, m.expand * h // m.head_dim
    mamba = 3 * (2 * h * (2 * di + 2 * m.n_groups * m.d_state + heads) + 7 * di * m.d_state + 2 * di * h)
    n, g, d = c.num_attention_heads, c.query_groups, c.head_dim
    attention = 3 * (4 * h * n * d * (1 + g / n) + 2 * s * n * d)
    mlp = 3 * 6 * h * c.ffn_size  # SwiGLU: three h x f matrices
    vocab = 256
    want = 2 * mamba + attention + 2 * mlp + 6 * h * vocab
    assert training_flops_per_token(c, s) == pytest.approx(want, rel=1e-12)


def _tp_run(tp: int, sp: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    state = ParallelState.initialize(ParallelConfig(tp=tp, sequence_parallel=sp))
    return _train_step(GPTModel(tiny(params_dtype="float32"), tp=state.tp, sequence_parallel=sp), state.tp)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tensor_parallel_hybrid_equals_one_process(sp: bool) -> None:
    """Mamba-2 (two B/C groups: one per rank), attention and MLP layers at tp2 (+ SP): the loss, the initial global
    weights and every gradient of one process."""
    ref_loss, ref_weights, ref_grads = _train_step(GPTModel(tiny(params_dtype="float32")), Group.single())
    assert any(".mixer.in_proj.weight" in k for k in ref_weights)
    for loss, weights, grads in run_distributed(_tp_run, 2, 2, sp):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        assert list(weights) == list(ref_weights)
        for name, w in weights.items():
            torch.testing.assert_close(w, ref_weights[name], rtol=0, atol=0, msg=f"{name}: initial weight")
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=f"{name}: grad")


def _stage_logits(pattern: str, pp: int) -> torch.Tensor:
    """The model's logits computed stage by stage, each stage a GPTModel of the pattern's layers for that stage."""
    config = tiny(params_dtype="float32", hybrid_pattern=pattern)
    hidden: torch.Tensor | None = None
    for rank in range(pp):
        stage = GPTModel(config, pre_process=rank == 0, post_process=rank == pp - 1,
                         layers=stage_layers(config, pp, rank))  # fmt: skip
        if hidden is not None:
            stage.set_input_tensor(hidden)
        with torch.no_grad():
            hidden = stage(TOKENS)
    assert hidden is not None
    return hidden


def test_pipeline_stages_from_the_pattern_compose_to_the_whole_model() -> None:
    """``|`` splits the layers over two stages; the stages' layers, weights and output are the one-stage model's."""
    torch.testing.assert_close(_stage_logits("M*|-M-", 2), _stage_logits("M*-M-", 1), rtol=0, atol=0)


def test_hybrid_1b_is_llama_1b_sized() -> None:
    """The hybrid's speed is compared with llama-1b's (bench train-mamba): both have the same width and, outside the
    embeddings, the same parameter count within 2%."""
    hybrid, llama = preset("hybrid-1b"), preset("llama-1b")

    def body(c: TransformerConfig) -> int:
        vocab = padded_vocab_size(c.vocab_size, 1, c.make_vocab_size_divisible_by)
        return num_parameters(c) - vocab * c.hidden_size * (1 if c.share_embeddings_and_output_weights else 2)

    assert hybrid.hidden_size == llama.hidden_size
    assert abs(body(hybrid) / body(llama) - 1) < 0.02
    pattern = hybrid.hybrid_pattern or ""
    assert pattern.count("M") == 7 * pattern.count("*") > 0
