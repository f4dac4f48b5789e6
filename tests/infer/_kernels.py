"""Where the Triton kernels of the inference package can run in tests: CUDA with Triton, or the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``, float32)."""

from __future__ import annotations

import os

import pytest
import torch

from mcore_infer._triton_attention import triton_available

KERNEL_DEVICES: list = []
if torch.cuda.is_available() and triton_available():
    KERNEL_DEVICES.append(pytest.param("cuda", marks=pytest.mark.gpu))
if os.environ.get("TRITON_INTERPRET") == "1" and triton_available():
    KERNEL_DEVICES.append("cpu")
INTERPRETED = "cpu" in KERNEL_DEVICES
"""The CPU runs the Triton kernels (under the interpreter) instead of their PyTorch fallbacks."""
