"""The router: scores, top-k selection (optionally group-limited and bias-adjusted) and the auxiliary losses.

:func:`route` is the pure selection rule, float32 throughout:

- ``softmax`` scores, ``pre_softmax=False`` (Mixtral): top-k of the logits, then softmax over the k chosen.
- ``softmax`` scores, ``pre_softmax=True`` (Qwen2-MoE): softmax over every expert, then top-k, not renormalised.
- ``sigmoid`` scores (DeepSeek-V3): top-k of ``sigmoid(logits)``, the chosen scores divided by their sum (k > 1).

The expert bias (aux-loss-free balancing) and group limits change which experts are chosen, never the weights.
The load-balancing losses follow GShard / Switch: ``coeff * E * sum_e f_e * P_e`` with ``f_e`` the fraction of the
top-k choices that went to expert ``e`` and ``P_e`` its mean score over the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mcore_models.config import TransformerConfig
from mcore_models.moe_config import MoEConfig
from mcore_models.transformer.context import ModelContext
from mcore_parallel.tensor import init_sharded_, normal_init

__all__ = ["TopKRouter", "Routing", "route", "expert_counts", "switch_aux_loss", "z_loss"]


@dataclass
class Routing:
    """The router's decision for ``T`` tokens."""

    probs: torch.Tensor
    """``[T, k]`` float32 weight of each chosen expert."""
    indices: torch.Tensor
    """``[T, k]`` int64 chosen experts."""
    scores: torch.Tensor
    """``[T, E]`` float32 scores over every expert (softmax, or sigmoid normalised per token): the ``P`` of the
    load-balancing loss."""
    logits: torch.Tensor
    """``[T, E]`` float32 router logits (for the z-loss)."""


def _group_limited(choice: torch.Tensor, groups: int, group_topk: int, topk: int) -> torch.Tensor:
    """``choice`` with every expert outside the ``group_topk`` best groups set to -inf; a group's score is the sum of
    its best ``topk // group_topk`` choice scores (DeepSeek-V3's node-limited routing)."""
    t, e = choice.shape
    grouped = choice.view(t, groups, e // groups)
    group_score = grouped.topk(topk // group_topk, dim=-1).values.sum(-1)
    best = group_score.topk(group_topk, dim=-1).indices
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(t, e)


def route(logits: torch.Tensor, moe: MoEConfig, expert_bias: torch.Tensor | None = None) -> Routing:
    """Choose ``moe.router_topk`` experts per row of ``logits`` ``[T, E]`` (see the module docstring)."""
    logits = logits if logits.dtype == torch.float64 else logits.float()  # float32 at least (float64: references)
    k = moe.router_topk
    if moe.router_score_function == "softmax":
        all_scores = torch.softmax(logits, dim=-1)
        scores = all_scores if moe.router_pre_softmax else logits
    else:
        scores = torch.sigmoid(logits)
        all_scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
    choice = scores if expert_bias is None else scores + expert_bias.float()
    if moe.router_num_groups is not None and moe.router_group_topk is not None:
        choice = _group_limited(choice, moe.router_num_groups, moe.router_group_topk, k)
    indices = choice.topk(k, dim=-1).indices
    chosen = scores.gather(-1, indices)
    if moe.router_score_function == "softmax":
        probs = chosen if moe.router_pre_softmax else torch.softmax(chosen, dim=-1)
    else:
        probs = chosen / (chosen.sum(-1, keepdim=True) + 1e-20) if k > 1 else chosen
    if moe.router_topk_scaling_factor is not None:
        probs = probs * moe.router_topk_scaling_factor
    return Routing(probs, indices, all_scores, logits)


def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[E]`` float32 number of choices per expert (indices < 0 are dropped slots and not counted)."""
    flat = indices.reshape(-1)
    valid = (flat >= 0).float()
    return torch.zeros(num_experts, dtype=torch.float32, device=flat.device).scatter_add_(0, flat.clamp(min=0), valid)


def switch_aux_loss(
    score_sum: torch.Tensor, counts: torch.Tensor, tokens: int, topk: int, coeff: float
) -> torch.Tensor:
    """``coeff * E * sum_e (counts_e / (tokens * topk)) * (score_sum_e / tokens)``.

    ``counts`` are the choices per expert over all ``tokens`` of the balanced set; ``score_sum`` the scores summed
    over the tokens this rank holds, so with sequence parallelism the ranks' results add up to the loss."""
    e = score_sum.shape[-1]
    return (score_sum * counts).sum() * (coeff * e / (tokens * tokens * topk))


def z_loss(logits: torch.Tensor, tokens: int, coeff: float) -> torch.Tensor:
    """``coeff * sum(logsumexp(logits)^2) / tokens`` over this rank's rows (ST-MoE's router z-loss; ``tokens`` all
    the micro-batch's tokens, so sequence-parallel ranks' results add up to the mean)."""
    return torch.logsumexp(logits, dim=-1).square().sum() * (coeff / tokens)


class TopKRouter(nn.Module):
    """``weight`` ``[E, hidden]`` (replicated on every rank) and, with aux-loss-free balancing, ``expert_bias``."""

    def __init__(self, config: TransformerConfig, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.moe, self.training_jitter = moe, moe.input_jitter_eps
        e, h = moe.num_experts, config.hidden_size
        self.weight = nn.Parameter(torch.empty(e, h, dtype=config.dtype, device=ctx.device))
        init_sharded_(
            self.weight, (e, h), 0, 0, 1, normal_init(config.init_method_std), ctx.seed_for(f"{prefix}.weight")
        )
        if ctx.sequence_parallel:  # each rank routes its own tokens: the gradient is summed over tp
            self.weight.sequence_parallel = True  # type: ignore[attr-defined]
        self.expert_bias: nn.Parameter | None = None
        if moe.router_enable_expert_bias:
            self.expert_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32, device=ctx.device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> Routing:
        """Route the tokens ``x`` ``[T, hidden]``."""
        if self.training and self.training_jitter:
            eps = self.training_jitter
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        dtype = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.to(dtype), self.weight.to(dtype))
        return route(logits, self.moe, self.expert_bias)
