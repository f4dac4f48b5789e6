"""Token permutation and dispatch: which rows each expert computes, and how they reach the expert's rank.

A :class:`Plan` lists the rows of the permuted input, sorted by expert: ``token[r]`` is the token of row ``r``,
``counts[e]`` the rows of expert ``e``. Dropless plans come from one stable ``argsort`` of the chosen experts (static
shapes, no host synchronisation); with a capacity the dropped choices are marked ``-1`` first (:func:`apply_capacity`).
The combine adds every row's expert output, weighted by its routing probability, back to its token.

Dispatchers move a plan's rows to the ranks holding the experts: :func:`alltoall_dispatch` sends each expert-parallel
rank exactly the rows of its experts (variable splits; the counts are exchanged first and read on the host once), and
the all-gather dispatcher (:class:`~mcore_models.moe.layer.MoELayer`) gives every rank every token instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mcore_parallel import Group
from mcore_parallel.tensor.all_to_all import all_to_all, exchange_counts

__all__ = [
    "Plan",
    "plan",
    "gather_rows",
    "padded_plan",
    "apply_capacity",
    "capacity",
    "combine",
    "alltoall_dispatch",
    "Dispatched",
]


@dataclass
class Plan:
    """Rows of the permuted input, grouped by expert."""

    token: torch.Tensor
    """``[N]`` int64 token of each row."""
    counts: torch.Tensor
    """``[E]`` int64 rows per expert (on the device)."""
    slot: torch.Tensor | None
    """``[N]`` flat index ``t * k + j`` of each row's (token, choice); None for padded plans (see ``weight``)."""
    weight: torch.Tensor | None = None
    """``[N]`` float32 routing weight of each row, for padded plans (padding rows weigh 0)."""
    inverse: torch.Tensor | None = None
    """For complete plans (every choice of every token is a row): the row of each slot, ``slot[inverse] = arange``."""


class _RowGather(torch.autograd.Function):
    """``x.index_select(0, index)`` where ``inverse`` undoes it; backward gathers by the inverse (no scattered
    accumulation). With ``fold`` > 1, ``index`` picks each row of ``x`` ``fold`` times (a token's k choices) and the
    backward adds the ``fold`` copies of each row."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, fold: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.fold = fold
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (inverse,) = ctx.saved_tensors
        back = g.index_select(0, inverse)
        if ctx.fold > 1:
            back = back.view(-1, ctx.fold, g.shape[-1]).sum(1)
        return back, None, None, None


def gather_rows(tokens: torch.Tensor, p: Plan) -> torch.Tensor:
    """The permuted input ``tokens[p.token]`` ``[N, hidden]``."""
    if p.inverse is None:
        return tokens[p.token]
    assert p.slot is not None
    k = p.slot.shape[0] // tokens.shape[0]
    return _RowGather.apply(tokens, p.token, p.inverse, k)


def capacity(tokens: int, topk: int, num_experts: int, factor: float) -> int:
    """Rows each expert takes: ``ceil(tokens * topk / num_experts * factor)``, at most ``tokens``."""
    return min(tokens, math.ceil(tokens * topk / num_experts * factor))


def _choice_map(indices: torch.Tensor, values: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[T, E]`` with ``values[t, j]`` at ``(t, indices[t, j])``, zero elsewhere."""
    out = torch.zeros(indices.shape[0], num_experts, dtype=values.dtype, device=indices.device)
    return out.scatter(1, indices, values)


def _kept_rows(indices: torch.Tensor, probs: torch.Tensor, num_experts: int, cap: int, policy: str) -> torch.Tensor:
    """``[cap, E]`` the rows (tokens) each expert keeps, best first, and the ``[T, E]`` map of who chose whom."""
    chosen = _choice_map(indices, torch.ones_like(probs), num_experts) > 0
    t = indices.shape[0]
    if policy == "probs":  # the highest weights; tokens that did not choose the expert rank below every chooser
        key = torch.where(chosen, _choice_map(indices, probs, num_experts), torch.full_like(probs[:, :1], -1.0))
        return key.topk(cap, dim=0).indices
    order = torch.arange(t, device=indices.device, dtype=torch.float32)[:, None]  # the earliest choosers first
    key = torch.where(chosen, -order, -order - t)
    return key.topk(cap, dim=0).indices


