"""``norm_row_linear``: the residual add and RMSNorm inside the one-row GEMV after them, against float64. The kernel
runs on GPUs, or on the CPU under ``TRITON_INTERPRET=1`` (float32); elsewhere the op computes with PyTorch ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_infer.kernels import GemvLaunch
from mcore_infer.kernels.norm_gemv import norm_row_linear, norm_row_linear_reference
from tests.infer._kernels import KERNEL_DEVICES

needs_kernel = pytest.mark.skipif(not KERNEL_DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 + Triton")


def _float64(x: torch.Tensor, residual: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    h = residual.double() + (x.double().sum(0) if x.dim() > residual.dim() else x.double())
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * g.double()
    return F.linear(normed, w.double()), h


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("rows,n,k", [(1, 96, 64), (2, 40, 80), (4, 130, 48)])
@pytest.mark.parametrize("splits", [-1, 0, 1, 2], ids=["no-residual", "plain", "1-partial", "2-partials"])
@pytest.mark.parametrize("launch", [None, "1,8,16,2", "1,32,64,4", "1,16,32,4"])
def test_kernel_equals_float64(device: str, rows: int, n: int, k: int, splits: int, launch: str | None) -> None:
    """Inputs of the residual's shape or float32 partial sums, sizes that are not multiples of the blocks (or powers
    of two), several K steps, or a whole row of one or two tiles normalised once: the product and h equal float64."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(rows + n + k + splits)
    residual = torch.randn(rows, 1, k, generator=gen).to(device, dtype)
    if splits > 0:
        x = torch.randn(splits, rows, 1, k, generator=gen).to(device)
    else:
        x = torch.randn(rows, 1, k, generator=gen).to(device, dtype)
    g = (1 + 0.2 * torch.randn(k, generator=gen)).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    if splits < 0:  # no residual: h is x
        residual, x = None, residual
    y, h = norm_row_linear(x, residual, g, 1e-5, w, None if launch is None else GemvLaunch.parse(launch))
    assert y.shape == (rows, 1, n) and y.dtype == dtype and h.shape == (rows, 1, k) and h.dtype == dtype
    ref_y, ref_h = _float64(x, torch.zeros_like(x) if residual is None else residual, g, w)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(h.double(), ref_h, rtol=tol, atol=tol)
    torch.testing.assert_close(y.double(), ref_y, rtol=tol, atol=tol)


def test_pytorch_path_and_refusals() -> None:
    """Outside the kernel's devices the op is the unfused ops; what the kernel cannot take is refused by name."""
    torch.manual_seed(0)
    residual = torch.randn(2, 1, 32, dtype=torch.float64)
    parts = torch.randn(3, 2, 1, 32, dtype=torch.float64)
    g, w = torch.rand(32, dtype=torch.float64) + 0.5, torch.randn(24, 32, dtype=torch.float64)
    y, h = norm_row_linear(parts, residual, g, 1e-5, w)
    ref_y, ref_h = norm_row_linear_reference(parts, residual, g, 1e-5, w)
    torch.testing.assert_close(y, ref_y, rtol=0, atol=0)
    torch.testing.assert_close(h, ref_h, rtol=0, atol=0)
    # (add_deferred sums partials in float32, as the kernels do: float32's rounding, not float64's)
    torch.testing.assert_close(ref_y, _float64(parts, residual, g, w)[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="at most 4 rows, got 5"):
        norm_row_linear(torch.zeros(5, 32), torch.zeros(5, 32), g.float(), 1e-5, w.float())
    with pytest.raises(ValueError, match="neither residual's shape"):
        norm_row_linear(torch.zeros(2, 1, 31), residual.float(), g.float(), 1e-5, w.float())
    with pytest.raises(ValueError, match=r"norm weight \(31,\) and weight \(24, 32\)"):
        norm_row_linear(parts, residual, g[:31], 1e-5, w)
    with pytest.raises(ValueError, match="SPLITS=2"):
        norm_row_linear(parts, residual, g, 1e-5, w, GemvLaunch(2, 8))


def test_compiled_graph_keeps_the_op() -> None:
    """The custom op and its fake: ``torch.compile`` (fullgraph) traces it with its output shapes."""
    residual, x = torch.randn(1, 1, 32), torch.randn(1, 1, 1, 32)
    g, w = torch.rand(32) + 0.5, torch.randn(24, 32)
    fn = torch.compile(lambda a, r: norm_row_linear(a, r, g, 1e-5, w), fullgraph=True, backend="eager")
    y, h = fn(x, residual)
    ref_y, ref_h = norm_row_linear_reference(x, residual, g, 1e-5, w)
    torch.testing.assert_close(y, ref_y)
    torch.testing.assert_close(h, ref_h)
