"""``gated_norm_partials``: a Mamba layer's gated RMSNorm inside its out-projection's one-row GEMV, against float64.
The kernel runs on GPUs, or on the CPU under ``TRITON_INTERPRET=1`` (float32); elsewhere the op computes with PyTorch
ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_infer.kernels import GemvLaunch
from mcore_infer.kernels.gated_norm_gemv import gated_block_k, gated_norm_partials, takes_group
from mcore_models.ssm.mixer import GatedRMSNorm, gated_rms_norm
from mcore_models.transformer.context import ModelContext
from mcore_parallel import Group
from tests.infer._kernels import KERNEL_DEVICES

needs_kernel = pytest.mark.skipif(not KERNEL_DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 + Triton")


def _float64(
    y: torch.Tensor, z: torch.Tensor, g: torch.Tensor, w: torch.Tensor, group: int, before: bool
) -> torch.Tensor:
    """The norm and the projection in float64, written out (not the reference function the op falls back to)."""
    y, z = y.double(), z.double()
    gate = z * torch.sigmoid(z)
    h = y if before else y * gate
    grouped = h.unflatten(-1, (-1, group))
    normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + 1e-5)).flatten(-2) * g.double()
    return F.linear(normed * gate if before else normed, w.double())


def _inputs(rows: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int) -> tuple[torch.Tensor, ...]:
    """``y`` ``[rows, 1, k]``, ``z`` a strided view of a wider ``[rows, 1, 3k]`` tensor (as the in-projection's
    output holds it), the norm weight and the projection's weight."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(rows, 1, k, generator=gen).to(device, dtype)
    z = (2 * torch.randn(rows, 1, 3 * k, generator=gen)).to(device, dtype)[..., k : 2 * k]
    g = (1 + 0.2 * torch.randn(k, generator=gen)).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    return y, z, g, w


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("rows,n,k,group", [(1, 40, 128, 128), (2, 24, 128, 32), (4, 72, 192, 64), (3, 8, 96, 48)])
@pytest.mark.parametrize("before", [False, True], ids=["gate-then-norm", "norm-then-gate"])
@pytest.mark.parametrize("launch", [None, "1,8,16,2", "2,16,64,4", "3,32,1024,4"])
def test_kernel_equals_float64(
    device: str, rows: int, n: int, k: int, group: int, before: bool, launch: str | None
) -> None:
    """One to four groups (sizes 32 to 128, 48 = 16 x 3 stepped by 16), one to three K splits (the last one short or
    empty), a step wider than a group: the partial sums add up to float64's product."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    y, z, g, w = _inputs(rows, n, k, dtype, device, rows + n + k + group)
    parsed = None if launch is None else GemvLaunch.parse(launch)
    parts = gated_norm_partials(y, z, g, 1e-5, group, before, w, parsed, pdl=True)
    splits = 1 if parsed is None else parsed.splits
    assert parts.shape == (splits, rows, 1, n) and parts.dtype == torch.float32
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(parts.double().sum(0), _float64(y, z, g, w, group, before), rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_kernel_equals_the_mixers_norm_and_projection(device: str) -> None:
    """In the model's dtype the kernel's sum equals GatedRMSNorm (the module) followed by F.linear, up to the
    products' order."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    y, z, _, w = _inputs(2, 64, 256, dtype, device, 3)
    norm = GatedRMSNorm(ModelContext(Group.single("tp"), device=device), 256, 64, 1e-5, False, "norm", dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        expected = F.linear(norm(y, z, kernel=False), w).float()
    got = gated_norm_partials(y, z, norm.weight, 1e-5, 64, False, w).sum(0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


def test_pytorch_path_and_refusals() -> None:
    """Outside the kernel's devices the op is the unfused ops; what the kernel cannot take is refused by name."""
    y, z, g, w = _inputs(2, 24, 64, torch.float64, "cpu", 0)
    parts = gated_norm_partials(y, z, g, 1e-5, 32, False, w)
    assert parts.shape == (1, 2, 1, 24)
    torch.testing.assert_close(parts[0], F.linear(gated_rms_norm(y, z, g, 32, 1e-5, False), w).float())
    torch.testing.assert_close(parts[0].double(), _float64(y, z, g, w, 32, False), rtol=1e-6, atol=1e-6)
    five = torch.randn(5, 1, 64, dtype=torch.float64)
    with pytest.raises(ValueError, match="at most 4 rows, got 5"):
        gated_norm_partials(five, five, g, 1e-5, 32, False, w)
    with pytest.raises(ValueError, match="group size 24 must divide 64"):
        gated_norm_partials(y, z, g, 1e-5, 24, False, w)
    y48 = torch.randn(1, 48, dtype=torch.float64)
    with pytest.raises(ValueError, match="group size 24 .* power-of-two factor of at least 16"):
        gated_norm_partials(y48, y48, torch.ones(48, dtype=torch.float64), 1e-5, 24, False, torch.ones(8, 48))
    with pytest.raises(ValueError, match="do not match"):
        gated_norm_partials(y, z[..., :32], g, 1e-5, 32, False, w)
    assert [gated_block_k(1024, s) for s in (4096, 1024, 48, 96, 3072)] == [1024, 1024, 16, 32, 1024]
    assert [takes_group(s) for s in (16, 48, 3072, 24, 8, 0)] == [True, True, True, False, False, False]
