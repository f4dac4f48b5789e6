"""The FP8 linears on a Hopper GPU (cuBLASLt's FP8 GEMMs through torch._scaled_mm): forward and both gradients
against float64 within the FP8 error bound of ``test_fp8_linear.py`` (plus bf16's output rounding for a bf16
layer), at llama-like widths and a token count that is not a multiple of 16; and the FP8 linear's result equal to
the same GEMMs emulated on the CPU up to the accumulation's rounding."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_parallel import Group
from mcore_parallel.fp8 import E4M3, Fp8ColumnParallelLinear, Fp8Recipe, Fp8RowParallelLinear, fp8_step
from mcore_parallel.fp8.recipe import E5M2

from .test_fp8_linear import RECIPES, _bound, _operands

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an FP8 GPU"
    ),
]
T, IN, OUT = 1000, 256, 384
CLASSES = {"column": Fp8ColumnParallelLinear, "row": Fp8RowParallelLinear}


def _run(kind: str, recipe: Fp8Recipe, dtype: torch.dtype) -> tuple[Any, ...]:
    layer = CLASSES[kind](IN, OUT, tp=Group.single(), bias=False, recipe=recipe, seed=3, device="cuda", dtype=dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, 1, IN, device="cuda", generator=g) * torch.logspace(-1, 1, IN, device="cuda")
    dy = torch.randn(T, 1, OUT, device="cuda", generator=g)
    x, dy = x.to(dtype).requires_grad_(), dy.to(dtype)
    with fp8_step([layer]):
        y = layer(x)
        y.backward(dy)
    return layer, x.detach(), dy, y.detach(), x.grad, layer.weight.grad


def _check(actual: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, out_u: float, what: str) -> None:
    err = (actual.double() - exact).abs()
    total = bound + out_u * exact.abs()
    worst = (err / total).max().item()
    assert worst <= 1.0, f"{what}: error {err.max().item():.3e} exceeds the FP8 bound ({worst:.2f} of it)"
    assert err.max() > 0, f"{what}: no rounding error at all: not an FP8 GEMM"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(CLASSES))
@pytest.mark.parametrize("name", list(RECIPES))
def test_cuda_fp8_linear_within_the_fp8_bound(name: str, kind: str, dtype: torch.dtype) -> None:
    recipe = RECIPES[name]
    if recipe.rowwise and dtype == torch.float32:  # cuBLASLt's rowwise-scaled GEMMs write bf16 or fp16 only
        with pytest.raises(ValueError, match="write bf16 or fp16"):
            _run(kind, recipe, dtype)
        return
    layer, x, dy, y, gx, gw = _run(kind, recipe, dtype)
    x2, g2 = x.reshape(-1, IN).double().cpu(), dy.reshape(-1, OUT).double().cpu()
    w = layer.weight.detach().double().cpu()
    o = _operands(recipe, x2.float(), w.float(), g2.float())
    u4, ug = E4M3.unit_roundoff, (E5M2 if recipe.format == "hybrid" else E4M3).unit_roundoff
    out_u = 2.0**-8 if dtype == torch.bfloat16 else 0.0  # the GEMM's output rounded to bf16
    _check(y.reshape(-1, OUT).cpu(), x2 @ w.t(), _bound(x2, w, u4, u4, o["dx"], o["dw"]), out_u, "forward")
    _check(gx.reshape(-1, IN).cpu(), g2 @ w, _bound(g2, w.t(), ug, u4, o["dg"], o["dwt"]), out_u, "input gradient")
    if recipe.fp8_wgrad:
        wbound = _bound(g2.t(), x2.t(), ug, u4, o["dg"].t(), o["dx"].t())
    else:
        wbound = _bound(g2.t(), x2.t(), 0.0, u4, torch.zeros_like(g2.t()), o["dx"].t())
        if dtype == torch.bfloat16:  # the bf16 GEMM's own operand rounding of the gradient
            wbound = wbound + 2.0**-8 * (g2.t().abs() @ x2.abs())
    _check(gw.cpu(), g2.t() @ x2, wbound, out_u, "weight gradient")


@pytest.mark.parametrize("name", ["hybrid", "e4m3"])
def test_cuda_gemm_equals_its_cpu_emulation(name: str) -> None:
    """The forward on the GPU against the float64 product of the operands quantised as the recipe says: the GPU's
    GEMM differs from it only by its accumulation (fast accumulation in the forward: a few fp32 roundings more)."""
    recipe = RECIPES[name]
    layer, x, _, y, _, _ = _run("column", recipe, torch.float32)
    x2, w = x.reshape(-1, IN).cpu(), layer.weight.detach().cpu()
    o = _operands(recipe, x2, w, torch.ones(T, OUT))
    exact = o["xq"] @ o["wq"].t()
    tol = IN * 2.0**-20 * (o["xq"].abs() @ o["wq"].abs().t())
    err = (y.reshape(-1, OUT).cpu().double() - exact).abs()
    assert (err <= tol).all(), f"{err.max().item():.3e} off the emulated FP8 GEMM"
