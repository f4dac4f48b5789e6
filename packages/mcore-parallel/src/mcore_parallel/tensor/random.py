"""Tensor-parallel-aware random number streams for dropout and other randomness.

Megatron's convention, kept here: the default RNG of each device is seeded identically on every TP rank (so dropout in
TP-replicated regions, e.g. on the hidden states after a row-parallel layer, draws the same mask on every rank and the
same mask as a TP=1 run), while a named ``model-parallel`` stream is seeded differently per TP rank for randomness
inside model-parallel regions (e.g. attention dropout on this rank's heads). Use ``with tracker.fork(): ...`` to draw
from a named stream. The tracker is a value: create one per run with :func:`model_parallel_seed`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["RNGStatesTracker", "model_parallel_seed", "MODEL_PARALLEL_RNG", "EXPERT_PARALLEL_RNG"]

MODEL_PARALLEL_RNG = "model-parallel"
EXPERT_PARALLEL_RNG = "expert-parallel"


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states for one device, swapped in and out of that device's default generator."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._states: dict[str, torch.Tensor] = {}
        self._seeds: dict[str, int] = {}

    def add(self, name: str, seed: int) -> None:
        """Create the stream ``name`` seeded with ``seed`` (each name and each seed may be used once)."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        if seed in self._seeds.values():
            raise ValueError(f"seed {seed} is already used by another RNG stream")
        saved = _get_state(self.device)
        gen = torch.cuda.manual_seed if self.device.type == "cuda" else torch.manual_seed
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                gen(seed)
        else:
            gen(seed)
        self._states[name] = _get_state(self.device)
        self._seeds[name] = seed
        _set_state(self.device, saved)

    @contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default stream resumes where it was afterwards."""
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} was never added; known: {sorted(self._states)}")
        saved = _get_state(self.device)
        _set_state(self.device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(self.device, saved)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The current state of every stream (for checkpoints)."""
        return {k: v.clone() for k, v in self._states.items()}

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        unknown = set(states) - set(self._states)
        if unknown:
            raise KeyError(f"unknown RNG streams {sorted(unknown)}; known: {sorted(self._states)}")
        for k, v in states.items():
            self._states[k] = v.clone()


def model_parallel_seed(
    seed: int,
    *,
    tp_rank: int = 0,
    pp_rank: int = 0,
    ep_rank: int = 0,
    expert_tp_rank: int = 0,
    device: torch.device | str = "cpu",
) -> RNGStatesTracker:
    """Seed the default RNGs and return a tracker with the model- and expert-parallel streams.

    Seeds follow Megatron: default ``seed + 100 * pp_rank`` (same on every TP rank), model-parallel
    ``default + 2718 + tp_rank``, expert-parallel ``default + 1024 + 100 * ep_rank + expert_tp_rank``.
    """
    if seed < 0:
        raise ValueError(f"seed={seed} must be non-negative")
    default = seed + 100 * pp_rank
    torch.manual_seed(default)  # seeds the CPU and every CUDA device
    tracker = RNGStatesTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, default + 2718 + tp_rank)
    tracker.add(EXPERT_PARALLEL_RNG, default + 1024 + 100 * ep_rank + expert_tp_rank)
    return tracker
