"""Optimizers: fp32 master weights, fp16 loss scaling, global clipping, ZeRO-1 distributed optimizer.

>>> opt = get_optimizer(OptimizerConfig(lr=3e-4), ddp_chunks, state)  # doctest: +SKIP
>>> result = opt.step()  # StepResult(success, grad_norm, num_zeros, loss_scale)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from mcore_parallel.optim.clip import clip_grads_, count_zeros, global_grad_norm
from mcore_parallel.optim.config import OptimizerConfig
from mcore_parallel.optim.distributed import DistributedOptimizer
from mcore_parallel.optim.optimizer import (
    MixedPrecisionOptimizer,
    ParamShardState,
    StepResult,
    default_no_weight_decay,
    named_trainable_params,
)
from mcore_parallel.optim.scaler import ConstantLossScaler, DynamicLossScaler, LossScaler
from mcore_parallel.state import ParallelState

__all__ = [
    "get_optimizer",
    "OptimizerConfig",
    "MixedPrecisionOptimizer",
    "DistributedOptimizer",
    "StepResult",
    "ParamShardState",
    "LossScaler",
    "ConstantLossScaler",
    "DynamicLossScaler",
    "default_no_weight_decay",
    "named_trainable_params",
    "global_grad_norm",
    "clip_grads_",
    "count_zeros",
]


def get_optimizer(
    config: OptimizerConfig, model_chunks: Sequence[nn.Module], state: ParallelState
) -> MixedPrecisionOptimizer:
    """The distributed optimizer when ``config.use_distributed_optimizer``, else the mixed-precision one."""
    cls = DistributedOptimizer if config.use_distributed_optimizer else MixedPrecisionOptimizer
    return cls(model_chunks, state, config)
