"""``small_gemv``: the split-K weight-streaming GEMV and ``swiglu_down`` (SwiGLU inside the down projection)
against float64. The kernel runs on GPUs, or on the CPU under ``TRITON_INTERPRET=1`` (float32); elsewhere the op
computes with PyTorch ops."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from mcore_infer.kernels import small_gemv as sg
from mcore_infer.kernels.small_gemv import (
    Launch,
    add_deferred,
    gemv_partials,
    linear_partials,
    swiglu_down,
    swiglu_down_partials,
)
from tests.infer._kernels import INTERPRETED, KERNEL_DEVICES

needs_kernel = pytest.mark.skipif(not KERNEL_DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 + Triton")


def _swiglu_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w.double())


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("rows,n,k", [(1, 96, 320), (3, 130, 600), (16, 48, 256), (40, 33, 100)])
@pytest.mark.parametrize("splits", [1, 2, 3, 4])
@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
@pytest.mark.parametrize("block_n", [8, 32])
def test_partials_sum_to_the_float64_product(device: str, rows: int, n: int, k: int, splits: int, swiglu: bool,
                                             block_n: int) -> None:  # fmt: skip
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(rows + n + k)
    x = torch.randn(rows, (2 if swiglu else 1) * k, device=device, dtype=dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    parts = gemv_partials(x, w, splits, block_n=block_n, block_k=64, swiglu=swiglu)
    assert parts.shape == (splits, rows, n) and parts.dtype == torch.float32
    ref = _swiglu_ref(x, w) if swiglu else F.linear(x.double(), w.double())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(parts.double().sum(0), ref, rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("launch", ["1,32", "4,32", "2,64"])
def test_swiglu_down_op_at_each_launch(device: str, launch: str) -> None:
    """The op at one split (output written in the input dtype) and at several (float32 partials summed)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(2, 1, 2 * 700, device=device, dtype=dtype)
    w = (torch.randn(90, 700, device=device) / 700**0.5).to(dtype)
    y = swiglu_down(x, w, Launch.parse(launch))
    assert y.shape == (2, 1, 90) and y.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.double(), _swiglu_ref(x, w), rtol=tol, atol=tol)


def test_pytorch_fallback_equals_the_unfused_ops() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs the kernel here")
    x = torch.randn(3, 1, 64)
    w = torch.randn(24, 32)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(swiglu_down(x, w), F.linear(F.silu(gate) * up, w), rtol=0, atol=0)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="at most 16 rows, got 17"):
        swiglu_down(torch.zeros(17, 8), torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"expected \[gate \| up\] = 2 x 4"):
        swiglu_down(torch.zeros(1, 6), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="expected 2 x 4 for a weight of 4 inputs"):
        gemv_partials(torch.zeros(1, 6), torch.zeros(3, 4), 1, swiglu=True)


def test_default_launch_is_the_swept_one() -> None:
    assert sg.heuristic_launch(8192) == Launch(2, 8, 1024, 4)  # llama-1b's fc2
    assert sg.heuristic_launch(2048) == Launch(1, 8, 1024, 4)  # its output projection: K too short
    assert sg.heuristic_launch(2048, row=True) == Launch(1, 8, 1024, 4)  # QKV
    assert sg.heuristic_launch(8192, row=True).splits == 1  # a summed output


def test_launch_values() -> None:
    assert Launch.parse("8,64") == Launch(8, 64, 256, 4)
    assert Launch.parse(" 16, 8, 512, 8 ") == Launch(16, 8, 512, 8)
    assert Launch.parse(str(Launch(2, 16, 128, 2))) == Launch(2, 16, 128, 2)
    for bad, why in [
        ("4", "1 values"),
        ("4,32,1", "3 values"),
        ("a,32", "not a list"),
        ("0,32", "SPLITS"),
        ("4,24", "BLOCK_N"),
        ("4,4", "BLOCK_N"),
        ("4,16,100,4", "BLOCK_K"),
        ("4,16,256,3", "WARPS"),
    ]:
        with pytest.raises(ValueError, match=rf"launch '{bad}' \(expected SPLITS,BLOCK_N\[,BLOCK_K,WARPS\].*{why}"):
            Launch.parse(bad)
    x, w = torch.zeros(1, 1, 16), torch.zeros(3, 8)
    for op, arg in (
        (swiglu_down, x),
        (swiglu_down_partials, x),
        (linear_partials, x[..., :8]),
        (sg.row_linear, x[..., :8]),
    ):
        with pytest.raises(ValueError, match="BLOCK_N"):  # a launch value is checked before the op runs
            op(arg, w, Launch(4, 24))


