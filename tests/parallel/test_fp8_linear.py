"""The FP8 linears (mcore_parallel.fp8) in one process: forward and both gradients against float64 within the FP8
error bound, the same GEMMs emulated exactly, the operands torch._scaled_mm receives (formats, layout, alignment),
the weight-cast cache, the bf16 fallback and the main_grad fusion.

The error bound of ``a @ bᵀ`` with quantised operands: each element is rounded to nearest with relative error at most
the format's unit roundoff ``u`` in the normal range and absolute error at most ``spacing / 2`` (divided by the
tensor's scale) below it, so ``|â - a| <= u|a| + δa`` elementwise. Then, term by term,
``|âb̂ - ab| <= (ua + ub + ua ub)|a||b| + (1 + ua)|a| δb + (1 + ub)|b| δa + δa δb``, summed over the contraction;
the fp32 accumulation and the output rounding add at most ``(K + 4) 2^-24 Σ|â||b̂|``.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from mcore_parallel import Group
from mcore_parallel.fp8 import (
    E4M3,
    Fp8ColumnParallelLinear,
    Fp8Format,
    Fp8Recipe,
    Fp8RowParallelLinear,
    fp8_step,
)
from mcore_parallel.fp8.recipe import E5M2
from mcore_parallel.tensor import ColumnParallelLinear

S, B, IN, OUT = 8, 3, 48, 32  # 24 tokens: the weight gradient's contraction is padded to 32
RECIPES = {
    "e4m3": Fp8Recipe("e4m3"),
    "hybrid": Fp8Recipe("hybrid"),
    "hybrid-delayed": Fp8Recipe("hybrid", "delayed", amax_history_len=4),
    "e4m3-rowwise": Fp8Recipe("e4m3", "rowwise"),
    "hybrid-bf16-wgrad": Fp8Recipe("hybrid", wgrad=False),
}
CLASSES = {"column": Fp8ColumnParallelLinear, "row": Fp8RowParallelLinear}


def _layer(kind: str, recipe: Fp8Recipe, bias: bool = False, in_f: int = IN) -> Any:
    return CLASSES[kind](in_f, OUT, tp=Group.single(), bias=bias, recipe=recipe, seed=3)


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, IN, generator=g) * torch.logspace(-1, 1, IN)  # features of different magnitudes
    return x, torch.randn(S, B, OUT, generator=g)


# ----------------------------------------------------------------------------------------- reference math
def _scale(t: torch.Tensor, fmt: Fp8Format, rowwise: bool) -> torch.Tensor:
    """fmax / amax in float32 (per row when rowwise), as a recipe scales a tensor by its own maximum."""
    a = t.abs().amax(-1, keepdim=True) if rowwise else t.abs().amax()
    return torch.where(a > 0, torch.tensor(fmt.max) / a.float(), torch.ones_like(a.float()))


def _quantized(t: torch.Tensor, fmt: Fp8Format, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the dequantised FP8 tensor, its elementwise absolute-error term δ) in float64."""
    s = _scale(t, fmt, rowwise)
    q = (t.float() * s).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    deq = q.double() * s.reciprocal().double()
    return deq, (fmt.subnormal_spacing / 2 / s.double()).expand(t.shape)


def _bound(a: torch.Tensor, b: torch.Tensor, ua: float, ub: float, da: torch.Tensor, db: torch.Tensor) -> Any:
    """The error bound of the module docstring for ``a @ bᵀ`` (float64 inputs)."""
    a, b = a.abs(), b.abs()
    k = a.shape[-1]
    fp8 = (ua + ub + ua * ub) * (a @ b.t()) + (1 + ua) * (a @ db.t()) + (1 + ub) * (da @ b.t()) + da @ db.t()
    accumulate = (k + 4) * 2.0**-24 * (((1 + ua) * a + da) @ ((1 + ub) * b + db).t())
    return fp8 + accumulate


