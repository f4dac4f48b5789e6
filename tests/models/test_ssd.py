"""The chunked SSD scan (``mcore_models.ssm.ssd_scan``) equals the sequential recurrence it decomposes, in values and
in every gradient, for chunk sizes that do and do not divide the sequence, grouped B/C, and carried states."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mcore_models.ssm import ssd
from mcore_models.ssm.ssd import ssd_reference, ssd_scan

F64 = torch.float64
NAMES = ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_states")


def _inputs(b: int, s: int, H: int, P: int, G: int, N: int, seed: int = 0, dtype: torch.dtype = F64) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(dtype).requires_grad_()

    return {
        "x": rand(b, s, H, P),
        "dt": rand(b, s, H),
        "A": (-torch.rand(H, generator=g, dtype=F64) * 2 - 0.1).to(dtype).requires_grad_(),
        "B": rand(b, s, G, N),
        "C": rand(b, s, G, N),
        "D": rand(H),
        "dt_bias": rand(H, scale=0.5),
        "initial_states": rand(b, H, P, N),
    }


def _run(fn: Any, inputs: dict, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Output, final states and the gradients of a fixed random weighting of both."""
    args = {k: v for k, v in inputs.items() if k not in ("x", "dt", "A", "B", "C")}
    y, final = fn(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], return_final_states=True,
                  **args, **kwargs)  # fmt: skip
    g = torch.Generator().manual_seed(99)
    wy = torch.randn(y.shape, generator=g, dtype=F64).to(y.dtype)
    wf = torch.randn(final.shape, generator=g, dtype=F64).to(final.dtype)
    grads = torch.autograd.grad((y * wy).sum() + (final * wf).sum(), [inputs[n] for n in NAMES])
    return y.detach(), final.detach(), dict(zip(NAMES, grads, strict=True))


def _assert_same(a: tuple, b: tuple, tol: float) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=tol, atol=tol, msg="y")
    torch.testing.assert_close(a[1], b[1], rtol=tol, atol=tol, msg="final_states")
    for name in NAMES:
        torch.testing.assert_close(a[2][name], b[2][name], rtol=tol, atol=tol, msg=f"grad of {name}")


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("seqlen", [1, 13, 37])
@pytest.mark.parametrize("chunk", [4, 8, 16])
def test_chunked_scan_equals_the_sequential_recurrence(chunk: int, seqlen: int, groups: int) -> None:
    inputs = _inputs(2, seqlen, 4, 3, groups, 5)
    _assert_same(_run(ssd_scan, inputs, chunk_size=chunk), _run(ssd_reference, inputs), 1e-10)


@given(
    b=st.integers(1, 2),
    s=st.integers(1, 40),
    groups_heads=st.sampled_from([(1, 1), (1, 3), (2, 2), (2, 4), (3, 6)]),
    P=st.integers(1, 4),
    N=st.integers(1, 6),
    chunk=st.sampled_from([1, 2, 5, 8, 64]),
    seed=st.integers(0, 1000),
)
@settings(max_examples=25, deadline=None)
def test_chunked_scan_equals_the_recurrence_over_shapes(
    b: int, s: int, groups_heads: tuple[int, int], P: int, N: int, chunk: int, seed: int
) -> None:
    G, H = groups_heads
    inputs = _inputs(b, s, H, P, G, N, seed)
    _assert_same(_run(ssd_scan, inputs, chunk_size=chunk), _run(ssd_reference, inputs), 1e-9)


def test_dt_limit_and_no_softplus_are_applied_before_the_recurrence() -> None:
    inputs = _inputs(1, 11, 2, 2, 1, 3)
    for kwargs in ({"dt_limit": (0.3, 0.9)}, {"dt_softplus": False, "dt_limit": (0.0, 0.5)}):
        _assert_same(_run(ssd_scan, inputs, chunk_size=4, **kwargs), _run(ssd_reference, inputs, **kwargs), 1e-10)
    x, dt, A, B, C = (inputs[k].detach() for k in ("x", "dt", "A", "B", "C"))
    clamped = ssd_scan(x, dt, A, B, C, chunk_size=4, dt_limit=(0.2, 0.2))
    fixed = ssd_scan(x, torch.full_like(dt, 0.2), A, B, C, chunk_size=4, dt_softplus=False)
    torch.testing.assert_close(clamped, fixed)