def test_partial_sums_follow_the_launch_when_compiled() -> None:
    """The ops' fake implementations (what a compiled graph plans with; inductor checks the real output against
    them) give as many partial sums as the kernel writes for the launch they are passed: one on the PyTorch path,
    the launch's splits where the kernel runs. (No compiled-graph cache: its key does not see TRITON_INTERPRET.)"""
    x, w = torch.randn(2, 1, 64), torch.randn(24, 64)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return linear_partials(x, w, Launch(3, 8, 16)), swiglu_down_partials(x, w[:, :32], Launch(2, 8, 16))

    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        parts, swiglu_parts = torch.compile(fn, fullgraph=True)(x)
    assert parts.shape == ((3 if INTERPRETED else 1), 2, 1, 24)
    assert swiglu_parts.shape == ((2 if INTERPRETED else 1), 2, 1, 24)
    torch.testing.assert_close(parts.sum(0), F.linear(x, w), rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("launch", ["1,16", "4,8,64,4", "3,32,128,2"])
def test_linear_partials_sum_to_the_float64_product(device: str, rows: int, launch: str) -> None:
    """The output projection's partial sums (``proj_partials``) at several launches, added by add_deferred."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(rows)
    x = torch.randn(rows, 1, 700, device=device, dtype=dtype)
    w = (torch.randn(90, 700, device=device) / 700**0.5).to(dtype)
    parts = linear_partials(x, w, Launch.parse(launch))
    assert parts.shape == (int(launch.split(",")[0]), rows, 1, 90) and parts.dtype == torch.float32
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(parts.double().sum(0), F.linear(x.double(), w.double()), rtol=tol, atol=tol)
    residual = torch.randn(rows, 1, 90, device=device, dtype=dtype)
    torch.testing.assert_close(add_deferred(parts, residual).double(), residual.double() + parts.double().sum(0),
                               rtol=tol, atol=tol)  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("launch", ["", "1,8,64,4", "2,16,128,4"])
def test_row_linear_equals_the_float64_product(device: str, launch: str) -> None:
    """The QKV projection with the one-row kernel (``row_gemv``): the output in the input dtype, summed (two splits
    are added by the op itself)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    for rows in (1, 3, 4):
        x = torch.randn(rows, 1, 600, device=device, dtype=dtype)
        w = (torch.randn(130, 600, device=device) / 600**0.5).to(dtype)
        y = sg.row_linear(x, w, Launch.parse(launch) if launch else None)
        assert y.shape == (rows, 1, 130) and y.dtype == dtype
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(y.double(), F.linear(x.double(), w.double()), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="row_linear takes at most 4 rows, got 5"):
        sg.row_linear(torch.randn(5, 600, device=device, dtype=dtype), w)


def test_linear_partials_refuses_more_rows_than_the_row_kernel() -> None:
    with pytest.raises(ValueError, match="at most 4 rows, got 5"):
        linear_partials(torch.randn(5, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="x has 8 columns, the weight 6 inputs"):
        linear_partials(torch.randn(1, 8), torch.randn(4, 6))


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_partials_op_for_a_deferred_add(device: str) -> None:
    """swiglu_down_partials returns the split-K partial sums (float32); add_deferred adds them to the residual in
    float32 and rounds once: the unfused ``residual + swiglu_down(x)`` up to that rounding."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(3, 1, 2 * 1100, device=device, dtype=dtype)
    w = (torch.randn(70, 1100, device=device) / 1100**0.5).to(dtype)
    parts = swiglu_down_partials(x, w, Launch(4, 32))
    assert parts.shape == (4, 3, 1, 70) and parts.dtype == torch.float32
    residual = torch.randn(3, 1, 70, device=device, dtype=dtype)
    got = add_deferred(parts, residual)
    assert got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), residual.double() + _swiglu_ref(x, w), rtol=tol, atol=tol)


def test_add_deferred_takes_plain_outputs_and_partial_sums() -> None:
    torch.manual_seed(0)
    residual = torch.randn(2, 1, 8).to(torch.bfloat16)
    out = torch.randn(2, 1, 8).to(torch.bfloat16)
    torch.testing.assert_close(add_deferred(out, residual), out + residual, rtol=0, atol=0)
    parts = torch.randn(3, 2, 1, 8)
    exact = residual.double() + parts.double().sum(0)
    got = add_deferred(parts, residual)
    assert got.dtype == torch.bfloat16
    # one rounding at the end: within half a bf16 unit of the float64 sum (two roundings could be a whole unit off)
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-30).all()
