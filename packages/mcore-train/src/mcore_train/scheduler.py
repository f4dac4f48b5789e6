"""Learning-rate schedules: linear warmup, then cosine, linear, constant or WSD (warmup-stable-decay) to min_lr."""

from __future__ import annotations

import math
from typing import Any

from mcore_train.config import SchedulerSection

__all__ = ["LRScheduler"]


class LRScheduler:
    """``lr(step)`` for the step about to run (0-based); ``apply(optimizer, step)`` writes it into every group."""

    def __init__(self, config: SchedulerSection, peak_lr: float, train_iters: int) -> None:
        self.config, self.peak = config, peak_lr
        self.decay_iters = config.decay_iters if config.decay_iters is not None else train_iters
        if config.warmup_iters > self.decay_iters and config.decay_style != "constant":
            from mcore_train.errors import ConfigError

            raise ConfigError(
                [
                    f"scheduler.warmup_iters={config.warmup_iters} exceeds the decay length {self.decay_iters} "
                    "(scheduler.decay_iters, default training.train_iters)"
                ]
            )
        self.min_lr = min(config.min_lr, peak_lr)

    def lr(self, step: int) -> float:
        c, peak = self.config, self.peak
        if c.warmup_iters and step < c.warmup_iters:
            return peak * (step + 1) / c.warmup_iters
        if c.decay_style == "constant":
            return peak
        if step >= self.decay_iters:
            return self.min_lr
        if c.decay_style == "wsd":
            decay_len = c.wsd_decay_iters if c.wsd_decay_iters is not None else max(1, self.decay_iters // 10)
            start = self.decay_iters - decay_len
            if step < start:
                return peak
            frac = (step - start) / decay_len
            if c.wsd_decay_style == "cosine":
                mult = 0.5 * (1 + math.cos(math.pi * frac))
            elif c.wsd_decay_style == "sqrt":
                mult = 1 - math.sqrt(frac)
            else:
                mult = 1 - frac
            return self.min_lr + (peak - self.min_lr) * mult
        span = max(1, self.decay_iters - c.warmup_iters)
        frac = (step - c.warmup_iters) / span
        mult = 0.5 * (1 + math.cos(math.pi * frac)) if c.decay_style == "cosine" else 1 - frac
        return self.min_lr + (peak - self.min_lr) * mult

    def apply(self, optimizer: Any, step: int) -> float:
        lr = self.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {"peak_lr": self.peak, "decay_iters": self.decay_iters, "min_lr": self.min_lr}
