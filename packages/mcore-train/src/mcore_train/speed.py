"""The speed switches' ``auto`` values: what each becomes on this run's device, and why.

Two switches measured as wins on GPUs default to ``auto`` (``bench/results/train-switches/h200.md``; each is tested to
train like the plain path, ``tests/train/test_speed_matrix.py``):

- ``training.compile``: ``layers`` on CUDA (one H200, llama-1b: 92.3% of the tokens/s without it), ``none`` elsewhere;
  ``none`` also on CUDA for an MoE model that trains on its auxiliary losses (compiled MoE layers drop their
  gradient at graph breaks, see ``docs/training.md``).
- ``parallel.gradient_accumulation_fusion``: ``true`` on CUDA (weight gradients added into the float32
  ``main_grad`` by the GEMM itself: one pass over every weight gradient fewer per micro-batch), ``false`` elsewhere
  and with ``parallel.tp_comm_in_graph`` (the traced linears cannot add in place).

An explicit value is kept as set. :func:`resolve_speed` answers for a config and a device; :func:`describe` is the
one line the run logs at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mcore_train.config import TrainConfig

__all__ = ["SpeedChoices", "resolve_speed", "describe"]


@dataclass(frozen=True)
class SpeedChoices:
    """The resolved speed switches of one run, each with the reason it has that value."""

    compile: str
    """``none`` or ``layers``."""
    compile_why: str
    gradient_accumulation_fusion: bool
    fusion_why: str


def _moe_trains_aux_losses(config: TrainConfig) -> bool:
    moe = config.model.moe
    if moe is None:
        return False
    balancing = moe.load_balancing_type != "none" and moe.aux_loss_coeff > 0
    return balancing or bool(moe.z_loss_coeff)


def resolve_speed(config: TrainConfig, device: torch.device | str) -> SpeedChoices:
    """What ``training.compile`` and ``parallel.gradient_accumulation_fusion`` are for a run of ``config`` on
    ``device`` (their ``auto`` values resolved, explicit values kept)."""
    kind = torch.device(device).type
    compile_, compile_why = _compile(config, kind)
    fusion, fusion_why = _fusion(config, kind)
    return SpeedChoices(compile_, compile_why, fusion, fusion_why)


def _compile(config: TrainConfig, kind: str) -> tuple[str, str]:
    choice = config.training.compile
    if choice != "auto":
        return choice, "as set"
    if kind != "cuda":
        return "none", f"auto on {kind}: measured a win on GPUs only"
    if _moe_trains_aux_losses(config):
        return "none", ("auto: the MoE layers train on auxiliary losses, whose gradient compiled layers drop at "
                        "graph breaks; training.compile=layers forces it")  # fmt: skip
    return "layers", "auto on cuda: measured faster, trains like eager"


def _fusion(config: TrainConfig, kind: str) -> tuple[bool, str]:
    choice = config.parallel.gradient_accumulation_fusion
    if choice != "auto":
        return bool(choice), "as set"
    if kind != "cuda":
        return False, f"auto on {kind}: measured on GPUs only"
    if config.parallel.tp_comm_in_graph:
        return False, "auto: parallel.tp_comm_in_graph traces the linears, which cannot add into main_grad"
    return True, "auto on cuda: one pass over the weight gradients fewer, trains like the unfused path"


def describe(choices: SpeedChoices) -> str:
    """One line: each switch's value and why, and how to turn an enabled one off."""
    fusion = "true" if choices.gradient_accumulation_fusion else "false"
    off = [key for key, on in (("training.compile=none", choices.compile != "none"),
                               ("parallel.gradient_accumulation_fusion=false", choices.gradient_accumulation_fusion))
           if on]  # fmt: skip
    line = (
        f"speed switches: training.compile={choices.compile} ({choices.compile_why}), "
        f"parallel.gradient_accumulation_fusion={fusion} ({choices.fusion_why})"
    )
    return line + (f"; turn off with {' '.join(off)}" if off else "")
