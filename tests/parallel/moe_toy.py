"""A tiny mixture-of-experts model for the expert-parallel tests, and its float64 single-process reference.

``ToyMoE`` holds a dense ``Linear``, a replicated router (``router.weight`` trainable, ``router.expert_bias`` not) and
stacked expert weights ``experts.linear_fc1.weight`` ``[E_local, 2F/etp, H]`` (gated, stride 2) and
``experts.linear_fc2.weight`` ``[E_local, H, F/etp]`` with the attributes of the expert-parallel parameter contract.
Tokens are exchanged by an all-gather over ``state.expert_tp_ep`` (each rank runs its experts, and its expert-TP
piece, on every token of the group) and the partial outputs are summed back to each token's owner, so each rank's
expert gradient holds the contributions of its peers' tokens, as with a real dispatcher. Expert 0 gets no tokens
(``expert_bias[0]`` is very negative), so its gradients are exactly zero.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mcore_parallel import Group, ParallelConfig, ParallelState, shard_group, shard_info

E, H, FFN, TOKENS = 4, 6, 8, 5  # experts, hidden, expert ffn size, tokens per data-parallel rank
FC1, FC2 = "experts.linear_fc1.weight", "experts.linear_fc2.weight"
EXPERT_KEYS = (FC1, FC2)


def full_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every parameter in its global shape (float64)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.5) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    bias = rnd(E, scale=0.1)
    bias[0] = -1e4  # expert 0 is never chosen: its gradients are exactly zero
    return {
        "dense.weight": rnd(H, H),
        "dense.bias": rnd(H),
        "router.weight": rnd(E, H),
        "router.expert_bias": bias,
        FC1: rnd(E, 2 * FFN, H),
        FC2: rnd(E, H, FFN),
    }


def local_piece(key: str, full: torch.Tensor, ep: tuple[int, int], etp: tuple[int, int]) -> torch.Tensor:
    """This rank's piece of an expert tensor (written out by hand, independently of ``shard_info``)."""
    (ep_rank, ep_size), (tp_rank, tp_size) = ep, etp
    n = full.shape[0] // ep_size
    mine = full[ep_rank * n : (ep_rank + 1) * n]
    if key == FC1:  # [gate; up] halves, each split over expert-TP
        gate, up = mine.chunk(2, dim=1)
        return torch.cat([gate.chunk(tp_size, 1)[tp_rank], up.chunk(tp_size, 1)[tp_rank]], 1).contiguous()
    return mine.chunk(tp_size, 2)[tp_rank].contiguous()


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        if group.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(group.size)]
        dist.all_gather(parts, x.contiguous(), group=group.pg)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group
        if group.size == 1:
            return grad, None
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=group.pg)
        return grad.chunk(group.size)[group.rank].contiguous(), None


class _SumToOwner(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        if group.size == 1:
            return y
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group.pg)
        return y.chunk(group.size)[group.rank].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group
        if group.size == 1:
            return grad, None
        parts = [torch.empty_like(grad) for _ in range(group.size)]
        dist.all_gather(parts, grad.contiguous(), group=group.pg)
        return torch.cat(parts), None


def _param(t: torch.Tensor, dtype: torch.dtype, **attrs: Any) -> nn.Parameter:
    p = nn.Parameter(t.to(dtype).clone(), requires_grad=attrs.pop("requires_grad", True))
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


class ToyMoE(nn.Module):
    def __init__(self, state: ParallelState, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
        super().__init__()
        self.state = state
        self.dense = nn.Linear(H, H, dtype=dtype)
        with torch.no_grad():
            self.dense.weight.copy_(weights["dense.weight"])
            self.dense.bias.copy_(weights["dense.bias"])
        self.router = nn.Module()
        self.router.weight = _param(weights["router.weight"], dtype)
        self.router.expert_bias = _param(weights["router.expert_bias"], torch.float32, requires_grad=False)
        ep, etp = (state.ep.rank, state.ep.size), (state.expert_tp.rank, state.expert_tp.size)
        self.experts = nn.Module()
        for key, dim, stride in ((FC1, 1, 2), (FC2, 2, 1)):
            attrs: dict[str, Any] = dict(expert_parallel=True, expert_shard=ep, global_shape=tuple(weights[key].shape))
            if etp[1] > 1:
                attrs.update(tensor_model_parallel=True, partition_dim=dim, partition_stride=stride)
            layer = nn.Module()
            layer.weight = _param(local_piece(key, weights[key], ep, etp), dtype, **attrs)
            setattr(self.experts, key.split(".")[1], layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.state.expert_tp_ep
        h = torch.tanh(self.dense(x))
        gates = torch.softmax(h @ self.router.weight.T + self.router.expert_bias, dim=-1)
        hg, gg = _Gather.apply(h, group), _Gather.apply(gates, group)
        fc1, fc2 = self.experts.linear_fc1.weight, self.experts.linear_fc2.weight
        first = self.state.ep.rank * fc1.shape[0]
        gate, up = torch.einsum("th,eoh->eto", hg, fc1).chunk(2, dim=-1)
        y = torch.einsum("etf,ehf->eth", F.silu(gate) * up, fc2)
        y = (y * gg[:, first : first + fc1.shape[0]].T.unsqueeze(-1)).sum(0)
        return (h + _SumToOwner.apply(y, group)).pow(2).mean()

    def sharded_state_dict(self) -> dict[str, Any]:
        return {n: shard_info(n, p, shard_group(p, self.state)) for n, p in self.named_parameters()}


def tokens(step: int, dp: int, seed: int = 11) -> torch.Tensor:
    """The global batch of one step, ``[dp, TOKENS, H]`` (float64): data-parallel rank ``d`` takes row ``d``."""
    return torch.randn(dp, TOKENS, H, generator=torch.Generator().manual_seed(seed + step), dtype=torch.float64)


def reference_loss(w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The mean over data-parallel ranks of each rank's loss, computed with the full weights in one process."""
    losses = []
    for xd in x:
        h = torch.tanh(xd @ w["dense.weight"].T + w["dense.bias"])
        gates = torch.softmax(h @ w["router.weight"].T + w["router.expert_bias"], dim=-1)
        gate, up = torch.einsum("th,eoh->eto", h, w[FC1]).chunk(2, dim=-1)
        y = torch.einsum("etf,ehf->eth", F.silu(gate) * up, w[FC2])
        losses.append((h + (y * gates.T.unsqueeze(-1)).sum(0)).pow(2).mean())
    return torch.stack(losses).mean()


def reference_grads(w: dict[str, torch.Tensor], x: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {k: v.clone().requires_grad_(k != "router.expert_bias") for k, v in w.items()}
    reference_loss(params, x).backward()
    return {k: p.grad for k, p in params.items() if p.grad is not None}


def config(ep: int, etp: int | None = None) -> ParallelConfig:
    return ParallelConfig(ep=ep, expert_tp=etp)


def piece_of(state: ParallelState, key: str, full: torch.Tensor) -> torch.Tensor:
    """What this rank holds of global tensor ``key`` (expert tensors sliced, dense ones whole)."""
    if key not in EXPERT_KEYS:
        return full
    return local_piece(key, full, (state.ep.rank, state.ep.size), (state.expert_tp.rank, state.expert_tp.size))
