"""GPTModel under TP = 2, 4 (with and without SP) against TP = 1: logits, loss and every parameter gradient.

The TP model and its TP=1 reference are each built from the config's seed, so this also checks that the
unsharded initial weights do not depend on the TP size.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mcore_models import GPTModel, TransformerConfig
from mcore_models import gpt as gpt_module
from mcore_parallel import Group, ParallelConfig, ParallelState, shard_info
from mcore_parallel.tensor import allreduce_sequence_parallel_grads
from mcore_parallel.testing import run_distributed
from tests._model_configs import gpt2, llama

CONFIGS = {
    "llama-gqa": llama(num_attention_heads=8, num_query_groups=4, hidden_size=32),
    "llama-tied-qknorm": llama(share_embeddings_and_output_weights=True, qk_layernorm=True, num_query_groups=4),
    "gpt2": gpt2(),
}


def _run(config: TransformerConfig, tp: int, sp: bool, fused: bool = False) -> None:
    """The TP model (with the fused output-layer loss when ``fused``) against the unfused one-process model."""
    state = ParallelState.initialize(ParallelConfig(tp=tp, sequence_parallel=sp))
    torch.manual_seed(11)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    labels = torch.randint(0, config.vocab_size, (2, 16))
    ref = GPTModel(config, tp=Group.single())
    model = GPTModel(dataclasses.replace(config, cross_entropy_fusion=fused), tp=state.tp, sequence_parallel=sp)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]

    ref_loss = ref(ids, labels=labels)
    calls = []
    real = gpt_module.linear_vocab_parallel_cross_entropy
    gpt_module.linear_vocab_parallel_cross_entropy = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        loss = model(ids, labels=labels)
    finally:
        gpt_module.linear_vocab_parallel_cross_entropy = real
    assert len(calls) == int(fused)  # the fused path is really taken, and only when asked for
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, gather_logits=True), ref(ids, gather_logits=True), rtol=1e-5, atol=1e-5)

    (ref_loss * torch.linspace(0.5, 1.5, 16)).sum().backward()
    (loss * torch.linspace(0.5, 1.5, 16)).sum().backward()
    allreduce_sequence_parallel_grads(model, state.tp)
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        info = shard_info(name, param.grad, state.tp, like=param)
        ref_param = ref_params[name]
        assert ref_param.grad is not None, name
        ref_info = shard_info(name, ref_param.grad, Group.single(), like=ref_param)
        ref_grad = torch.zeros(ref_info.global_shape)
        ref_info.scatter_into(ref_grad)  # the global (unpadded) gradient
        assert info.global_shape == ref_info.global_shape, name
        for local_idx, global_idx in info.pieces:
            torch.testing.assert_close(
                param.grad[local_idx], ref_grad[global_idx], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
            )
        if not info.pieces:
            assert torch.all(param.grad == 0), f"{name}: padding-only shard must get no gradient"


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(
    "tp,sp", [(2, False), (2, True), (4, False), (4, True)], ids=["tp2", "tp2-sp", "tp4", "tp4-sp"]
)
def test_gpt_tp_matches_tp1(name: str, tp: int, sp: bool) -> None:
    run_distributed(_run, tp, CONFIGS[name], tp, sp)


@pytest.mark.parametrize(
    "name,tp,sp", [("llama-tied-qknorm", 1, False), ("llama-tied-qknorm", 2, True), ("gpt2", 4, False)]
)
def test_fused_output_loss_matches_unfused(name: str, tp: int, sp: bool) -> None:
    """cross_entropy_fusion: same per-token loss and every gradient (tied and untied output weights, TP, SP)."""
    run_distributed(_run, tp, CONFIGS[name], tp, sp, True)
