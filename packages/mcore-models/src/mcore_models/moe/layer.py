"""``MoELayer``: the MLP of an MoE transformer layer (router → dispatch → grouped experts → combine, plus shared
experts), built by :class:`~mcore_models.spec.LayerSpec`'s ``moe`` constructor with the MLP's signature.

Parallel layouts. Tokens are ``[s (/ tp under SP), b, hidden]``. Each rank routes the tokens it holds. With expert
tensor parallelism (``expert_tp`` = ``tp``) the tokens, weights and choices are first gathered over tp (as a
sequence-parallel MLP does), the experts' outputs are partial sums, and a reduce-scatter (or an all-reduce without
SP) over tp finishes them. With ``expert_tp`` = 1 every rank computes whole experts for its own tokens. Across
expert-parallel ranks the rows travel by all-to-all (``token_dispatcher='alltoall'``) or every rank sees every token
of its ep group (``'allgather'``: all-gather in, reduce-scatter out).

Auxiliary losses (load balancing, z-loss) are added to the training objective through the backward pass: their
gradient is injected where the layer's output is used, scaled by ``aux_loss_scale`` (the factor the training step
applies to the main loss: 1 / micro-batches, times the fp16 loss scale), so pipeline stages without the loss train
on them too. ``stats`` accumulates, per rank, the losses, dropped choices and tokens per expert of each training
forward for logging (:func:`~mcore_models.moe.metrics.moe_metrics`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mcore_models.config import TransformerConfig
from mcore_models.moe.dispatch import (
    _choice_map,
    alltoall_dispatch,
    alltoall_return,
    apply_capacity,
    capacity,
    combine,
    gather_rows,
    padded_plan,
    plan,
)
from mcore_models.moe.experts import GroupedExperts, _Weight
from mcore_models.moe.router import TopKRouter, expert_counts, switch_aux_loss, z_loss
from mcore_models.transformer.context import ModelContext
from mcore_models.transformer.mlp import MLP
from mcore_parallel.tensor import (
    _comm,
    copy_to_tp_region,
    gather_from_sp_region,
    init_sharded_,
    normal_init,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
)

if TYPE_CHECKING:
    from mcore_models.spec import LayerSpec

__all__ = ["MoELayer", "SharedExpertMLP", "STAT_FIELDS"]

STAT_FIELDS = ("aux_loss", "z_loss", "dropped", "forwards")
"""The first entries of :attr:`MoELayer.stats`; tokens per expert follow."""


class _AttachAux(torch.autograd.Function):
    """``out`` (a copy); in backward the auxiliary loss gets the gradient ``scale``. The copy matters under
    ``torch.compile``: an output aliasing an input is replayed outside the function and would lose the loss."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return out.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return g, scale.to(torch.float32).reshape(()), None


class SharedExpertMLP(MLP):
    """The always-on expert: a dense (tensor-parallel) MLP, optionally scaled by ``sigmoid(x @ gate^T)``."""

    def __init__(self, config: TransformerConfig, ctx: ModelContext, spec: LayerSpec, prefix: str) -> None:
        moe = config.moe
        assert moe is not None and moe.shared_expert_ffn_hidden_size is not None
        super().__init__(config.replace(ffn_hidden_size=moe.shared_expert_ffn_hidden_size), ctx, spec, prefix)
        self.gate: _Weight | None = None
        if moe.shared_expert_gate:
            self.gate = _Weight(nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.dtype, device=ctx.device)))
            init_sharded_(self.gate.weight, (1, config.hidden_size), 0, 0, 1, normal_init(config.init_method_std),
                          ctx.seed_for(f"{prefix}.gate.weight"))  # fmt: skip
            if ctx.sequence_parallel:
                self.gate.weight.sequence_parallel = True  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.gate is None:
            return out
        return out * torch.sigmoid(torch.nn.functional.linear(x, self.gate.weight))


