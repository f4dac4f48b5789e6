"""``fused_mlp``: a gated MLP of a few rows (up projection, SwiGLU, down projection; with the residual add and
RMSNorm before it too) as one kernel, and the fixed-order sum of its partials, against float64. The kernels run on GPUs, or on the CPU under ``TRITON_INTERPRET=1``
(float32); elsewhere the op computes with PyTorch ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_infer.kernels import MlpLaunch
from mcore_infer.kernels.fused_mlp import (
    fused_mlp_partials,
    fused_mlp_reference,
    heuristic_mlp_launch,
    norm_mlp_partials,
    norm_mlp_reference,
    sum_partials,
)
from mcore_infer.kernels.small_gemv import add_deferred
from tests.infer._kernels import KERNEL_DEVICES

needs_kernel = pytest.mark.skipif(not KERNEL_DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 + Triton")
GPUS = [d for d in KERNEL_DEVICES if d != "cpu"]  # (the interpreter's bfloat16 arithmetic is not the GPU's)


def _weights(h: int, ff: int, device: str, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(2 * ff, h, generator=g) / h**0.5
    w2 = torch.randn(h, ff, generator=g) / ff**0.5
    return w1.to(device, dtype), w2.to(device, dtype)


def _float64_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x.double(), w1.double()).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2.double())


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("rows,h,ff", [(1, 64, 96), (2, 80, 72), (3, 48, 200), (4, 128, 64)])
@pytest.mark.parametrize("launch", [None, "16,16,32,4", "32,64,16,2", "64,32,64,8"])
def test_kernel_equals_the_float64_mlp(device: str, rows: int, h: int, ff: int, launch: str | None) -> None:
    """Sizes that are not multiples of the blocks (masked features, inputs and outputs), one to four rows, at the
    heuristic and at other launches: the sum equals the float64 MLP."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    w1, w2 = _weights(h, ff, device, dtype, rows + h + ff)
    x = torch.randn(rows, h, generator=torch.Generator().manual_seed(ff)).to(device, dtype)
    y = fused_mlp_partials(x, w1, w2, None if launch is None else MlpLaunch.parse(launch))
    assert y.shape == (1, rows, h) and y.dtype == torch.float32
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y[0].double(), _float64_mlp(x, w1, w2), rtol=tol, atol=tol)


@pytest.mark.skipif(not GPUS, reason="needs CUDA and Triton")
@pytest.mark.parametrize("device", GPUS)
def test_rounds_as_the_unfused_ops_round(device: str) -> None:
    """In bfloat16 the kernel rounds the up projection's output, silu(gate) and the product to bfloat16 as the unfused
    ops do: it is within the down projection's float32 accumulation of the unfused MLP (far closer than a kernel that
    kept them in float32, which differs from it by bfloat16 roundings)."""
    w1, w2 = _weights(64, 96, device, torch.bfloat16, 5)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    y = fused_mlp_partials(x, w1, w2, MlpLaunch(32, 32, 32, 4))[0]
    gate, up = F.linear(x.float(), w1.float()).to(torch.bfloat16).float().chunk(2, dim=-1)
    act = (F.silu(gate).to(torch.bfloat16).float() * up).to(torch.bfloat16).float()
    torch.testing.assert_close(y, F.linear(act, w2.float()), rtol=1e-5, atol=1e-5)
    unrounded = F.linear(F.silu(gate) * up, w2.float())
    assert (y - unrounded).abs().max() > 1e-4  # the check above can tell the roundings apart


