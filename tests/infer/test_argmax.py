"""The greedy draw's argmax kernel (:func:`mcore_infer.kernels.argmax.row_argmax`) equals ``torch.argmax(-1)``
index for index: ties to the first index, NaN first, rows of -inf, a vocabulary not a multiple of the chunk; call
after call (its counters return to zero). Runs on GPUs, or on the CPU under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import pytest
import torch

from mcore_infer.kernels import argmax as argmax_module
from mcore_infer.kernels.argmax import BLOCK, row_argmax
from tests.infer._kernels import KERNEL_DEVICES as DEVICES


def _cases(device: str, dtype: torch.dtype, v: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(v)
    x = torch.randn(7, v, generator=g).to(dtype)
    x[1, :] = x[1].max() + 1  # ties everywhere: index 0
    x[2, v // 3] = x[2, -1] = float(x[2].max()) + 2  # a tie across chunks: the lower index
    x[3, :] = float("-inf")  # nothing finite: index 0
    x[4, v - 1] = float("nan")  # a NaN wins over any value
    x[4, 5] = float("inf")
    x[5, min(v - 1, BLOCK + 3)] = float("nan")
    x[5, min(v - 1, 2 * BLOCK + 7)] = float("nan")  # the first NaN
    x[6, -1] = float("inf")
    return x.to(device)


@pytest.mark.skipif(not DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 with Triton")
@pytest.mark.parametrize("device", DEVICES or ["cpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("v", [1000, 3 * BLOCK + 17, 32768])
def test_row_argmax_equals_torch(device: str, dtype: torch.dtype, v: int, monkeypatch: pytest.MonkeyPatch) -> None:
    x = _cases(device, dtype, v)
    want = x.cpu().argmax(-1)
    calls = []
    real = argmax_module._kernel
    monkeypatch.setattr(argmax_module, "_kernel", lambda: calls.append(1) or real())
    for _ in range(2):  # the counters are zero again after a call
        assert torch.equal(row_argmax(x).cpu(), want)
        assert torch.equal(row_argmax(x[3:4]).cpu(), want[3:4])
    assert len(calls) == 4 and argmax_module._FAILED is None  # the kernel ran (not torch's argmax)


def test_other_inputs_take_torch_argmax() -> None:
    x = torch.randn(3, 50, dtype=torch.float64)
    assert torch.equal(row_argmax(x), x.argmax(-1))
    assert row_argmax(torch.empty(0, 5)).shape == (0,)


@pytest.mark.skipif(not DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 with Triton")
@pytest.mark.parametrize("device", DEVICES or ["cpu"])
def test_the_greedy_draw_takes_the_kernel(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of only greedy rows (no penalties, logprobs or banned tokens) draws through the kernel."""
    from mcore_infer import SamplingParams
    from mcore_infer.sampling import Sampler, SampleRow

    calls = []
    real = argmax_module._kernel
    monkeypatch.setattr(argmax_module, "_kernel", lambda: calls.append(1) or real())
    x = _cases(device, torch.float32, 5000)
    rows = [SampleRow(SamplingParams(temperature=0.0), [1, 2], [], None, []) for _ in range(x.shape[0])]
    got = Sampler(device).draw(x, rows).result()
    assert got.tokens == x.cpu().argmax(-1).tolist() and calls and argmax_module._FAILED is None


def test_a_kernel_that_cannot_run_falls_back_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A Triton that cannot compile the kernel: a warning naming why, then torch's argmax for every later call."""

    class Broken:
        def __getitem__(self, grid: object) -> object:
            raise RuntimeError("no such instruction")

    monkeypatch.setattr(argmax_module, "_use_triton", lambda x: True)
    monkeypatch.setattr(argmax_module, "_kernel", lambda: Broken())
    monkeypatch.setattr(argmax_module, "_FAILED", None)
    x = torch.randn(3, 5000)
    assert torch.equal(row_argmax(x), x.argmax(-1)) and torch.equal(row_argmax(x), x.argmax(-1))
    assert argmax_module._FAILED == "RuntimeError: no such instruction"
    assert [r.getMessage() for r in caplog.records].count(
        "the argmax kernel failed (RuntimeError: no such instruction); greedy draws use torch.argmax"
    ) == 1


@pytest.mark.parametrize("device", [*DEVICES, "torch"] if DEVICES else ["torch"])
def test_out_receives_the_tokens(device: str) -> None:
    """``out=``: the tokens are written into the caller's buffer (the next decode step's input ids) and returned,
    by the kernel and by torch's argmax alike; the greedy draw passes it through; a wrong buffer is refused."""
    from mcore_infer import SamplingParams
    from mcore_infer.sampling import Sampler, SampleRow

    dev = "cpu" if device == "torch" else device
    x = _cases(dev, torch.float32, 5000) if device != "torch" else torch.randn(7, 5000, dtype=torch.float64)
    buf = torch.full((9,), -1, dtype=torch.int64, device=dev)
    got = row_argmax(x, out=buf[1:8])
    assert got.data_ptr() == buf[1:8].data_ptr()
    assert buf.tolist() == [-1, *x.cpu().argmax(-1).tolist(), -1]
    rows = [SampleRow(SamplingParams(temperature=0.0), [1, 2], [], None, []) for _ in range(x.shape[0])]
    buf.fill_(-1)
    drawn = Sampler(dev).draw(x, rows, out=buf[:7])
    assert drawn.result().tokens == x.cpu().argmax(-1).tolist() == buf[:7].tolist()
    with pytest.raises(ValueError, match=r"out must be contiguous int64 \[7\]"):
        row_argmax(x, out=buf[:6])