class MoELayer(nn.Module):
    """Routed experts (and shared experts) in place of a layer's MLP; see the module docstring."""

    stats: torch.Tensor
    aux_loss_scale: torch.Tensor
    bias_counts: torch.Tensor

    def __init__(self, config: TransformerConfig, ctx: ModelContext, spec: LayerSpec, prefix: str) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.moe, self.ctx = moe, ctx
        tp, etp = ctx.tp, ctx.expert_tensor_parallel
        if etp.size > 1 and etp.ranks != tp.ranks:
            raise ValueError(f"expert_tp={etp.size} must be 1 or the tensor-parallel size tp={tp.size} (same ranks)")
        if tp.size > 1 and not ctx.sequence_parallel and etp.size == 1:
            raise ValueError("MoE with tp > 1 and expert_tp = 1 needs sequence parallelism (sequence_parallel=true)")
        if moe.pad_expert_input_to_capacity and moe.token_dispatcher == "allgather":
            raise ValueError("moe.pad_expert_input_to_capacity needs moe.token_dispatcher='alltoall'")
        self.router = TopKRouter(config, ctx, f"{prefix}.router")
        self.experts = GroupedExperts(config, ctx, f"{prefix}.experts", fp8=spec.experts_fp8)
        self.shared_experts = (
            SharedExpertMLP(config, ctx, spec, f"{prefix}.shared_experts")
            if moe.shared_expert_ffn_hidden_size is not None
            else None
        )
        e = moe.num_experts
        self.register_buffer("stats", torch.zeros(len(STAT_FIELDS) + e, device=ctx.device), persistent=False)
        self.register_buffer("aux_loss_scale", torch.ones((), device=ctx.device), persistent=False)
        self.register_buffer("bias_counts", torch.zeros(e, device=ctx.device), persistent=False)

    # ------------------------------------------------------------------------------------------------ losses
    def _sp(self) -> Any:
        return self.ctx.tp if self.ctx.sequence_parallel else None

    def _reduced(self, t: torch.Tensor, group: Any) -> torch.Tensor:
        return t if group is None else _comm.all_reduce(t.clone(), group)

    def _aux_loss(self, r: Any, s: int, b: int) -> torch.Tensor | None:
        moe, sp = self.moe, self._sp()
        kind, k, e = moe.load_balancing_type, moe.router_topk, moe.num_experts
        if kind == "none":
            return None
        t_local = r.indices.shape[0]
        tokens = t_local * (sp.size if sp is not None else 1)
        if kind == "seq_aux_loss":
            per_seq = _choice_map(r.indices, torch.ones_like(r.probs), e).view(s, b, e).sum(0)
            counts = self._reduced(per_seq, sp)
            seq_len = tokens // b
            score = r.scores.view(s, b, e).sum(0)
            return (counts * score).sum() * (moe.aux_loss_coeff * e / (seq_len * seq_len * k)) / b
        counts = expert_counts(r.indices, e)
        if kind == "aux_loss":
            return switch_aux_loss(r.scores.sum(0), self._reduced(counts, sp), tokens, k, moe.aux_loss_coeff)
        balance = self.ctx.balance_group
        total = t_local * balance.size
        counts = self._reduced(counts, balance if balance.size > 1 else None)
        return (counts * r.scores.sum(0)).sum() * (moe.aux_loss_coeff * e / (total * k * tokens))

    def _record(self, aux: torch.Tensor | None, z: torch.Tensor | None, counts: torch.Tensor) -> None:
        with torch.no_grad():
            dt = self.stats.dtype
            head = torch.stack([
                aux.detach().to(dt) if aux is not None else self.stats.new_zeros(()),
                z.detach().to(dt) if z is not None else self.stats.new_zeros(()),
                self.stats.new_zeros(()),  # dropped choices: added by the capacity step
                self.stats.new_ones(()),
            ])  # fmt: skip
            self.stats.add_(torch.cat([head, counts.to(dt)]))

    # ------------------------------------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[s, b, hidden]`` → the same shape."""
        s, b, h = x.shape
        tokens = x.reshape(-1, h)
        r = self.router(tokens)
        moe = self.moe
        train = self.training and torch.is_grad_enabled()
        aux = self._aux_loss(r, s, b) if self.training else None
        sp_size = self.ctx.tp.size if self.ctx.sequence_parallel else 1
        z = (
            z_loss(r.logits, tokens.shape[0] * sp_size, moe.z_loss_coeff)
            if moe.z_loss_coeff and self.training
            else None
        )
        if self.training:
            counts = expert_counts(r.indices, moe.num_experts)
            self._record(aux, z, counts)
            if self.router.expert_bias is not None:
                with torch.no_grad():
                    self.bias_counts.add_(counts)
        out = self._experts(tokens, r.indices, r.probs)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).reshape(-1, h)
        if train:
            total = None
            if aux is not None and moe.aux_loss_coeff > 0:
                total = aux
            if z is not None:
                total = z if total is None else total + z
            if total is not None:
                out = _AttachAux.apply(out, total, self.aux_loss_scale)
        return out.view(s, b, h)

    def _experts(self, tokens: torch.Tensor, indices: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The routed experts' combined output ``[T, hidden]`` for this rank's tokens."""
        moe, tp, etp = self.moe, self.ctx.tp, self.ctx.expert_tensor_parallel
        cap = None
        if moe.capacity_factor is not None:
            cap = capacity(tokens.shape[0], moe.router_topk, moe.num_experts, moe.capacity_factor)
            if not moe.pad_expert_input_to_capacity:
                indices, dropped = apply_capacity(indices, probs, moe.num_experts, cap, moe.token_drop_policy)
                probs = probs * (indices >= 0)
                if self.training:
                    with torch.no_grad():
                        self.stats[2] += dropped.to(self.stats.dtype)
        if etp.size > 1 and self.ctx.sequence_parallel:
            tokens, probs = gather_from_sp_region(tokens, tp), gather_from_sp_region(probs, tp)
            indices = _comm.all_gather(indices, tp)
        elif etp.size > 1:
            tokens, probs = copy_to_tp_region(tokens, tp), copy_to_tp_region(probs, tp)
        out = self._dispatch(tokens, indices, probs, cap)
        if etp.size > 1:
            out = reduce_scatter_to_sp_region(out, tp) if self.ctx.sequence_parallel else reduce_from_tp_region(out, tp)
        return out

    def _dispatch(self, tokens: torch.Tensor, indices: torch.Tensor, probs: torch.Tensor, cap: int | None) -> Any:
        moe, ep = self.moe, self.ctx.expert_parallel
        e, n = moe.num_experts, tokens.shape[0]
        padded = cap is not None and moe.pad_expert_input_to_capacity
        if ep.size > 1 and moe.token_dispatcher == "allgather":
            x_all, probs_all = gather_from_sp_region(tokens, ep), gather_from_sp_region(probs, ep)
            idx_all = _comm.all_gather(indices, ep)
            p = plan(idx_all, self.experts.num_local, self.experts.first, complete=False)
            y = self.experts(x_all[p.token], p.counts)
            return reduce_scatter_to_sp_region(combine(y, p, probs_all, x_all.shape[0]), ep)
        if padded:
            assert cap is not None
            p = padded_plan(indices, probs, e, cap, moe.token_drop_policy)
        else:
            p = plan(indices, e, complete=cap is None)
        rows = gather_rows(tokens, p)
        if ep.size == 1:
            y = self.experts(rows, p.counts)
        else:
            d = alltoall_dispatch(rows, p.counts, ep)
            y = alltoall_return(self.experts(d.x, d.counts), d, ep)
        return combine(y, p, probs, n)

    # ------------------------------------------------------------------------------------------------ balance
    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor) -> None:
        """Aux-loss-free balancing: move ``router.expert_bias`` by ``rate * sign(mean - counts)`` for the tokens per
        expert ``counts`` (summed over the stage's ranks since the last update)."""
        bias = self.router.expert_bias
        if bias is None:
            return
        bias.add_(torch.sign(counts.mean() - counts) * self.moe.router_bias_update_rate)
