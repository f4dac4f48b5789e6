"""``norm_linear``: residual add, RMSNorm, a small-row linear layer and (optionally) SwiGLU in one kernel, against a
float64 reference. The kernel runs on GPUs, or on the CPU under ``TRITON_INTERPRET=1`` (float32); elsewhere the op
falls back to PyTorch ops, checked here too."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from mcore_models.transformer.norm_linear import MAX_ROWS, norm_linear

HAS_TRITON = importlib.util.find_spec("triton") is not None
KERNEL_DEVICES = []
if torch.cuda.is_available() and HAS_TRITON:
    KERNEL_DEVICES.append(pytest.param("cuda", marks=pytest.mark.gpu))
if os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON:
    KERNEL_DEVICES.append("cpu")


def _reference(x, residual, g, eps, w, swiglu):  # type: ignore[no-untyped-def]
    x, g, w = x.double(), g.double(), w.double()
    h = x if residual is None else x + residual.double()
    y = F.linear(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * g, w)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y, h


def _case(device: str, dtype: torch.dtype, rows: int, n: int, k: int, res: bool, swiglu: bool):  # type: ignore[no-untyped-def]
    torch.manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, 1, k, device=device, dtype=dtype)
    r = torch.randn(rows, 1, k, device=device, dtype=dtype) if res else None
    g = (1 + 0.3 * torch.randn(k, device=device)).to(dtype)
    w = (torch.randn((2 if swiglu else 1) * n, k, device=device) / k**0.5).to(dtype)
    return x, r, g, w


CASES = [(1, 96, 320, True, False), (3, 130, 300, False, False), (16, 48, 256, True, True), (1, 200, 2048, True, True)]


@pytest.mark.skipif(not KERNEL_DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 with Triton")
@pytest.mark.parametrize("device", KERNEL_DEVICES or ["cpu"])
@pytest.mark.parametrize(("rows", "n", "k", "res", "swiglu"), CASES)
def test_kernel_matches_float64(device: str, rows: int, n: int, k: int, res: bool, swiglu: bool) -> None:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x, r, g, w = _case(device, dtype, rows, n, k, res, swiglu)
    y, h = norm_linear(x, r, g, 1e-5, w, swiglu)
    y_ref, h_ref = _reference(x, r, g, 1e-5, w, swiglu)
    assert y.shape == (rows, 1, n) and h.shape == x.shape and y.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.double(), y_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(h.double(), h_ref, atol=tol, rtol=0)


@pytest.mark.skipif(not KERNEL_DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 with Triton")
@pytest.mark.parametrize("device", KERNEL_DEVICES or ["cpu"])
def test_kernel_inside_a_compiled_function(device: str) -> None:
    x, r, g, w = _case(device, torch.float32, 2, 64, 128, True, True)

    def f(x, r):  # type: ignore[no-untyped-def]
        y, h = norm_linear(x * 2, r, g, 1e-6, w, True)
        return y + 1, h

    y, h = torch.compile(f, fullgraph=True)(x, r)
    y_ref, h_ref = _reference(x * 2, r, g, 1e-6, w, True)
    torch.testing.assert_close(y.double(), y_ref + 1, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h.double(), h_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("rows", "n", "k", "res", "swiglu"), CASES[:3])
def test_pytorch_fallback_matches_float64(rows: int, n: int, k: int, res: bool, swiglu: bool) -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs the kernel instead")
    x, r, g, w = _case("cpu", torch.float32, rows, n, k, res, swiglu)
    y, h = norm_linear(x, r, g, 1e-5, w, swiglu)
    y_ref, h_ref = _reference(x, r, g, 1e-5, w, swiglu)
    torch.testing.assert_close(y.double(), y_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h.double(), h_ref, atol=1e-5, rtol=0)
    assert h.data_ptr() != x.data_ptr()  # a new tensor, never an alias of the input


def test_too_many_rows_and_odd_gated_weights_are_refused() -> None:
    x = torch.randn(MAX_ROWS + 1, 8)
    with pytest.raises(ValueError, match="at most 16 rows"):
        norm_linear(x, None, torch.ones(8), 1e-5, torch.randn(4, 8))
    with pytest.raises(ValueError, match="odd"):
        norm_linear(x[:2], None, torch.ones(8), 1e-5, torch.randn(5, 8), swiglu=True)
