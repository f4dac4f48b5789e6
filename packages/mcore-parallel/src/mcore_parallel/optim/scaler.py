"""Loss scalers for fp16 training (bf16 and fp32 need none).

The loss is multiplied by ``scale`` before backward; the optimizer divides the gradients by it, checks them for
inf/nan across every rank, and skips the step when any rank found one. The dynamic scaler halves the scale after
``hysteresis`` overflowing steps and doubles it after ``growth_interval`` consecutive clean steps.
"""

from __future__ import annotations

import logging

__all__ = ["LossScaler", "ConstantLossScaler", "DynamicLossScaler"]

logger = logging.getLogger(__name__)


class LossScaler:
    """Interface: ``scale`` and ``update(found_inf)``."""

    scale: float = 1.0

    def update(self, found_inf: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])


class ConstantLossScaler(LossScaler):
    def __init__(self, scale: float) -> None:
        if scale <= 0:
            raise ValueError(f"loss scale {scale} must be positive")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass


class DynamicLossScaler(LossScaler):
    def __init__(
        self,
        initial_scale: float = 2.0**16,
        min_scale: float = 1.0,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ) -> None:
        self.scale = float(initial_scale)
        self.min_scale, self.growth_interval, self.hysteresis = float(min_scale), growth_interval, hysteresis
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self._good_steps = 0
        self._hysteresis_left = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                logger.info("loss scale lowered to %g after an inf/nan gradient", self.scale)
            return
        self._good_steps += 1
        if self._good_steps % self.growth_interval == 0:
            self._hysteresis_left = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state.get("good_steps", 0))
        self._hysteresis_left = int(state.get("hysteresis_left", self.hysteresis))
