"""``add_norm``: the deferred residual add and RMSNorm in one kernel against float64 (on GPUs, or on the CPU under
``TRITON_INTERPRET=1``), and its PyTorch fallback against the unfused ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_infer.kernels.add_norm import add_rms_norm
from mcore_infer.kernels.small_gemv import add_deferred
from tests.infer._kernels import KERNEL_DEVICES

needs_kernel = pytest.mark.skipif(not KERNEL_DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 + Triton")


def _reference(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
    if residual is None:
        h = x.double()
    elif x.dim() == residual.dim() + 1:
        h = residual.double() + x.double().sum(0)
    else:
        h = x.double() + residual.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.double(), h


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("form", ["partials", "plain", "no-residual"])
@pytest.mark.parametrize("rows,d", [(1, 2048), (3, 300), (4, 64)])
@pytest.mark.parametrize("pdl", [False, True], ids=["launch", "pdl"])
def test_add_rms_norm_equals_float64(device: str, form: str, rows: int, d: int, pdl: bool) -> None:
    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    residual = torch.randn(rows, 1, d, device=device, dtype=dtype)
    if form == "partials":
        x = torch.randn(3, rows, 1, d, device=device)
    else:
        x = torch.randn(rows, 1, d, device=device, dtype=dtype)
    r = None if form == "no-residual" else residual
    w = (1 + 0.1 * torch.randn(d, device=device)).to(dtype)
    normed, h = add_rms_norm(x, r, w, 1e-5, pdl=pdl)
    assert normed.shape == h.shape == (rows, 1, d) and normed.dtype == h.dtype == dtype
    ref_n, ref_h = _reference(x, r, w, 1e-5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(h.double(), ref_h, rtol=tol, atol=tol)
    torch.testing.assert_close(normed.double(), ref_n, rtol=tol, atol=tol)
    if r is not None:  # the sum is the deferred add's, bit for bit
        torch.testing.assert_close(h, add_deferred(x, r), rtol=0, atol=0)


def test_fallback_equals_the_unfused_ops() -> None:
    """float64 takes the PyTorch path everywhere (the kernels' reference checks)."""
    torch.manual_seed(1)
    residual = torch.randn(2, 1, 96, dtype=torch.float64)
    parts = torch.randn(2, 2, 1, 96, dtype=torch.float64)
    w = torch.randn(96, dtype=torch.float64)
    normed, h = add_rms_norm(parts, residual, w, 1e-6)
    want_h = add_deferred(parts, residual)
    torch.testing.assert_close(h, want_h, rtol=0, atol=0)
    torch.testing.assert_close(normed, F.rms_norm(want_h, (96,), w, 1e-6), rtol=0, atol=0)
    x = torch.randn(2, 1, 96, dtype=torch.float64)
    normed, h = add_rms_norm(x, None, w, 1e-6)
    assert h is not x and torch.equal(h, x)
    torch.testing.assert_close(normed, F.rms_norm(x, (96,), w, 1e-6), rtol=0, atol=0)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="at most 64 rows, got 65"):
        add_rms_norm(torch.randn(65, 8), None, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="neither residual's shape"):
        add_rms_norm(torch.randn(2, 8), torch.randn(2, 6), torch.ones(6), 1e-5)
    with pytest.raises(ValueError, match=r"norm weight \(6,\) for rows of 8"):
        add_rms_norm(torch.randn(2, 8), None, torch.ones(6), 1e-5)
