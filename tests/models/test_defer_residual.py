"""``TransformerConfig.defer_residual_add``: each transformer layer's last residual add done by the next layer, with
its input norm. The same adds of the same tensors as without it: the loss and every gradient equal bit for bit (with
dropout, FP8 linears, MoE layers, whole layers recomputed, packed documents), and in a compiled layer whose linears
break the graph (FP8) the add and the norm are one graph."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_models import GPTModel, TransformerConfig
from mcore_models.moe import MoEConfig
from mcore_models.transformer.layer import TransformerLayer
from mcore_parallel.fp8 import fp8_step
from tests._model_configs import llama
from tests.models._graphs import GraphRecorder

BASE = llama(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    defer_residual_add=False,
)
FP8 = dict(fp8="hybrid", fp8_recipe="delayed", fp8_first_layers_bf16=0, fp8_last_layers_bf16=0)


def _loss_and_grads(cfg: TransformerConfig, seed: int = 0, **forward: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    torch.manual_seed(0)
    model = GPTModel(cfg)
    model.train()
    torch.manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    with fp8_step([model]):
        for _ in range(2):  # a second step: delayed scaling then casts with the first step's history
            loss = model(ids, labels=ids, **forward).mean()
            loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize(
    "changes",
    [
        {},
        dict(hidden_dropout=0.1),
        FP8,
        dict(recompute="full", recompute_num_layers=2),
        dict(num_layers=3, moe=MoEConfig(num_experts=4, ffn_hidden_size=32, router_topk=2, layer_freq=2)),
    ],
    ids=["plain", "dropout", "fp8", "two-layers-recomputed", "moe-every-other-layer"],
)
def test_deferred_add_trains_bit_for_bit_like_the_plain_layers(changes: dict[str, Any]) -> None:
    cfg = BASE.replace(**changes)
    loss, grads = _loss_and_grads(cfg)
    loss_d, grads_d = _loss_and_grads(cfg.replace(defer_residual_add=True))
    assert torch.equal(loss, loss_d)
    assert grads.keys() == grads_d.keys() and len(grads) > 0
    for name, g in grads.items():
        assert torch.equal(g, grads_d[name]), name


def test_each_layer_with_a_transformer_layer_after_it_defers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which layers defer and which take a pending sum: none of the recomputed ones, and the last one returns it."""
    calls: list[tuple[int, bool, bool]] = []
    forward = TransformerLayer.forward

    def spy(self: TransformerLayer, *args: Any, pending: Any = None, defer: bool = False, **kw: Any) -> Any:
        calls.append((self.layer_number, pending is not None, defer))
        return forward(self, *args, pending=pending, defer=defer, **kw)

    monkeypatch.setattr(TransformerLayer, "forward", spy)
    _loss_and_grads(BASE.replace(defer_residual_add=True))
    assert calls[:4] == [(0, False, True), (1, True, True), (2, True, True), (3, True, False)]
    calls.clear()
    _loss_and_grads(BASE.replace(defer_residual_add=True, recompute="full", recompute_num_layers=2))
    assert calls[:4] == [(0, False, False), (1, False, False), (2, False, True), (3, True, False)]
    calls.clear()
    _loss_and_grads(BASE)
    assert calls[:4] == [(i, False, False) for i in range(4)]


def test_packed_documents_and_eval_are_unchanged() -> None:
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1] * 2])
    loss, grads = _loss_and_grads(BASE, document_ids=ids)
    loss_d, grads_d = _loss_and_grads(BASE.replace(defer_residual_add=True), document_ids=ids)
    assert torch.equal(loss, loss_d) and all(torch.equal(g, grads_d[n]) for n, g in grads.items())
    torch.manual_seed(0)
    plain = GPTModel(BASE).eval()
    torch.manual_seed(0)
    deferred = GPTModel(BASE.replace(defer_residual_add=True)).eval()
    x = torch.randint(0, BASE.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.equal(plain(x), deferred(x))


def test_compiled_fp8_layer_adds_the_pending_sum_inside_its_norm_graph() -> None:
    """A middle layer (``pending`` in, ``defer`` out) compiled: its first graph adds the layer before's sum and
    normalises it, and no graph is only the layer's last add, with eager mode's output and gradients."""
    layer = GPTModel(BASE.replace(**FP8)).decoder.layers["2"]
    record = GraphRecorder()
    x = torch.randn(16, 2, 64, requires_grad=True)
    pending = torch.randn(16, 2, 64, requires_grad=True)
    with fp8_step([layer]):
        eager = layer(x, None, pending=pending, defer=True)
        grads_eager = torch.autograd.grad(sum(t.square().sum() for t in eager), (x, pending))
        compiled = torch.compile(layer, backend=record)(x, None, pending=pending, defer=True)
        grads = torch.autograd.grad(sum(t.square().sum() for t in compiled), (x, pending))
    for a, b in zip((*compiled, *grads), (*eager, *grads_eager)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    norm_graphs = record.with_op("rms_norm")
    assert len(norm_graphs) == 2 and all("add" in ops for ops in norm_graphs), record.graphs
    assert {"add"} not in record.graphs, f"a graph of only the last residual add: {record.graphs}"


def test_on_by_default_in_every_preset() -> None:
    """The measured default (``docs/performance.md``): every preset's model defers unless told not to."""
    from mcore_models.presets import PRESETS, preset

    assert TransformerConfig.__dataclass_fields__["defer_residual_add"].default is True
    assert all(preset(name).defer_residual_add for name in PRESETS)