def _check(actual: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (actual.double() - exact).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{what}: error {err.max().item():.3e} exceeds the FP8 bound ({worst:.2f} of it)"
    assert err.max() > 0, f"{what}: no rounding error at all: not an FP8 GEMM"


def _operands(recipe: Fp8Recipe, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> dict[str, Any]:
    """Reference (float64) and quantised operands of the three GEMMs for 2-D x [T, in], w [out, in], g [T, out]."""
    rowwise, gfmt = recipe.rowwise, E5M2 if recipe.format == "hybrid" else E4M3
    xq, dx_ = _quantized(x, E4M3, rowwise)
    wq, dw_ = _quantized(w, E4M3, rowwise)
    wtq, dwt = _quantized(w.t().contiguous(), E4M3, rowwise)  # rowwise: per input feature
    gq, dg = _quantized(g, gfmt, rowwise)
    return dict(xq=xq, dx=dx_, wq=wq, dw=dw_, wtq=wtq, dwt=dwt, gq=gq, dg=dg)


def _run(layer: Any, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    with fp8_step([layer]):
        y = layer(x)
        y.backward(g)
    return y.detach(), x.grad, layer.weight.grad  # type: ignore[return-value]


@pytest.mark.parametrize("kind", list(CLASSES))
@pytest.mark.parametrize("name", list(RECIPES))
def test_forward_and_gradients_within_the_fp8_bound(kind: str, name: str) -> None:
    recipe = RECIPES[name]
    layer = _layer(kind, recipe)
    x, g = _inputs()
    y, gx, gw = _run(layer, x, g)
    x2, g2, w = x.reshape(-1, IN).double(), g.reshape(-1, OUT).double(), layer.weight.detach().double()
    o = _operands(recipe, x2.float(), w.float(), g2.float())
    u4, ug = E4M3.unit_roundoff, (E5M2 if recipe.format == "hybrid" else E4M3).unit_roundoff
    _check(y.reshape(-1, OUT), x2 @ w.t(), _bound(x2, w, u4, u4, o["dx"], o["dw"]), "forward")
    _check(gx.reshape(-1, IN), g2 @ w, _bound(g2, w.t(), ug, u4, o["dg"], o["dwt"]), "input gradient")
    if recipe.fp8_wgrad:
        wbound = _bound(g2.t(), x2.t(), ug, u4, o["dg"].t(), o["dx"].t())
    else:  # bf16 (here float32) GEMM of the exact gradient and the FP8 input
        wbound = _bound(g2.t(), x2.t(), 0.0, u4, torch.zeros_like(g2.t()), o["dx"].t())
    _check(gw, g2.t() @ x2, wbound, "weight gradient")


@pytest.mark.parametrize("kind", list(CLASSES))
@pytest.mark.parametrize("name", list(RECIPES))
def test_gemms_equal_their_emulation(kind: str, name: str) -> None:
    """Every product is the float64 product of the operands quantised by the recipe (formats, scales, the E5M2
    gradient of hybrid, the weight's transpose) up to fp32 accumulation: a wrong format or scale anywhere fails."""
    recipe = RECIPES[name]
    layer = _layer(kind, recipe, bias=True)
    with torch.no_grad():
        layer.bias.normal_()
    x, g = _inputs(1)
    y, gx, gw = _run(layer, x, g)
    x2, g2, w = x.reshape(-1, IN), g.reshape(-1, OUT), layer.weight.detach()
    o = _operands(recipe, x2, w, g2)

    def close(actual: torch.Tensor, a: torch.Tensor, b: torch.Tensor, what: str, extra: Any = 0.0) -> None:
        exact = a @ b.t() + extra
        tol = (a.shape[-1] + 8) * 2.0**-24 * (a.abs() @ b.abs().t() + abs(extra))
        err = (actual.double() - exact).abs()
        assert (err <= tol).all(), f"{what}: {err.max().item():.3e} off the emulated FP8 GEMM"

    close(y.reshape(-1, OUT), o["xq"], o["wq"], "forward", layer.bias.detach().double())
    close(gx.reshape(-1, IN), o["gq"], o["wtq"], "input gradient")
    if recipe.fp8_wgrad:
        close(gw, o["gq"].t(), o["xq"].t(), "weight gradient")
    else:
        close(gw, g2.double().t(), o["xq"].t(), "weight gradient")
    assert torch.allclose(layer.bias.grad.double(), g2.double().sum(0), rtol=1e-6, atol=1e-6)


def test_scaled_mm_operands(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the GPU kernels need, checked on the CPU (whose kernel accepts more): the second operand column-major,
    K and N multiples of 16, E4M3 forward, E5M2 x E4M3 gradients (hybrid), fast accumulation in the forward only."""
    calls: list[dict[str, Any]] = []
    real = torch._scaled_mm

    def spy(a: torch.Tensor, b: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        calls.append(dict(a=a.dtype, b=b.dtype, k=a.shape[1], n=b.shape[1], col_major=b.stride(0) == 1,
                          row_major=a.stride(1) == 1, fast=kw.get("use_fast_accum")))  # fmt: skip
        return real(a, b, *args, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    _run(_layer("column", Fp8Recipe("hybrid")), *_inputs())
    assert len(calls) == 3  # forward, input gradient, weight gradient
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    assert [(c["a"], c["b"]) for c in calls] == [(e4, e4), (e5, e4), (e5, e4)]
    assert [c["fast"] for c in calls] == [True, False, False]
    for c in calls:
        assert c["col_major"] and c["row_major"], c
        assert c["k"] % 16 == 0 and c["n"] % 16 == 0, c
    assert calls[2]["k"] == 32  # 24 tokens, padded


def test_the_weight_cast_is_cached_for_a_step_and_renewed_after_an_update() -> None:
    layer = _layer("column", Fp8Recipe("hybrid"))
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    x, g = _inputs()
    layer(x)
    layer(x)
    assert layer.weight_casts == 2  # outside a step every call casts afresh
    with fp8_step([layer]):
        for _ in range(3):  # three micro-batches, forward and backward
            layer(x).backward(g)
    assert layer.weight_casts == 3  # one cast for the whole step
    opt.step()  # the weights change
    fresh = _layer("column", Fp8Recipe("hybrid"))
    with torch.no_grad():
        fresh.weight.copy_(layer.weight)
    expected = fresh(x)
    assert torch.equal(layer(x), expected)  # outside a step: the updated weights, not the step's cast
    with fp8_step([layer]):
        y = layer(x)
    assert layer.weight_casts == 5
    assert torch.equal(y, expected)  # the next step casts the updated weights


def test_no_grad_forward_casts_only_what_it_needs() -> None:
    layer = _layer("row", Fp8Recipe("hybrid"))
    x, _ = _inputs()
    with torch.no_grad():
        y = layer(x)
    assert y.shape == (S, B, OUT) and not y.requires_grad
    assert layer.weight_cast(False).transposed is None  # the input gradient's operand is not made for inference


def test_dimensions_not_multiple_of_16_fall_back_to_bf16(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mcore_parallel.fp8.layers"):
        layer = Fp8ColumnParallelLinear(40, 24, tp=Group.single(), bias=False, recipe=Fp8Recipe(), seed=3)
    assert layer.fp8_reason is not None and "in=40" in layer.fp8_reason and "out=24" in layer.fp8_reason
    assert any("runs in bf16" in r.getMessage() for r in caplog.records)
    plain = ColumnParallelLinear(40, 24, tp=Group.single(), bias=False, seed=3)
    x = torch.randn(4, 2, 40)
    assert torch.equal(layer(x), plain(x))  # exactly the bf16 layer, no silent FP8 with a wrong layout
    with fp8_step([layer]) as layers:
        assert layers == []


@pytest.mark.parametrize("wgrad", [True, False], ids=["fp8-wgrad", "bf16-wgrad"])
def test_weight_gradient_into_main_grad(wgrad: bool) -> None:
    """DDP's gradient_accumulation_fusion: the weight gradient is added into main_grad (twice: two micro-batches),
    the same values as the unfused gradient."""
    recipe = Fp8Recipe("hybrid", wgrad=wgrad)
    plain, fused = _layer("row", recipe), _layer("row", recipe)
    x, g = _inputs()
    _, _, expected = _run(plain, x, g)
    fused.weight.main_grad = torch.zeros_like(fused.weight)  # type: ignore[attr-defined]
    fused.weight.fuse_wgrad_accumulation = True  # type: ignore[attr-defined]
    for _ in range(2):
        _run(fused, x, g)
    assert fused.weight.grad_added_to_main_grad  # type: ignore[attr-defined]
    torch.testing.assert_close(fused.weight.main_grad, 2 * expected, rtol=1e-6, atol=1e-6)  # type: ignore[attr-defined]


def test_e5m2_formats_refused_in_pairs() -> None:
    from mcore_parallel.fp8 import Fp8Tensor, scaled_mm

    a = Fp8Tensor(torch.zeros(16, 16, dtype=E5M2.dtype), torch.tensor(1.0), E5M2)
    with pytest.raises(ValueError, match="two E5M2"):
        scaled_mm(a, a, torch.float32)
    b = Fp8Tensor(torch.zeros(24, 16, dtype=E4M3.dtype), torch.tensor(1.0), E4M3)
    with pytest.raises(ValueError, match="multiples of 16"):
        scaled_mm(a, b, torch.float32)