def _float64_norm_mlp(x: torch.Tensor, residual: torch.Tensor, g: torch.Tensor, w1: torch.Tensor,
                      w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    h = residual.double() + (x.double().sum(0) if x.dim() > residual.dim() else x.double())
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * g.double()
    return _float64_mlp(normed, w1, w2), h


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("rows,h,ff", [(1, 64, 96), (2, 80, 72), (4, 48, 40)])
@pytest.mark.parametrize("splits", [0, 1, 3], ids=["plain", "1-partial", "3-partials"])
@pytest.mark.parametrize("launch", [None, "16,16,32,4"])
def test_norm_in_the_kernel_equals_float64(device: str, rows: int, h: int, ff: int, splits: int,
                                           launch: str | None) -> None:  # fmt: skip
    """The residual add (of a tensor or of float32 partial sums) and RMSNorm inside the MLP kernel, at hidden sizes
    that are not powers of two: the MLP's sum and h equal float64."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    w1, w2 = _weights(h, ff, device, dtype, rows + h)
    gen = torch.Generator().manual_seed(splits + h)
    residual = torch.randn(rows, 1, h, generator=gen).to(device, dtype)
    x = (
        torch.randn(splits, rows, 1, h, generator=gen).to(device)
        if splits
        else torch.randn(rows, 1, h).to(device, dtype)
    )
    g = (1 + 0.2 * torch.randn(h, generator=gen)).to(device, dtype)
    out, h_sum = norm_mlp_partials(x, residual, g, 1e-5, w1, w2, None if launch is None else MlpLaunch.parse(launch))
    assert out.shape == (1, rows, 1, h) and out.dtype == torch.float32
    assert h_sum.shape == residual.shape and h_sum.dtype == dtype
    ref_out, ref_h = _float64_norm_mlp(x, residual, g, w1, w2)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(h_sum.double(), ref_h, rtol=tol, atol=tol)
    torch.testing.assert_close(out[0].double(), ref_out, rtol=tol, atol=tol)


def test_norm_mlp_pytorch_path_and_refusals() -> None:
    """Outside the kernel's devices the op is the unfused ops (the deferred add, ``F.rms_norm``, the MLP); shapes
    it cannot take are refused by name."""
    w1, w2 = _weights(32, 40, "cpu", torch.float64, 0)
    torch.manual_seed(0)
    residual, g = torch.randn(2, 1, 32, dtype=torch.float64), torch.rand(32, dtype=torch.float64) + 0.5
    parts = torch.randn(2, 2, 1, 32, dtype=torch.float64)
    out, h = norm_mlp_partials(parts, residual, g, 1e-5, w1, w2)
    ref_out, ref_h = norm_mlp_reference(parts, residual, g, 1e-5, w1, w2)
    torch.testing.assert_close(out[0], ref_out.float(), rtol=0, atol=0)
    torch.testing.assert_close(h, ref_h, rtol=0, atol=0)
    # (add_deferred sums partials in float32, as the kernels do: float32's rounding, not float64's)
    torch.testing.assert_close(ref_out, _float64_norm_mlp(parts, residual, g, w1, w2)[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="neither residual's shape"):
        norm_mlp_partials(torch.zeros(2, 1, 31, dtype=torch.float64), residual, g, 1e-5, w1, w2)
    with pytest.raises(ValueError, match=r"norm weight \(31,\) for rows of 32"):
        norm_mlp_partials(parts, residual, g[:31], 1e-5, w1, w2)


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_sum_partials_is_the_fixed_order_sum(device: str) -> None:
    """Many partials (more than a block) of a few rows add to torch's sum; the same inputs give the same bits."""
    parts = torch.randn(130, 3, 70, generator=torch.Generator().manual_seed(2)).to(device)
    out = sum_partials(parts)
    assert out.shape == (1, 3, 70) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), parts.double().sum(0, keepdim=True), rtol=1e-5, atol=1e-5)
    assert torch.equal(sum_partials(parts.clone()), out)


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_the_deferred_add_reads_the_sum(device: str) -> None:
    """The op's output is a one-split partial sum: ``add_deferred`` adds it to the residual (``[1, tokens, 1, h]``
    for a decode step's ``[tokens, 1, h]``), rounding once."""
    w1, w2 = _weights(64, 96, device, torch.float32, 3)
    x = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(4)).to(device)
    residual = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(5)).to(device)
    out = fused_mlp_partials(x, w1, w2)
    assert out.shape == (1, 2, 1, 64)
    torch.testing.assert_close(add_deferred(out, residual), residual + fused_mlp_reference(x, w1, w2))


def test_pytorch_path_without_the_kernel() -> None:
    """float64 inputs take the PyTorch ops (as the CPU does outside the interpreter): the reference, as float32."""
    w1, w2 = _weights(32, 40, "cpu", torch.float64, 0)
    x = torch.randn(3, 32, dtype=torch.float64)
    out = fused_mlp_partials(x, w1, w2)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out[0], fused_mlp_reference(x, w1, w2).float(), rtol=0, atol=0)
    torch.testing.assert_close(fused_mlp_reference(x, w1, w2), _float64_mlp(x, w1, w2))


def test_compiled_graph_keeps_the_op() -> None:
    """The custom op and its fake: ``torch.compile`` (fullgraph) traces it with its output shape."""
    w1, w2 = _weights(32, 40, "cpu", torch.float32, 0)
    x = torch.randn(1, 1, 32)
    fn = torch.compile(lambda a: fused_mlp_partials(a, w1, w2)[0] + a, fullgraph=True, backend="eager")
    torch.testing.assert_close(fn(x), fused_mlp_reference(x, w1, w2) + x, rtol=1e-5, atol=1e-5)


def test_refuses_what_it_cannot_compute() -> None:
    w1, w2 = _weights(32, 40, "cpu", torch.float32, 0)
    with pytest.raises(ValueError, match="at most 4 rows, got 5"):
        fused_mlp_partials(torch.zeros(5, 32), w1, w2)
    with pytest.raises(ValueError, match=r"fc1 \[2F, H\] = \[gate; up\]"):
        fused_mlp_partials(torch.zeros(1, 32), w1[:40], w2)
    with pytest.raises(
        ValueError, match=r"fused MLP launch '64,128,64' \(expected BLOCK_F,BLOCK_K,BLOCK_H,WARPS.*: 3 values"
    ):
        MlpLaunch.parse("64,128,64")
    with pytest.raises(ValueError, match="BLOCK_F .* must be powers of two"):
        MlpLaunch(48, 128, 64, 8).checked()
    with pytest.raises(ValueError, match="WARPS must be one of"):
        MlpLaunch.parse("64,128,64,3")
    assert str(MlpLaunch.parse("64,128,64,8")) == "64,128,64,8"
    assert [heuristic_mlp_launch(r).block_k for r in (1, 2, 3, 4)] == [128, 64, 32, 32]
