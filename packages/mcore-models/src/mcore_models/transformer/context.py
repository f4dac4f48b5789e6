"""What every module of a model needs to know about its parallel surroundings, passed explicitly."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from mcore_parallel import Group
from mcore_parallel.tensor import MODEL_PARALLEL_RNG, RNGStatesTracker, derive_seed

__all__ = ["ModelContext"]


@dataclass(frozen=True, eq=False)
class ModelContext:
    """Tensor-parallel group, sequence parallelism, RNG streams, device and the base seed of one model, and the
    groups of its MoE layers (one-member groups when not given)."""

    tp: Group
    sequence_parallel: bool = False
    rng_tracker: RNGStatesTracker | None = None
    device: torch.device | str | None = None
    seed: int = 1234
    ep: Group | None = None
    """Expert parallelism: the ranks that split the experts of an MoE layer."""
    expert_tp: Group | None = None
    """Tensor parallelism inside each expert (the same ranks as ``tp``, or one rank)."""
    balance: Group | None = None
    """The ranks of this pipeline stage (tp x cp x dp): token counts of the global load-balancing loss and of the
    expert bias update are summed over it."""

    @property
    def expert_parallel(self) -> Group:
        return self.ep or Group.single("ep")

    @property
    def expert_tensor_parallel(self) -> Group:
        return self.expert_tp or Group.single("expert_tp")

    @property
    def balance_group(self) -> Group:
        return self.balance or Group.single("balance")

    def seed_for(self, name: str) -> int:
        """The initialisation seed of the parameter with fully qualified name ``name``."""
        return derive_seed(self.seed, name)

    def model_parallel_rng(self) -> Any:
        """A context drawing from the per-TP-rank stream (or the default RNG when no tracker was given)."""
        return self.rng_tracker.fork(MODEL_PARALLEL_RNG) if self.rng_tracker is not None else nullcontext()

    def sp_region_rng(self) -> Any:
        """RNG for randomness on sequence-parallel activations: per-rank under SP, the default stream otherwise."""
        return self.model_parallel_rng() if self.sequence_parallel else nullcontext()

    def recompute(self, fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """Run ``fn(*args)`` without keeping its activations; recomputed in backward with the same randomness.

        torch's checkpoint restores the default RNG for the recomputation; the tracker's named streams are
        restored here too, so dropout inside ``fn`` draws the same masks twice.
        """
        tracker = self.rng_tracker
        saved = tracker.state_dict() if tracker is not None else None
        calls = [0]

        def run(*a: Any) -> torch.Tensor:
            calls[0] += 1
            if calls[0] == 1 or tracker is None or saved is None:
                return fn(*a)
            with _swapped(tracker, saved):
                return fn(*a)

        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)


@contextmanager
def _swapped(tracker: RNGStatesTracker, states: dict[str, torch.Tensor]) -> Iterator[None]:
    current = tracker.state_dict()
    tracker.load_state_dict(states)
    try:
        yield
    finally:
        tracker.load_state_dict(current)