def test_the_final_state_carries_a_split_sequence() -> None:
    """Scanning the first part, then the rest from its final state, is scanning the whole (odd lengths, padding)."""
    inputs = {k: v.detach() for k, v in _inputs(2, 29, 4, 3, 2, 5).items()}
    x, dt, A, B, C = (inputs[k] for k in ("x", "dt", "A", "B", "C"))
    kw = dict(chunk_size=8, D=inputs["D"], dt_bias=inputs["dt_bias"])
    whole, whole_final = ssd_scan(x, dt, A, B, C, return_final_states=True, **kw)  # type: ignore[arg-type]
    cut = 11
    first, mid = ssd_scan(x[:, :cut], dt[:, :cut], A, B[:, :cut], C[:, :cut], return_final_states=True, **kw)  # type: ignore[arg-type]
    rest, final = ssd_scan(x[:, cut:], dt[:, cut:], A, B[:, cut:], C[:, cut:], initial_states=mid,
                           return_final_states=True, **kw)  # type: ignore[arg-type]  # fmt: skip
    torch.testing.assert_close(torch.cat([first, rest], 1), whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, whole_final, rtol=1e-12, atol=1e-12)


def test_low_precision_inputs_are_computed_in_float32() -> None:
    inputs = {k: v.detach() for k, v in _inputs(1, 20, 4, 4, 2, 8).items()}
    bf16 = {k: v.to(torch.bfloat16) for k, v in inputs.items()}
    ref = ssd_reference(*(bf16[k].double() for k in ("x", "dt", "A", "B", "C")), D=bf16["D"].double())
    y, final = ssd_scan(*(bf16[k] for k in ("x", "dt", "A", "B", "C")), D=bf16["D"], chunk_size=8,
                        return_final_states=True)  # fmt: skip
    assert y.dtype == torch.bfloat16 and final.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, rtol=2e-2, atol=2e-2)  # only the output's bf16 rounding
    f32 = ssd_scan(*(inputs[k].float() for k in ("x", "dt", "A", "B", "C")), chunk_size=8)
    assert f32.dtype == torch.float32


def test_shapes_are_checked_naming_the_argument() -> None:
    inputs = {k: v.detach() for k, v in _inputs(1, 5, 4, 2, 2, 3).items()}
    x, dt, A, B, C = (inputs[k] for k in ("x", "dt", "A", "B", "C"))
    with pytest.raises(ValueError, match=r"dt_bias has shape \(3,\), expected \(4,\)"):
        ssd_scan(x, dt, A, B, C, chunk_size=4, dt_bias=torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match="not divisible by the 3 groups"):
        ssd_scan(x, dt, A, B.repeat(1, 1, 2, 1)[:, :, :3], C.repeat(1, 1, 2, 1)[:, :, :3], chunk_size=4)
    with pytest.raises(ValueError, match="impl='cuda' is not one of"):
        ssd_scan(x, dt, A, B, C, chunk_size=4, impl="cuda")  # type: ignore[call-overload]


def test_triton_is_never_a_silent_fallback(monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    inputs = {k: v.detach() for k, v in _inputs(1, 5, 4, 2, 2, 3).items()}
    args = tuple(inputs[k] for k in ("x", "dt", "A", "B", "C"))
    monkeypatch.setattr(ssd, "_import_triton", lambda: (None, "ModuleNotFoundError: no ssd_triton"))
    with pytest.raises(RuntimeError, match=r"impl='triton'.*not usable \(ModuleNotFoundError: no ssd_triton\)"):
        ssd_scan(*args, chunk_size=4, impl="triton")
    with caplog.at_level(logging.DEBUG, logger="mcore_models.ssm.ssd"):
        torch.testing.assert_close(ssd_scan(*args, chunk_size=4, impl="auto"), ssd_scan(*args, chunk_size=4))
    calls: list[dict] = []

    def fake(*a: Any, **kw: Any) -> torch.Tensor:
        calls.append(kw)
        return torch.zeros_like(a[0])

    monkeypatch.setattr(ssd, "_import_triton", lambda: (fake, ""))
    assert not ssd_scan(*args, chunk_size=4, impl="triton", D=inputs["D"]).any()
    assert calls[0]["chunk_size"] == 4 and calls[0]["D"] is inputs["D"] and "impl" not in calls[0]
    assert ssd_scan(*args, chunk_size=4, impl="auto").any()  # auto: triton only for CUDA tensors
