"""``MoEConfig``: the mixture-of-experts part of a :class:`~mcore_models.config.TransformerConfig`.

The names follow Megatron-LM's ``--moe-*`` flags without the prefix (``router_topk`` is ``--moe-router-topk``,
``num_experts`` is ``--num-experts``). A config with ``moe=None`` is a dense model; with a ``MoEConfig`` the layers
that :meth:`MoEConfig.is_moe_layer` selects get a :class:`~mcore_models.moe.MoELayer` in place of the MLP.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["MoEConfig"]

ScoreFunction = Literal["softmax", "sigmoid"]
LoadBalancing = Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "none"]
DropPolicy = Literal["probs", "position"]
Dispatcher = Literal["alltoall", "allgather"]


@dataclass(frozen=True)
class MoEConfig:
    """Experts, router, load balancing and capacity of the MoE layers."""

    num_experts: int = 8
    """Routed experts per MoE layer."""
    ffn_hidden_size: int | None = None
    """Each routed expert's MLP width; ``None`` = the model's ``ffn_hidden_size``."""
    layer_freq: int | list[int] = 1
    """Which layers are MoE: an integer N puts an MoE layer at every layer whose number is a multiple of N (1: all),
    a list gives 1 (MoE) or 0 (dense MLP) for each layer."""
    router_topk: int = 2
    """Experts each token is sent to."""
    router_score_function: ScoreFunction = "softmax"
    """softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3) of the router logits."""
    router_pre_softmax: bool = False
    """softmax over all experts, then top-k without renormalising (Qwen2-MoE, ``norm_topk_prob=false``); False: top-k
    of the logits, then softmax over the k chosen (Mixtral; equal to renormalised top-k probabilities)."""
    router_topk_scaling_factor: float | None = None
    """Multiply the chosen experts' weights by this (DeepSeek-V3: 2.5); None = 1."""
    router_num_groups: int | None = None
    """Group-limited routing (DeepSeek-V3): experts split into this many groups ..."""
    router_group_topk: int | None = None
    """... of which the ``router_group_topk`` best (by the sum of their top-(k / group_topk) scores) are eligible."""
    router_enable_expert_bias: bool = False
    """Aux-loss-free load balancing: a per-expert bias added to the scores for selection only, moved after every
    step by ``router_bias_update_rate`` towards equal load (DeepSeek-V3)."""
    router_bias_update_rate: float = 1e-3
    """Step of the expert bias update: ``bias += rate * sign(mean load - expert load)``."""
    input_jitter_eps: float | None = None
    """Multiply the router's input by uniform noise in ``[1 - eps, 1 + eps]`` while training (Switch)."""
    z_loss_coeff: float | None = None
    """Router z-loss coefficient (ST-MoE): ``coeff * mean(logsumexp(logits)^2)``; None = off."""
    load_balancing_type: LoadBalancing = "aux_loss"
    """aux_loss (GShard/Switch over the micro-batch), seq_aux_loss (per sequence, DeepSeek), global_aux_loss (token
    counts summed over the data-parallel ranks of the micro-batch), or none."""
    aux_loss_coeff: float = 0.0
    """Coefficient of the load-balancing loss (0: computed and logged, not trained on)."""
    shared_expert_ffn_hidden_size: int | None = None
    """Width of the always-on shared expert MLP (DeepSeek, Qwen2-MoE); None = no shared expert."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by ``sigmoid(x @ gate)`` (Qwen2-MoE's ``shared_expert_gate``)."""
    capacity_factor: float | None = None
    """None: dropless (every token reaches its experts). A number: each expert takes at most
    ``ceil(tokens * topk / num_experts * capacity_factor)`` tokens of a micro-batch and drops the rest."""
    token_drop_policy: DropPolicy = "probs"
    """With a capacity: keep the tokens with the highest routing weight (probs) or the earliest (position)."""
    pad_expert_input_to_capacity: bool = False
    """With a capacity: pad every expert's input to exactly the capacity (static shapes)."""
    token_dispatcher: Dispatcher = "alltoall"
    """How tokens reach experts on other expert-parallel ranks: alltoall (variable splits) or allgather (every rank
    sees every token of its expert-parallel group; cheaper for small ep)."""

    def expert_ffn(self, dense_ffn: int) -> int:
        return dense_ffn if self.ffn_hidden_size is None else self.ffn_hidden_size

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` (0-based) has an MoE MLP."""
        if isinstance(self.layer_freq, int):
            return layer_number % self.layer_freq == 0
        return bool(self.layer_freq[layer_number])

    def problems(self, num_layers: int) -> list[str]:
        """Every problem of this MoE config for a model of ``num_layers`` layers (empty when valid)."""
        p: list[str] = []

        def positive(name: str, v: Any) -> None:
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                p.append(f"moe.{name}={v!r} must be a positive integer")

        for name in ("num_experts", "ffn_hidden_size", "router_topk", "router_num_groups", "router_group_topk",
                     "shared_expert_ffn_hidden_size"):  # fmt: skip
            positive(name, getattr(self, name))
        if p:
            return p
        if self.router_topk > self.num_experts:
            p.append(f"moe.router_topk={self.router_topk} exceeds moe.num_experts={self.num_experts}")
        if isinstance(self.layer_freq, int):
            positive("layer_freq", self.layer_freq)
        elif len(self.layer_freq) != num_layers or any(v not in (0, 1) for v in self.layer_freq):
            p.append(f"moe.layer_freq={self.layer_freq!r} must be an integer or a list of {num_layers} zeros and ones")
        if (self.router_num_groups is None) != (self.router_group_topk is None):
            p.append("moe.router_num_groups and moe.router_group_topk must be set together (group-limited routing)")
        elif self.router_num_groups is not None and self.router_group_topk is not None:
            g, gk = self.router_num_groups, self.router_group_topk
            if self.num_experts % g:
                p.append(f"moe.num_experts={self.num_experts} is not divisible by moe.router_num_groups={g}")
            if gk > g:
                p.append(f"moe.router_group_topk={gk} exceeds moe.router_num_groups={g}")
            elif self.router_topk % gk:
                p.append(f"moe.router_topk={self.router_topk} is not divisible by moe.router_group_topk={gk}")
            elif self.router_topk > gk * (self.num_experts // g):
                p.append(f"moe.router_topk={self.router_topk} exceeds the experts of {gk} groups")
        if self.router_pre_softmax and self.router_score_function != "softmax":
            p.append("moe.router_pre_softmax needs router_score_function='softmax'")
        if self.router_topk_scaling_factor is not None and self.router_topk_scaling_factor <= 0:
            p.append(f"moe.router_topk_scaling_factor={self.router_topk_scaling_factor} must be positive")
        if self.router_bias_update_rate < 0:
            p.append(f"moe.router_bias_update_rate={self.router_bias_update_rate} must be >= 0")
        if self.input_jitter_eps is not None and not 0 < self.input_jitter_eps < 1:
            p.append(f"moe.input_jitter_eps={self.input_jitter_eps} must be in (0, 1)")
        for name in ("z_loss_coeff", "aux_loss_coeff"):
            v = getattr(self, name)
            if v is not None and v < 0:
                p.append(f"moe.{name}={v} must be >= 0")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            p.append(f"moe.capacity_factor={self.capacity_factor} must be positive (or None: dropless)")
        if self.pad_expert_input_to_capacity and self.capacity_factor is None:
            p.append("moe.pad_expert_input_to_capacity needs moe.capacity_factor")
        if self.pad_expert_input_to_capacity and self.token_dispatcher == "allgather":
            p.append("moe.pad_expert_input_to_capacity needs moe.token_dispatcher='alltoall'")
        for name, allowed in (
            ("router_score_function", ("softmax", "sigmoid")),
            ("load_balancing_type", ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")),
            ("token_drop_policy", ("probs", "position")),
            ("token_dispatcher", ("alltoall", "allgather")),
        ):
            if getattr(self, name) not in allowed:
                p.append(f"moe.{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}")
        return p

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
