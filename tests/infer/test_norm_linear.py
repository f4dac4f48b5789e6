"""``norm_linear``: residual add, RMSNorm, a small-row linear layer and (optionally) SwiGLU in one kernel, against a
float64 reference. The kernel runs on GPUs, or on the CPU under ``TRITON_INTERPRET=1`` (float32); elsewhere the op
falls back to PyTorch ops, checked here too."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mcore_infer.kernels import norm_linear as nl
from mcore_infer.kernels.norm_linear import MAX_ROWS, NORM_MODES, Launch, norm_linear
from tests.infer._kernels import KERNEL_DEVICES


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


# (rows, n, k, residual, swiglu, warps): N never a multiple of BLOCK_N (16), K never one of BLOCK_K (32); the warps
# set the short norm loop's step (1024 * warps / (1 or 16 rows)), which takes several steps in the last two cases
MODE_CASES = [
    (1, 40, 80, True, False, 4),
    (3, 20, 48, False, True, 4),
    (16, 24, 112, True, True, 1),
    (1, 33, 1100, False, False, 1),
]


@pytest.mark.skipif(not KERNEL_DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 with Triton")
@pytest.mark.parametrize("device", KERNEL_DEVICES or ["cpu"])
@pytest.mark.parametrize("mode", NORM_MODES)
@pytest.mark.parametrize(("rows", "n", "k", "res", "swiglu", "warps"), MODE_CASES)
def test_every_norm_mode_matches_the_reference(
    device: str, mode: int, rows: int, n: int, k: int, res: bool, swiglu: bool, warps: int
) -> None:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x, r, g, w = _case(device, dtype, rows, n, k, res, swiglu)
    y, h = norm_linear(x, r, g, 1e-5, w, swiglu, launch=Launch(mode, 16, warps, 2, 32))
    y_ref, h_ref = nl.norm_linear_reference(x.double(), None if r is None else r.double(), g.double(), 1e-5,
                                            w.double(), swiglu)  # fmt: skip
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert y.shape == (rows, 1, n) and h.shape == x.shape
    torch.testing.assert_close(y.double(), y_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(h.double(), h_ref, atol=tol, rtol=0)


class _Recorder:
    """Stands in for the Triton kernel: records each launch's grid and keyword arguments."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple[int, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: tuple[int, ...]):  # type: ignore[no-untyped-def]
        return lambda *args, **kwargs: self.launches.append((grid, kwargs))


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    """The op's kernel path on the CPU (with or without Triton), launching a :class:`_Recorder`."""
    rec = _Recorder()
    monkeypatch.setattr(nl, "_use_triton", lambda x: True)
    monkeypatch.setattr(nl, "_kernel", lambda: rec)
    return rec


def _launch_of(
    recorder: _Recorder, n: int = 3072, k: int = 2048, swiglu: bool = False, launch: Launch | None = None
) -> Launch:
    w = torch.zeros((2 if swiglu else 1) * n, k)
    norm_linear(torch.zeros(1, k), None, torch.ones(k), 1e-5, w, swiglu, launch=launch)
    grid, kw = recorder.launches[-1]
    got = Launch(*(int(kw[key]) for key in ("NORM_MODE", "BLOCK_N", "num_warps", "num_stages", "BLOCK_K")))
    assert grid == (-(-n // got.block_n),)
    return got


def test_launch_argument_applies(recorder: _Recorder) -> None:
    default = _launch_of(recorder)
    assert default == nl.heuristic_launch(3072, 2048, False, 132)
    assert _launch_of(recorder, launch=Launch(2, 64, 8, 4)) == Launch(2, 64, 8, 4, 256)  # BLOCK_K left out: 256
    assert _launch_of(recorder, n=8192, swiglu=True, launch=Launch(2, 64, 8, 4)) == Launch(2, 64, 8, 4, 256)
    assert _launch_of(recorder, launch=Launch.parse(" 3, 32,2,3,128 ")) == Launch(3, 32, 2, 3, 128)
    assert _launch_of(recorder, k=48, launch=Launch(3, 32, 2, 3, 128)) == Launch(3, 32, 2, 3, 64)  # BLOCK_K clamped
    assert _launch_of(recorder) == default  # nothing is remembered between calls


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("1,32,4", "3 values"),
        ("1,32,4,3,256,1", "6 values"),
        ("1;32;4;3", "not a list of integers"),
        ("one,32,4,3", "not a list of integers"),
        ("4,32,4,3", "MODE must be one of"),
        ("1,24,4,3", "BLOCK_N must be"),
        ("1,8,4,3", "BLOCK_N must be"),
        ("1,32,3,3", "WARPS must be"),
        ("1,32,4,0", "STAGES must be"),
        ("1,32,4,3,100", "BLOCK_K must be"),
    ],
)
def test_bad_launches_are_refused(recorder: _Recorder, value: str, why: str) -> None:
    with pytest.raises(ValueError, match=rf"launch '{value}' \(expected MODE,BLOCK_N,WARPS,STAGES\[,BLOCK_K\].*{why}"):
        Launch.parse(value)
    values = [int(v) for v in value.split(",")] if "," in value and value.replace(",", "").isdigit() else []
    if len(values) in (4, 5):  # the same launch passed as a value: refused before any kernel launch
        with pytest.raises(ValueError, match=why):
            _launch_of(recorder, launch=Launch(*values))
    assert not recorder.launches


def test_default_launches() -> None:
    """Mode 1; 32 output rows on 2 warps while 64-row programs would leave SMs idle, else 64 rows on 4 warps."""
    assert nl.heuristic_launch(3072, 2048, False, 132) == Launch(1, 32, 2, 3, 256)  # QKV
    assert nl.heuristic_launch(8192, 2048, True, 132) == Launch(1, 32, 2, 3, 256)  # fc1 + SwiGLU
    assert nl.heuristic_launch(32768, 2048, False, 132) == Launch(1, 64, 4, 3, 256)  # LM head
    assert str(Launch(1, 32, 2, 3)) == "1,32,2,3,256"
    assert Launch.parse(str(Launch(3, 64, 4, 2, 128))) == Launch(3, 64, 4, 2, 128)


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
