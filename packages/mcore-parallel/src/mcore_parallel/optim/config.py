"""``OptimizerConfig``: the optimizer, its hyper-parameters, clipping and fp16 loss scaling."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OptimizerConfig"]


@dataclass(frozen=True)
class OptimizerConfig:
    """Hyper-parameters of :func:`mcore_parallel.optim.get_optimizer`. Every field has a usable default."""

    optimizer: str = "adam"
    """``adam`` (AdamW: decoupled weight decay, as Megatron's ``adam``) or ``sgd`` (with momentum)."""
    lr: float = 1e-4
    """Learning rate (a scheduler may change ``param_groups[i]['lr']`` later)."""
    weight_decay: float = 0.01
    """Decay of the parameters that get it (by default not biases and not 1-D parameters such as norm weights)."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.999
    """Adam's second-moment decay."""
    adam_eps: float = 1e-8
    """Adam's denominator epsilon."""
    sgd_momentum: float = 0.9
    """SGD momentum."""
    clip_grad: float = 1.0
    """Clip the global gradient norm (over tp, pp and dp) to this value; 0 disables clipping."""
    use_distributed_optimizer: bool = False
    """ZeRO-1: shard fp32 master weights and optimizer state over dp (needs DDP with the same flag)."""
    initial_loss_scale: float = 2.0**16
    """fp16 only: starting dynamic loss scale."""
    min_loss_scale: float = 1.0
    """fp16 only: the scale never drops below this."""
    loss_scale_window: int = 1000
    """fp16 only: grow the scale after this many consecutive steps without inf/nan."""
    hysteresis: int = 2
    """fp16 only: overflowing steps tolerated before the scale is halved (Megatron's default 2)."""
    loss_scale: float | None = None
    """fp16 only: a constant loss scale instead of the dynamic one."""
    log_num_zeros_in_grad: bool = True
    """Count zero gradient elements (one more reduction per step)."""
    fused: bool | None = None
    """The torch optimizer's kernel: ``True`` fused (one kernel over every tensor, which also takes the clip factor
    and a skip flag on the device), ``False`` ``foreach``; ``None``: fused on CUDA, foreach on the CPU."""

    def __post_init__(self) -> None:
        problems = []
        if self.optimizer not in ("adam", "sgd"):
            problems.append(f"optimizer={self.optimizer!r} must be 'adam' or 'sgd'")
        if self.lr < 0 or self.weight_decay < 0 or self.clip_grad < 0:
            problems.append(f"lr={self.lr}, weight_decay={self.weight_decay}, clip_grad={self.clip_grad} must be >= 0")
        if (
            self.initial_loss_scale <= 0
            or self.min_loss_scale <= 0
            or self.loss_scale_window < 1
            or self.hysteresis < 1
        ):
            problems.append("initial_loss_scale, min_loss_scale must be > 0 and loss_scale_window, hysteresis >= 1")
        if problems:
            raise ValueError("invalid OptimizerConfig: " + "; ".join(problems))
