"""The FP8 linear's Triton casts (``mcore_parallel.fp8.cast_triton``) against the PyTorch ops they replace on CUDA
(``scaling._amax``, ``_cast``, ``_cast_transposed``): the same bytes for E4M3 and E5M2, tensorwise and rowwise
scales, float32 and bfloat16 inputs, values across the formats' normal and subnormal ranges and above their
maximum (saturated), ties on the grid (rounded to even), shapes that are not multiples of the tiles, rows with a
stride; the absolute maximum, NaN included. On GPUs, or on the CPU under ``TRITON_INTERPRET=1``; skipped without
either."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from mcore_parallel.fp8 import scaling
from mcore_parallel.fp8.cast_triton import amax_triton, cast_triton
from mcore_parallel.fp8.recipe import E4M3, E5M2

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICES: list = []
if torch.cuda.is_available() and HAS_TRITON:
    DEVICES.append(pytest.param("cuda", marks=pytest.mark.gpu))
if os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON:
    DEVICES.append("cpu")
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 + Triton")
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def _tensor(rows: int, cols: int, device: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Magnitudes over 10 decades (so the scaled values cover the subnormals), a few exact grid ties."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 4, cols)
    t[0, : min(cols, 8)] = torch.tensor([0.0, -0.0, 1.0625, -1.1875, 3.25, 2.0**-10, -(2.0**-9) * 1.5, 1e6])[:cols]
    return t.to(device=device, dtype=dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", [(100, 200), (64, 128), (3, 16), (130, 272)], ids=str)
def test_tensorwise_cast_and_transpose_equal_the_pytorch_cast(
    device: str, dtype: torch.dtype, fmt: str, shape: tuple
) -> None:
    f = FORMATS[fmt]
    t = _tensor(*shape, device, dtype)
    for scale in (torch.tensor(1.0), torch.tensor(f.max / 1e3), torch.tensor(f.max / 1e3 * 7.3)):
        scale = scale.to(device)
        q, qt = cast_triton(t, scale, f.max, f.dtype, True)
        ref, ref_t, _ = scaling._cast_transposed(t, scale, f.max, f.dtype)
        assert torch.equal(_bytes(q), _bytes(ref)), f"scale {scale.item()}: the cast differs"
        assert qt is not None and torch.equal(_bytes(qt), _bytes(ref_t)), f"scale {scale.item()}: the transpose differs"
        assert qt.is_contiguous() and qt.shape == (shape[1], shape[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_rowwise_cast_and_strided_rows(device: str, fmt: str) -> None:
    f = FORMATS[fmt]
    wide = _tensor(70, 300, device, torch.bfloat16, seed=1)
    t = wide[:, 20:180]  # rows with a stride of 300
    scale = scaling._amax_scale(t, True, f.max)
    q, qt = cast_triton(t, scale, f.max, f.dtype, False)
    ref, _ = scaling._cast(t, scale, f.max, f.dtype)
    assert qt is None and q.is_contiguous()
    assert torch.equal(_bytes(q), _bytes(ref))


@pytest.mark.parametrize("device", DEVICES)
def test_amax(device: str) -> None:
    t = _tensor(333, 77, device, torch.bfloat16, seed=2)
    assert torch.equal(amax_triton(t).cpu(), scaling._amax(t, False).cpu())
    t[200, 3] = -7e7
    assert amax_triton(t).item() == pytest.approx(abs(t[200, 3].float().item()))
    assert amax_triton(torch.zeros(0, 5, device=device)).item() == 0.0
    t[5, 5] = float("nan")
    assert torch.isnan(amax_triton(t))  # a diverged tensor shows up (its scale, and so the GEMM's result, is NaN)


@pytest.mark.parametrize("device", DEVICES)
def test_saturates_at_the_format_maximum(device: str) -> None:
    t = torch.tensor([[1e9, -1e9, 500.0, -470.0, 447.0, 0.5] + [0.0] * 10], device=device)
    q, _ = cast_triton(t, torch.tensor(1.0, device=device), E4M3.max, E4M3.dtype, False)
    assert q.float().cpu()[0, :6].tolist() == [448.0, -448.0, 448.0, -448.0, 448.0, 0.5]


@pytest.mark.parametrize("device", DEVICES)
def test_the_cast_folds_the_maximum_into_amax_out(device: str) -> None:
    t = _tensor(150, 130, device, torch.bfloat16, seed=3)
    scale = torch.tensor(0.5, device=device)
    out = torch.full((1,), 3.0, device=device)  # an earlier micro-batch's maximum, smaller
    q, _ = cast_triton(t, scale, E4M3.max, E4M3.dtype, True, amax_out=out)
    assert torch.equal(_bytes(q), _bytes(scaling._cast(t, scale, E4M3.max, E4M3.dtype)[0]))
    assert out.item() == scaling._amax(t, False).item()
    big = torch.full((1,), 1e30, device=device)
    cast_triton(t, scale, E4M3.max, E4M3.dtype, False, amax_out=big)
    assert big.item() == torch.tensor(1e30).item()  # a larger earlier maximum stays
    t[7, 9] = float("nan")
    nan = torch.zeros(1, device=device)
    cast_triton(t, scale, E4M3.max, E4M3.dtype, False, amax_out=nan)
    assert nan.item() == float("inf")  # a NaN is recorded as non-finite (the history counts it as 0)


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_scaling_casts_and_records_in_one_pass(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a history, DelayedScaling.quantize takes the fused pass (here forced on for the interpreter) and gives
    the bytes, scale and recorded maximum of scale_for followed by the separate cast."""
    monkeypatch.setattr(scaling, "_triton", lambda t: True)
    fused, plain = (scaling.DelayedScaling(4, "max", 0, (E4M3, E4M3, E5M2), device) for _ in range(2))
    for s in (fused, plain):
        s.roll(torch.tensor([8.0, 0.0, 64.0], device=device))  # the weight's maximum was 0: scale 1
        s.grad_weight = 0.25
    g = _tensor(64, 48, device, torch.float32, seed=4)
    for role in (0, 1, 2):
        q, qt = fused.quantize(role, g, None, True)
        monkeypatch.setattr(scaling, "_triton", lambda t: False)
        rq, rqt = plain.quantize(role, g, None, True)
        monkeypatch.setattr(scaling, "_triton", lambda t: True)
        assert qt is not None and rqt is not None
        assert torch.equal(_bytes(q.data), _bytes(rq.data)) and torch.equal(_bytes(qt.data), _bytes(rqt.data))
        assert torch.equal(q.scale_inv, rq.scale_inv)
    got = fused.step_amax()
    assert torch.equal(got, plain.step_amax()) and got[2].item() == pytest.approx(g.abs().max().item() / 0.25)
    assert plain.scale_for(1, g, None).item() == 1.0  # a maximum of 0 in every step: scale 1


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_scaling_kernel_casts_keep_the_step_maxima_exact(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused casts fold unweighted maxima into amax_raw: a new gradient weight mid-way (a step that raised, then
    another layout's weight) folds them under the old weight first, an evaluation (not recording) leaves them alone,
    and the cached scales follow a roll and a checkpoint load."""
    monkeypatch.setattr(scaling, "_triton", lambda t: True)
    s = scaling.DelayedScaling(4, "max", 0, (E4M3, E4M3, E5M2), device)
    s.roll(torch.tensor([8.0, 1.0, 64.0], device=device))
    g = _tensor(32, 16, device, torch.float32, seed=5)
    big = g.abs().max().item()
    s.grad_weight = 0.25
    q, _ = s.quantize(2, g, None, False)
    assert q.scale_inv.item() == pytest.approx(1 / (57344 / 64 / 0.25))
    s.grad_weight = 0.5  # folds the first cast's maximum per unit weight
    s.quantize(2, g * 0.5, None, False)
    assert s.step_amax()[2].item() == pytest.approx(big / 0.25)  # max(big / 0.25, 0.5 big / 0.5)
    s.recording = False
    s.quantize(0, g * 1000, None, False)
    assert s.step_amax()[0].item() == 0.0
    s.recording = True
    s.roll(s.step_amax())
    assert s.amax_raw.tolist() == [0.0, 0.0, 0.0]
    assert s.quantize(2, g, None, False)[0].scale_inv.item() == pytest.approx(big / 0.25 / 57344 * 0.5)
    state = {k: v.clone() for k, v in s.state_dict().items()}
    state["scale"] = torch.tensor([2.0, 2.0, 2.0], device=device)
    s.load_state_dict(state)  # in place: the cached scales are recomputed
    with torch.inference_mode():  # a serving or evaluation pass first: its scales are not the training step's
        s.quantize(0, g, None, False)
    q, _ = s.quantize(0, g, None, False)
    assert q.scale_inv.item() == 0.5
    assert not q.scale_inv.is_inference()  # (a training step saves it for its backward)


def test_native_rounding_is_for_16_bit_sources_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from mcore_parallel.fp8 import cast_triton as module

    monkeypatch.setattr(module, "NATIVE_ROUNDING", True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for source, native in ((torch.bfloat16, True), (torch.float16, True), (torch.float32, False)):
        assert module.quantize_args(torch.float8_e4m3fn, source)["NATIVE"] is native
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter's conversion does not round as the GPU's does
    assert module.quantize_args(torch.float8_e4m3fn, torch.bfloat16)["NATIVE"] is False
    monkeypatch.setattr(module, "NATIVE_ROUNDING", False)
    assert module.quantize_args(torch.float8_e5m2, torch.bfloat16) == {"EMIN": 127 - 14, "MBITS": 2, "NATIVE": False}


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_native_rounding_gives_the_pytorch_bytes_on_the_gpu(dtype: torch.dtype, fmt: str, rowwise: bool,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``NATIVE_ROUNDING``: the GPU's conversion instruction rounds as the PyTorch cast does, ties to even included
    (Triton's interpreter rounds ties otherwise, so this runs on GPUs only); float32 sources keep the arithmetic
    rounding (the native path's transpose of a float32 tile came back wrong on an H200), so their bytes too."""
    from mcore_parallel.fp8 import cast_triton as module

    monkeypatch.setattr(module, "NATIVE_ROUNDING", True)
    f = FORMATS[fmt]
    t = _tensor(130, 272, "cuda", dtype, seed=6)
    scales = [scaling._amax_scale(t, True, f.max)] if rowwise else [torch.tensor(v, device="cuda") for v in
                                                                      (1.0, f.max / 1e3, f.max / 1e3 * 7.3)]  # fmt: skip
    for scale in scales:
        q, qt = cast_triton(t, scale, f.max, f.dtype, not rowwise)
        if rowwise:
            assert torch.equal(_bytes(q), _bytes(scaling._cast(t, scale, f.max, f.dtype)[0]))
        else:
            ref, ref_t, _ = scaling._cast_transposed(t, scale, f.max, f.dtype)
            assert qt is not None and torch.equal(_bytes(q), _bytes(ref)) and torch.equal(_bytes(qt), _bytes(ref_t))
