"""A compiled tp2 + SP GPT whose symmetric-memory sequence-parallel linears are traced into the compiled layers
(``with_symmetric_memory(in_graph=True)``, training's ``parallel.tp_comm_in_graph``) matches one eager process, on
CPU with gloo: the ``symm_mem`` ops get CPU kernels from PyTorch's reference implementations
(``tests/parallel/test_tp_layers.py``); the CUDA kernels are tested on GPUs."""

from __future__ import annotations

import torch

from mcore_parallel.testing import run_distributed
from tests.parallel import test_tp_layers as t


def _model_in_graph(tp: int) -> tuple[float, dict[str, torch.Tensor], int]:
    """A compiled GPT at tp + SP with the symmetric-memory linears traced into its layers: per-token loss, gathered
    gradients of two weights, and the number of graph breaks at the eager collectives."""
    from mcore_models import GPTModel
    from mcore_parallel.tensor import with_symmetric_memory
    from mcore_parallel.tensor._comm import all_gather
    from tests._model_configs import llama

    t._register_cpu_symmetric_ops()
    state = t._state(tp, True)
    group = with_symmetric_memory(state.tp, in_graph=True)
    model = GPTModel(llama(params_dtype="float32"), tp=group, sequence_parallel=True).train()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model.compile_layers()
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    loss = model(tokens, labels=tokens)
    loss.mean().backward()
    layer = next(iter(model.decoder.layers.values()))
    gate, up = layer.mlp.linear_fc1.weight.grad.chunk(2, 0)  # each rank holds [its gate rows; its up rows]
    grads = {
        "fc1": torch.cat([all_gather(gate.contiguous(), state.tp, 0), all_gather(up.contiguous(), state.tp, 0)]),
        "proj": all_gather(layer.self_attention.linear_proj.weight.grad, state.tp, 1),
    }
    breaks = sum(n for k, n in torch._dynamo.utils.counters["graph_break"].items() if "torch.compiler.disable" in k)
    return float(loss.mean()), grads, breaks


def test_compiled_model_with_traced_symmetric_memory_linears_matches_one_process() -> None:
    from mcore_models import GPTModel
    from tests._model_configs import llama

    model = GPTModel(llama(params_dtype="float32")).train()  # the same seeded weights, one process, eager
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    loss = model(tokens, labels=tokens)
    loss.mean().backward()
    layer = next(iter(model.decoder.layers.values()))
    for got, grads, breaks in run_distributed(_model_in_graph, 2, 2, timeout=900):
        assert abs(got - float(loss.mean())) < 1e-5
        torch.testing.assert_close(grads["fc1"], layer.mlp.linear_fc1.weight.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grads["proj"], layer.self_attention.linear_proj.weight.grad, rtol=1e-4, atol=1e-5)
        assert breaks < 8  # the four SP linears of each layer no longer leave the graph (the loss's collectives do)