def apply_capacity(
    indices: torch.Tensor, probs: torch.Tensor, num_experts: int, cap: int, policy: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the choices over each expert's capacity ``cap``: (indices with dropped choices set to -1, the number of
    dropped choices as a device scalar). ``policy``: keep the highest weights (probs) or the earliest tokens
    (position)."""
    chosen = _choice_map(indices, torch.ones_like(probs), num_experts) > 0
    rows = _kept_rows(indices, probs, num_experts, cap, policy)
    kept_map = torch.zeros_like(chosen).scatter_(0, rows, True) & chosen
    keep = kept_map.gather(1, indices)
    return torch.where(keep, indices, torch.full_like(indices, -1)), (~keep).sum()


def plan(indices: torch.Tensor, num_experts: int, first: int = 0, complete: bool = True) -> Plan:
    """The rows of experts ``first .. first + num_experts - 1`` for ``indices`` ``[T, k]`` (-1: dropped; experts
    outside the range: another rank's). ``complete``: every choice is one of these experts (dropless, all experts
    here): static shapes and no host synchronisation; otherwise the row count is read on the host."""
    k = indices.shape[1]
    flat = indices.reshape(-1) - first
    mine = (flat >= 0) & (flat < num_experts)
    key = torch.where(mine, flat, torch.full_like(flat, num_experts))
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, key, torch.ones_like(key)
    )[:num_experts]
    order = torch.argsort(key, stable=True)
    if not complete:
        order = order[: int(counts.sum())]  # rows of other ranks' experts and dropped choices sort last
        return Plan(order // k, counts, order)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.shape[0], device=order.device)
    return Plan(order // k, counts, order, inverse=inverse)


def padded_plan(indices: torch.Tensor, probs: torch.Tensor, num_experts: int, cap: int, policy: str) -> Plan:
    """Every expert gets exactly ``cap`` rows: the tokens it keeps under ``policy``, then padding rows (token 0,
    weight 0). Static shapes throughout."""
    rows = _kept_rows(indices, probs, num_experts, cap, policy)  # [cap, E]
    weights = _choice_map(indices, probs, num_experts)  # [T, E], 0 where not chosen
    w = weights.gather(0, rows)  # [cap, E]
    token = rows.t().reshape(-1)
    counts = torch.full((num_experts,), cap, dtype=torch.int64, device=indices.device)
    return Plan(token, counts, None, w.t().reshape(-1))


def combine(y: torch.Tensor, p: Plan, probs: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[tokens, hidden]``: each row of the expert output ``y`` ``[N, hidden]`` times its routing weight, added to
    its token (rows of dropped choices contribute nothing). Dropless and capacity plans add the k choices of a token
    in a fixed order (deterministic); padded plans accumulate with ``index_add``."""
    h = y.shape[-1]
    acc = torch.promote_types(y.dtype, torch.float32)  # float32 accumulation (float64 stays float64)
    if p.slot is None:
        assert p.weight is not None
        out = torch.zeros(tokens, h, dtype=acc, device=y.device)
        return out.index_add(0, p.token, y.to(acc) * p.weight[:, None].to(acc)).to(y.dtype)
    k = probs.shape[1]
    if p.inverse is not None:  # a permutation: gather back into slot order
        buf = _RowGather.apply(y, p.inverse, p.slot, 1)
    else:
        buf = torch.zeros(tokens * k, h, dtype=y.dtype, device=y.device).index_copy(0, p.slot, y)
    return (buf.view(tokens, k, h).to(acc) * probs[..., None].to(acc)).sum(1).to(y.dtype)


@dataclass
class Dispatched:
    """The rows that reached this rank's experts, and how to send their outputs back."""

    x: torch.Tensor
    """``[M, hidden]`` rows for this rank's experts, grouped by local expert."""
    counts: torch.Tensor
    """``[E_local]`` rows per local expert (device)."""
    regroup: torch.Tensor
    """Row order that turned the received (source rank, expert) blocks into expert-major order."""
    sent: list[int]
    received: list[int]


def alltoall_dispatch(x: torch.Tensor, counts: torch.Tensor, ep: Group) -> Dispatched:
    """Send rows ``x`` (grouped by global expert, ``counts`` ``[E]`` of them each) to the expert-parallel ranks that
    hold their experts (rank ``j`` holds experts ``j * E/ep ..``); returns what arrived here, grouped by local
    expert. One exchange of counts, one host read of the splits, one all-to-all of the rows."""
    n_local = counts.shape[0] // ep.size
    send = counts.view(ep.size, n_local)
    recv = exchange_counts(send, ep)  # [source rank, local expert]
    host = torch.stack([send.sum(1), recv.sum(1)]).cpu()
    sent, received = host[0].tolist(), host[1].tolist()
    rows = all_to_all(x, ep, received, sent)  # ordered by (source rank, local expert)
    block = torch.arange(ep.size * n_local, device=x.device)
    block_of_row = torch.repeat_interleave(block, recv.reshape(-1), output_size=rows.shape[0])
    key = (block_of_row % n_local) * ep.size + block_of_row // n_local  # (local expert, source rank)
    regroup = torch.argsort(key, stable=True)
    return Dispatched(rows[regroup], recv.sum(0), regroup, sent, received)


def alltoall_return(y: torch.Tensor, d: Dispatched, ep: Group) -> torch.Tensor:
    """The expert outputs ``y`` (in :class:`Dispatched` order) sent back to the ranks their rows came from, in the
    order those ranks dispatched them."""
    back = torch.empty_like(d.regroup)
    back[d.regroup] = torch.arange(d.regroup.shape[0], device=y.device)
    return all_to_all(y[back], ep, d.sent, d.received)
