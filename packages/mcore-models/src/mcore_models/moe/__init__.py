"""Mixture-of-experts layers: router, token dispatch over expert-parallel ranks, grouped-GEMM experts."""

from mcore_models.moe.experts import GroupedExperts, grouped_linear, grouped_mm_applies
from mcore_models.moe.layer import MoELayer, SharedExpertMLP
from mcore_models.moe.metrics import moe_layers, moe_metrics, set_aux_loss_scale, update_expert_biases
from mcore_models.moe.router import Routing, TopKRouter, route
from mcore_models.moe_config import MoEConfig

__all__ = [
    "MoEConfig",
    "MoELayer",
    "SharedExpertMLP",
    "GroupedExperts",
    "grouped_linear",
    "grouped_mm_applies",
    "TopKRouter",
    "Routing",
    "route",
    "moe_layers",
    "moe_metrics",
    "set_aux_loss_scale",
    "update_expert_biases",
]
