"""One optimizer step of FP8 layers: the weight-cast cache and the delayed-scaling update, and the device check.

The training step runs its forward and backward passes inside ``with fp8_step(model_chunks, group):``. Inside,
each FP8 linear casts its weight once (its first forward) and every later micro-batch, and the backward, reuse that
cast; on leaving, the casts are dropped (the optimizer is about to change the weights) and, with delayed scaling, the
step's absolute maxima of every layer are reduced over ``group`` (the ranks that hold pieces or copies of the
layers: a pipeline stage's tensor-, data- and context-parallel ranks) in one all-reduce and rolled into the
histories, which sets the next step's scales. An evaluation passes ``update_scaling=False``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from mcore_parallel.fp8.layers import Fp8Linear
from mcore_parallel.fp8.scaling import roll_all, step_amaxes
from mcore_parallel.state import Group
from mcore_parallel.tensor import _comm

__all__ = ["WeightCastCache", "fp8_linears", "fp8_step", "fp8_device_problem", "roll_delayed_scaling"]


def fp8_linears(models: Iterable[nn.Module]) -> list[Fp8Linear]:
    """The FP8 linears of ``models`` that run in FP8 (not the ones that fell back to bf16), in module order."""
    return [m for model in models for m in model.modules() if isinstance(m, Fp8Linear) and m.runs_fp8]


class WeightCastCache(Protocol):
    """A module that keeps FP8 casts of its weights for one optimizer step (the FP8 linears, an MoE layer's FP8
    experts): :func:`fp8_step` opens and closes its cache."""

    def begin_weight_cache(self) -> None: ...

    def end_weight_cache(self) -> None: ...


def _caches(models: Iterable[nn.Module]) -> list[WeightCastCache]:
    # the protocol's methods looked up on the class: an isinstance check against the protocol goes through
    # nn.Module.__getattr__ for every module and method (~10 µs a module, every step)
    names = ("begin_weight_cache", "end_weight_cache")
    return [cast(WeightCastCache, m) for model in models for m in model.modules()
            if all(callable(getattr(type(m), name, None)) for name in names)]  # fmt: skip


def roll_delayed_scaling(layers: Iterable[Fp8Linear], group: Group | None = None) -> None:
    """Reduce the step's absolute maxima of the delayed-scaling ``layers`` over ``group`` (one all-reduce) and roll
    them into each layer's history."""
    states = [m.fp8_scaling for m in layers if m.fp8_scaling is not None]
    if not states:
        return
    amax = step_amaxes(states)
    if group is not None and group.size > 1:
        _comm.all_reduce(amax, group, op=dist.ReduceOp.MAX)
    roll_all(states, amax)


@contextmanager
def fp8_step(
    models: Iterable[nn.Module], group: Group | None = None, update_scaling: bool = True, grad_weight: float = 1.0
) -> Iterator[list[Fp8Linear]]:
    """Run one optimizer step's forward and backward passes of ``models``' FP8 linears: weight casts cached for the
    step, delayed scaling rolled at the end over ``group`` (unless ``update_scaling`` is false, or the body raised).
    ``grad_weight``: the factor each micro-batch's loss is backpropagated with (1 / micro-batches per rank, times an
    fp16 loss scale; mcore-train's context-parallel loss also times cp), so that gradient histories stay per unit loss (see
    :class:`~mcore_parallel.fp8.scaling.DelayedScaling`). Yields the FP8 linears. Nothing happens for models without
    FP8 layers."""
    caches = _caches(models)  # the FP8 linears and anything else that keeps weight casts (FP8 experts)
    layers = [m for m in caches if isinstance(m, Fp8Linear) and m.runs_fp8]  # (fp8_linears, from the same scan)
    states = [m.fp8_scaling for m in layers if m.fp8_scaling is not None]
    for c in caches:
        c.begin_weight_cache()
    for s in states:
        s.grad_weight, s.recording = grad_weight, update_scaling  # an evaluation's maxima stay out of the history
    try:
        yield layers
    finally:
        for c in caches:
            c.end_weight_cache()
        for s in states:
            s.recording = True
    if update_scaling:
        roll_delayed_scaling(layers, group)


def fp8_device_problem(device: torch.device | str | None) -> str | None:
    """Why FP8 GEMMs cannot run on ``device`` (None when they can). CUDA needs compute capability 8.9 or newer
    (Ada, Hopper, Blackwell); the CPU runs ``torch._scaled_mm`` too (slowly: for tests)."""
    dev = torch.device(device if device is not None else "cpu")
    if not hasattr(torch, "_scaled_mm"):
        return f"this PyTorch ({torch.__version__}) has no torch._scaled_mm; install PyTorch 2.4 or newer"
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        return f"FP8 GEMMs run on CUDA GPUs (and the CPU), not on {dev.type}"
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(dev)
        return (f"{name} has compute capability {major}.{minor}; FP8 GEMMs need 8.9 or newer (L4/L40, H100/H200, "
                "B200)")  # fmt: skip
    return None
