"""Model-level MoE bookkeeping: the layers, the auxiliary-loss scale, the expert-bias update and logged metrics."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from mcore_models.moe.layer import STAT_FIELDS, MoELayer
from mcore_parallel import Group
from mcore_parallel.tensor import _comm

__all__ = ["moe_layers", "set_aux_loss_scale", "update_expert_biases", "moe_metrics"]


def moe_layers(modules: Iterable[nn.Module]) -> Iterator[tuple[int, MoELayer]]:
    """``(global layer number, layer)`` of every MoE layer in ``modules`` (model chunks, DDP-wrapped or not)."""
    for module in modules:
        for name, sub in module.named_modules():
            if isinstance(sub, MoELayer):
                parts = name.split(".")
                yield int(parts[parts.index("layers") + 1]), sub


def set_aux_loss_scale(modules: Iterable[nn.Module], scale: float) -> None:
    """The gradient the auxiliary losses get: the factor the training step applies to the main loss."""
    for _, layer in moe_layers(modules):
        layer.aux_loss_scale.fill_(scale)


@torch.no_grad()
def update_expert_biases(modules: Iterable[nn.Module], balance: Group) -> None:
    """After a step's backward: sum each layer's tokens per expert over ``balance`` (the stage's ranks, one
    collective for every layer) and move its expert bias (layers without aux-loss-free balancing are skipped)."""
    layers = [layer for _, layer in moe_layers(modules) if layer.router.expert_bias is not None]
    if not layers:
        return
    counts = _comm.all_reduce(torch.stack([layer.bias_counts for layer in layers]), balance)
    for layer, c in zip(layers, counts):
        layer.update_expert_bias(c)
        layer.bias_counts.zero_()


@torch.no_grad()
def moe_metrics(
    modules: Iterable[nn.Module], num_layers: int, num_experts: int, world: Group, sp_size: int = 1
) -> dict[str, float]:
    """Per MoE layer since the last call: the load-balancing and z losses (mean per micro-batch), the fraction of
    choices dropped over capacity, and the least and most loaded expert's tokens relative to an even split; the
    accumulators are then reset. Every rank must call (one all-reduce over ``world``), also one whose pipeline stage
    holds no MoE layer (it reports the other stages' layers). ``sp_size`` is the tensor-parallel size under sequence
    parallelism (each rank's losses are then its share of the micro-batch's), else 1."""
    modules = list(modules)
    layers = dict(moe_layers(modules))
    device = next((p.device for m in modules for p in m.parameters()), torch.device("cpu"))
    table = torch.zeros(num_layers, len(STAT_FIELDS) + num_experts, device=device)
    for i, layer in layers.items():
        table[i] = layer.stats
        layer.stats.zero_()
    table = _comm.all_reduce(table, world).cpu()
    out: dict[str, float] = {}
    n = len(STAT_FIELDS)
    for i in range(num_layers):
        aux, z, dropped, forwards = (float(v) for v in table[i, :n])
        if forwards == 0:
            continue
        counts = table[i, n:]
        choices = float(counts.sum())
        even = choices / counts.numel()
        out[f"moe/layer{i}/aux_loss"] = aux * sp_size / forwards
        out[f"moe/layer{i}/z_loss"] = z * sp_size / forwards
        out[f"moe/layer{i}/dropped"] = dropped / choices if choices else 0.0
        out[f"moe/layer{i}/load_min"] = float(counts.min()) / even if even else 0.0
        out[f"moe/layer{i}/load_max"] = float(counts.max()) / even if even else 0.0
    return out
