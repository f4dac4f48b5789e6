"""Where the Triton kernels of the model package can run in tests: CUDA with Triton, or the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``, float32)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
KERNEL_DEVICES: list = []
if torch.cuda.is_available() and HAS_TRITON:
    KERNEL_DEVICES.append(pytest.param("cuda", marks=pytest.mark.gpu))
if os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON:
    KERNEL_DEVICES.append("cpu")
