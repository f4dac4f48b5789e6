"""The worked example of ``docs/architecture.md`` ("How a new layer type plugs in"): a GPT-J style parallel block
passed through ``LayerSpec(layer=...)`` trains under tensor (and sequence) parallelism exactly like one process, with
the same global weights and stable parameter names, without any change to ``GPTModel``. Serving it through the plain
decode path is tested in ``tests/infer/test_decode.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_models import GPTModel, LayerSpec
from mcore_parallel import Group, ParallelConfig, ParallelState
from mcore_parallel.tensor import allreduce_sequence_parallel_grads
from mcore_parallel.testing import run_distributed
from tests._layers import ParallelBlock
from tests._model_configs import llama

SPEC = LayerSpec(layer=ParallelBlock)


def _config() -> Any:
    return llama(params_dtype="float32")


def _train_step(model: GPTModel, tp: Group) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One backward pass: the loss, and the global (unsharded, unpadded) weights and gradients."""
    torch.manual_seed(5)
    ids = torch.randint(0, 100, (2, 16))
    loss = model(ids, labels=ids)
    (loss * torch.linspace(0.5, 1.5, 16)).sum().backward()
    allreduce_sequence_parallel_grads(model, tp)
    with torch.no_grad():
        weights = model.global_state_dict()
        for name, param in model.named_parameters():  # gradients gathered like weights: put them in their place
            assert param.grad is not None, name
            param.copy_(param.grad)
        grads = model.global_state_dict()
    return loss.detach(), weights, grads


def _tp_run(tp: int, sp: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    state = ParallelState.initialize(ParallelConfig(tp=tp, sequence_parallel=sp))
    return _train_step(GPTModel(_config(), tp=state.tp, sequence_parallel=sp, spec=SPEC), state.tp)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_a_new_layer_type_trains_under_tensor_parallelism_like_one_process(sp: bool) -> None:
    ref = GPTModel(_config(), spec=SPEC)
    assert all(isinstance(layer, ParallelBlock) for layer in ref.decoder.layers.values())
    ref_loss, ref_weights, ref_grads = _train_step(ref, Group.single())
    for loss, weights, grads in run_distributed(_tp_run, 2, 2, sp):
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        assert list(weights) == list(ref_weights)  # stable names, whatever the layout
        for name, w in weights.items():
            torch.testing.assert_close(w, ref_weights[name], rtol=0, atol=0, msg=f"{name}: initial weight")
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-5, msg=f"{name}: grad")
