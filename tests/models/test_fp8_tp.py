"""A tiny FP8 GPT model (model.fp8) at tp 2 and 4 with and without sequence parallelism, on gloo, against the same
FP8 model in one process over two steps: the loss, every parameter gradient, the delayed-scaling histories.

Every FP8 tensor is scaled by the maximum of the whole tensor (reduced over the tensor-parallel group), so the ranks
quantise like one process (``tests/parallel/test_fp8_tp.py`` checks each layer to fp32 rounding). Across layers, the
fp32 summation order of split contractions differs, and a value within that rounding of an FP8 rounding boundary
(E5M2 gradients: 25% steps) can round the other way, which moves a few gradient elements by up to a percent. So the
loss is compared to 1e-4 and each gradient by the norm of its difference, at most 1% of its own norm (below the FP8
error itself, 3-6% for E4M3 / E5M2), and after each step both models continue from the same weights and histories,
so such a flip does not compound."""

from __future__ import annotations

import pytest
import torch

from mcore_models import GPTModel, TransformerConfig
from mcore_models.transformer.mlp import MLP
from mcore_parallel import Group, ParallelConfig, ParallelState, shard_info
from mcore_parallel.fp8 import fp8_step
from mcore_parallel.tensor import allreduce_sequence_parallel_grads
from mcore_parallel.testing import run_distributed
from tests._model_configs import gpt2, llama

CONFIGS = {
    # 64 wide with 4 heads of 16: the FP8 linears stay 16-aligned per rank up to tp 4
    "llama": llama(num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=128,
                   fp8="hybrid", fp8_first_layers_bf16=0),
    "gpt2-delayed": gpt2(num_layers=3, hidden_size=64, fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4,
                         fp8_first_layers_bf16=0, fp8_last_layers_bf16=0),
    "llama-rowwise-fp8-allgather": llama(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                                         ffn_hidden_size=128, fp8="e4m3", fp8_recipe="rowwise", fp8_allgather=True,
                                         fp8_first_layers_bf16=0, fp8_last_layers_bf16=0),
}  # fmt: skip


def _step(model: GPTModel, ids: torch.Tensor, labels: torch.Tensor, tp: Group) -> torch.Tensor:
    with fp8_step([model], tp):
        loss = model(ids, labels=labels)
        (loss * torch.linspace(0.5, 1.5, ids.shape[1])).sum().backward()
    return loss.detach()


def _run(config: TransformerConfig, tp: int, sp: bool) -> None:
    state = ParallelState.initialize(ParallelConfig(tp=tp, sequence_parallel=sp))
    ref = GPTModel(config, tp=Group.single())
    model = GPTModel(config, tp=state.tp, sequence_parallel=sp)
    assert any("Fp8" in type(m).__name__ for m in model.modules())
    for step in range(2):  # the second step scales from the first one's history (delayed)
        torch.manual_seed(11 + step)
        ids = torch.randint(0, config.vocab_size, (2, 16))
        labels = torch.randint(0, config.vocab_size, (2, 16))
        ref_loss, loss = _step(ref, ids, labels, Group.single()), _step(model, ids, labels, state.tp)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
        allreduce_sequence_parallel_grads(model, state.tp)
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            ref_param = ref_params[name]
            info = shard_info(name, param.grad, state.tp, like=param)
            full = torch.zeros(info.global_shape)
            shard_info(name, ref_param.grad, Group.single(), like=ref_param).scatter_into(full)
            for local_idx, global_idx in info.pieces:
                mine, theirs = param.grad[local_idx], full[global_idx]
                diff, norm = (mine - theirs).norm().item(), theirs.norm().item()
                assert diff <= 1e-2 * norm + 1e-6, f"step {step} {name}: |difference| {diff:.3e}, |gradient| {norm:.3e}"
        with torch.no_grad():  # one update, then both hold the same weights again (a flip must not compound)
            for p in ref.parameters():
                p -= 0.05 * p.grad
        ref.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        model.load_global_state_dict(ref.global_state_dict())
        for mine, theirs in zip(model.runtime_state_dict().values(), ref.runtime_state_dict().values(), strict=True):
            torch.testing.assert_close(mine.local, theirs.local, rtol=1e-3, atol=0)  # the histories agree ...
            mine.local.copy_(theirs.local)  # ... and the next step starts from the same ones
    assert len(model.runtime_state_dict()) == (24 if config.fp8_recipe == "delayed" else 0)
    if config.fp8_fused_swiglu:  # the second step ran the fused FP8 MLP (tests/models/test_fp8_swiglu.py)
        for m in (ref, model):
            assert [mlp.fp8_fused_calls for mlp in m.modules() if isinstance(mlp, MLP)] == [1] * config.num_layers


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, True)], ids=["tp2", "tp2-sp", "tp4-sp"])
def test_fp8_gpt_under_tp_matches_one_process(name: str, tp: int, sp: bool) -> None:
    run_distributed(_run, tp, CONFIGS[name], tp, sp)
