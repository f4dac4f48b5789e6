"""What the Mamba-2 mixer's Triton wrappers (``ssd_triton``, ``conv_triton``, ``norm_triton``) share: where their
kernels may run (CUDA, or the CPU under Triton's interpreter) and the layout they read."""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

__all__ = ["interpreting", "channels_contiguous", "check_devices", "load_kernels"]


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``): on the CPU, for tests."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def channels_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension is contiguous (any other strides are read as they are), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def check_devices(name: str, tensors: list[torch.Tensor], hint: str = "") -> None:
    """A ``ValueError`` naming ``name`` unless ``tensors`` are on one CUDA device (or the CPU under the
    interpreter)."""
    on = tensors[0].device
    if any(t.device != on for t in tensors) or not (on.type == "cuda" or (on.type == "cpu" and interpreting())):
        raise ValueError(f"{name} needs its tensors on one CUDA device (or the CPU under TRITON_INTERPRET=1); got "
                         f"{sorted({str(t.device) for t in tensors})}{hint}")  # fmt: skip


def load_kernels(module: str, switch: str) -> dict[str, Any]:
    """The ``KERNELS`` of ``mcore_models.ssm.<module>`` (the module that defines a wrapper's Triton kernels), or an
    ``ImportError`` naming the config field ``mamba.<switch>`` when Triton is missing."""
    try:
        kernels: dict[str, Any] = importlib.import_module(f"mcore_models.ssm.{module}").KERNELS
    except ImportError as e:
        raise ImportError(f"mamba.{switch}=triton needs Triton (pip install mcore-models[gpu]); use torch") from e
    return kernels
