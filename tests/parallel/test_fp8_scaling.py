"""FP8 scaling math (mcore_parallel.fp8.scaling / recipe): formats, scales of known tensors, casts and their round
trips, and the delayed-scaling state (amax history, roll, scale update)."""

from __future__ import annotations

import pytest
import torch

from mcore_parallel import ParallelConfigError
from mcore_parallel.fp8 import E4M3, E5M2, DelayedScaling, Fp8Recipe, amax_of, current_scale, quantize
from mcore_parallel.fp8.scaling import quantize_with_transpose, roll_all, scale_from_amax, step_amaxes


def test_formats_are_torchs() -> None:
    """E4M3 tops out at 448, E5M2 at 57344; unit roundoff 2^-4 and 2^-3; the smallest normals 2^-6 and 2^-14."""
    assert (E4M3.max, E5M2.max) == (448.0, 57344.0)
    for fmt in (E4M3, E5M2):
        info = torch.finfo(fmt.dtype)
        assert info.max == fmt.max and info.tiny == fmt.min_normal
        assert fmt.unit_roundoff == info.eps / 2
        # the smallest subnormal is one subnormal spacing
        assert torch.tensor(fmt.subnormal_spacing).to(fmt.dtype).float().item() == fmt.subnormal_spacing
        assert torch.tensor(fmt.subnormal_spacing / 4).to(fmt.dtype).float().item() == 0.0
    assert (E4M3.unit_roundoff, E5M2.unit_roundoff) == (2.0**-4, 2.0**-3)


def test_scale_of_a_known_tensor() -> None:
    t = torch.tensor([[1.0, -2.0, 0.5], [0.25, 0.125, -0.0625]])
    assert amax_of(t).item() == 2.0
    assert current_scale(t, E4M3, False, 0, None).item() == 224.0  # 448 / 2
    assert current_scale(t, E5M2, False, 0, None).item() == 28672.0  # 57344 / 2
    assert current_scale(t, E4M3, False, 2, None).item() == 56.0  # margin 2: a quarter
    rows = current_scale(t, E4M3, True, 0, None)
    assert rows.shape == (2, 1) and rows.flatten().tolist() == [224.0, 1792.0]  # 448/2, 448/0.25
    q = quantize(t, E4M3, current_scale(t, E4M3, False, 0, None))
    assert q.data.dtype == torch.float8_e4m3fn and q.scale_inv.item() == torch.tensor(1 / 224).item()
    assert q.data.float().abs().max().item() == 448.0  # the largest element lands on the format's largest value
    assert torch.equal(q.dequantize(), t)  # powers of two (and their halves) scale exactly


def test_zero_and_non_finite_tensors() -> None:
    zero = torch.zeros(4, 16)
    assert scale_from_amax(amax_of(zero), E4M3).item() == 1.0  # no division by zero
    assert torch.equal(quantize(zero, E4M3, current_scale(zero, E4M3, False, 0, None)).dequantize(), zero)
    bad = torch.ones(4, 16)
    bad[1, 3] = float("inf")
    deq = quantize(bad, E4M3, current_scale(bad, E4M3, False, 0, None)).dequantize()
    assert not torch.isfinite(deq).all()  # a diverged tensor stays visibly diverged, never silently finite


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_round_trip_error_bound(fmt, rowwise: bool) -> None:  # type: ignore[no-untyped-def]
    """|deq(q(t)) - t| <= u |t| + spacing / (2 scale): round to nearest, relative in the normal range, absolute
    below it; and the cast saturates instead of overflowing."""
    torch.manual_seed(0)
    t = torch.randn(64, 48) * torch.logspace(-3, 2, 48)  # columns spread over five decades
    scale = current_scale(t, fmt, rowwise, 0, None)
    deq = quantize(t, fmt, scale).dequantize().double()
    bound = fmt.unit_roundoff * t.double().abs() + fmt.subnormal_spacing / 2 / scale.double()
    assert ((deq - t.double()).abs() <= bound * (1 + 1e-6)).all()
    assert (deq - t.double()).abs().max() > 0  # it is a real FP8 cast, not a pass-through
    # a delayed scale that is too large: values beyond the range saturate at the largest value
    over = quantize(t, fmt, scale * 4).data.float()
    assert over.abs().max().item() == fmt.max and torch.isfinite(over).all()


def test_transpose_is_the_same_cast() -> None:
    torch.manual_seed(1)
    t = torch.randn(32, 48)
    q, qt = quantize_with_transpose(t, E4M3, current_scale(t, E4M3, False, 0, None))
    assert qt.data.is_contiguous() and qt.data.shape == (48, 32)
    assert torch.equal(qt.data.view(torch.uint8), q.data.t().contiguous().view(torch.uint8))
    assert torch.equal(q.t().data.view(torch.uint8), qt.data.view(torch.uint8))
    rowwise = quantize(t, E4M3, current_scale(t, E4M3, True, 0, None))
    with pytest.raises(ValueError, match="rowwise"):
        rowwise.t()


def _state(length: int = 4, algo: str = "max", margin: int = 0) -> DelayedScaling:
    return DelayedScaling(length, algo, margin, (E4M3, E4M3, E5M2), "cpu")


def test_delayed_scaling_history_and_scales() -> None:
    s = _state(length=3)
    assert not s.ready() and s.scale.tolist() == [0.0, 0.0, 0.0]
    # step 1: no history yet, so the tensor's own maximum scales it; the step's largest maximum is recorded
    t = torch.full((4, 16), 2.0)
    assert s.scale_for(0, t, None).item() == 224.0
    s.scale_for(0, t * 4, None)  # a second micro-batch, larger
    s.scale_for(0, t / 4, None)
    assert s.amax[0].item() == 8.0
    s.roll(torch.tensor([8.0, 1.0, 64.0]))
    assert s.ready() and s.amax.tolist() == [0.0, 0.0, 0.0]
    assert s.amax_history[:, 0].tolist() == [8.0, 0.0, 0.0]
    assert s.scale.tolist() == [448 / 8, 448.0, 57344 / 64]  # the gradient is E5M2
    # step 2: the stored scale is used (a tensor four times larger saturates instead of rescaling)
    assert s.scale_for(0, t * 8, None).item() == 448 / 8
    s.roll(torch.tensor([2.0, 0.0, float("nan")]))  # a zero and a non-finite maximum: the scale stays
    assert s.amax_history[:2, 0].tolist() == [2.0, 8.0] and s.amax_history[0, 2].item() == 0.0
    assert s.scale.tolist() == [448 / 8, 448.0, 57344 / 64]  # max over the history: still 8, 1, 64
    s.roll(torch.tensor([1.0, 1.0, 1.0]))
    s.roll(torch.tensor([1.0, 1.0, 1.0]))  # the 8 (three steps old) leaves a 3-step history
    assert s.amax_history[:, 0].tolist() == [1.0, 1.0, 2.0] and s.scale[0].item() == 448 / 2


def test_kernel_scales_sit_at_16_byte_aligned_addresses() -> None:
    """cuBLAS refuses a ``torch._scaled_mm`` scale at an address not a multiple of 16 bytes
    (CUBLAS_STATUS_NOT_SUPPORTED): every role's cached scale and reciprocal is its own aligned element."""
    s = _state()
    s.roll(torch.tensor([4.0, 2.0, 1.0]))
    s.grad_weight = 0.5
    for role, expected in enumerate([448 / 4, 448 / 2, 57344 / 1 / 0.5]):
        scale, inv, _ = s.kernel_scale(role)
        assert scale.dim() == 0 and inv.dim() == 0
        assert scale.item() == pytest.approx(expected) and inv.item() == pytest.approx(1 / expected)
        assert scale.data_ptr() % 16 == 0 and inv.data_ptr() % 16 == 0, role
        assert s.scale_for(role, torch.ones(2, 16), None).data_ptr() % 16 == 0


def test_roll_all_rolls_each_state_as_its_own_roll_would() -> None:
    """States of several history lengths, algorithms and margins rolled together (``roll_all``, batched by kind)
    against each one's history and scales computed here in float64, over steps with zeros, NaN and inf; the step's
    maxima (``step_amaxes``: the kernels' raw maxima divided by the gradient weight) and ``roll`` of one state."""
    kinds = [(4, "max", 0), (4, "max", 0), (2, "most_recent", 1), (4, "max", 2), (1, "max", 0), (4, "max", 0)]
    states = [_state(n, algo, m) for n, algo, m in kinds]
    fmax = torch.tensor([448.0, 448.0, 57344.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    hist = [torch.zeros(n, 3, dtype=torch.float64) for n, _, _ in kinds]
    scale = [torch.zeros(3, dtype=torch.float64) for _ in kinds]
    for step in range(6):
        amax = torch.rand(len(states), 3, generator=g, dtype=torch.float64) * 10
        raw = torch.rand(len(states), 3, generator=g, dtype=torch.float64) * 10
        amax[1, 0], amax[2, 1], amax[3, 2] = 0.0, float("nan"), float("inf")  # count as 0: the scale stays
        weight = [1.0, 0.5, 0.25][step % 3]
        for s, a, r in zip(states, amax, raw, strict=True):
            s.grad_weight = weight
            s.amax.copy_(a), s.amax_raw.copy_(r)
        expected_step = torch.maximum(amax, raw / torch.tensor([1.0, 1.0, weight], dtype=torch.float64))
        got_step = step_amaxes(states)
        assert torch.allclose(got_step.double(), expected_step.float().double(), rtol=1e-6, equal_nan=True)
        if step == 5:
            states[0].roll(got_step[0])
            roll_all(states[1:], got_step[1:])
        else:
            roll_all(states, got_step)
        for i, ((_n, algo, margin), s) in enumerate(zip(kinds, states, strict=True)):
            a = torch.nan_to_num(got_step[i].double(), nan=0.0, posinf=0.0, neginf=0.0)
            hist[i] = torch.cat([a[None], hist[i][:-1]])
            ref = hist[i].amax(0) if algo == "max" else hist[i][0]
            scale[i] = torch.where(ref > 0, fmax / 2.0**margin / ref, scale[i])
            assert torch.allclose(s.amax_history.double(), hist[i], rtol=1e-6), (step, i)
            assert torch.allclose(s.scale.double(), scale[i], rtol=1e-6), (step, i)
            assert s.ready() and not s.amax.any() and not s.amax_raw.any()


def test_delayed_scaling_most_recent_and_margin() -> None:
    s = _state(length=4, algo="most_recent", margin=1)
    s.roll(torch.tensor([8.0, 8.0, 8.0]))
    s.roll(torch.tensor([2.0, 2.0, 2.0]))
    assert s.scale.tolist() == [448 / 2 / 2, 448 / 2 / 2, 57344 / 2 / 2]


def test_delayed_state_is_ready_after_a_load() -> None:
    """Scales loaded from a checkpoint are used at once (a fresh state would rescale the first step from the
    tensor itself, and a resumed run would not continue the saved one)."""
    saved = _state()
    saved.roll(torch.tensor([4.0, 2.0, 1.0]))
    loaded = _state()
    loaded.load_state_dict(saved.state_dict())
    assert set(saved.state_dict()) == {"amax_history", "scale"} == set(saved.saved_buffers())
    t = torch.full((2, 16), 1.0)
    assert loaded.scale_for(0, t, None).item() == 448 / 4


def test_recipe_problems_name_the_keys() -> None:
    with pytest.raises(ParallelConfigError) as e:
        Fp8Recipe("e5m2", "blockwise", amax_history_len=0, amax_compute_algo="mean", margin=-1)
    text = str(e.value)
    for needle in ("fp8='e5m2'", "fp8_recipe='blockwise'", "fp8_amax_history_len=0", "fp8_amax_compute_algo='mean'",
                   "fp8_margin=-1"):  # fmt: skip
        assert needle in text
    with pytest.raises(ParallelConfigError, match="set fp8=e4m3"):
        Fp8Recipe("hybrid", "rowwise")
    r = Fp8Recipe("hybrid", "delayed")
    assert (r.forward_format, r.backward_format) == (E4M3, E5M2) and r.fp8_wgrad
    assert Fp8Recipe("e4m3").backward_format is E4M3
    assert not Fp8Recipe("e4m3", "rowwise").fp8_wgrad  # rowwise keeps the weight gradient in bf16


def test_gradient_history_is_per_unit_loss_weight() -> None:
    """At dp2 each rank backpropagates its micro-batches with twice the weight of dp1 (half as many per rank), so its
    gradients are twice as large: kept per unit weight, the history and the scales are the same."""
    one, two = _state(), _state()
    one.grad_weight, two.grad_weight = 0.25, 0.5
    g = torch.full((4, 16), 3.0)
    one.scale_for(2, g, None)
    two.scale_for(2, g * 2, None)
    assert one.amax[2].item() == two.amax[2].item() == 12.0
    one.roll(one.amax.clone())
    two.roll(two.amax.clone())
    assert torch.equal(one.amax_history, two.amax_history) and torch.equal(one.scale, two.scale)
    assert one.scale_for(2, g, None).item() == pytest.approx(57344 / 3)  # the actual gradient's range
    assert two.scale_for(2, g * 2, None).item() == pytest.approx(57344 / 6)


@pytest.mark.slow
def test_compiled_cast_kernels_equal_the_eager_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the amax, scale and cast run as torch.compile'd kernels (shape-dynamic); compiled here for the CPU
    (inductor's C++ backend), they give the eager ops' bits for two shapes, both formats, bf16 and fp32. (With
    Triton, CUDA runs ``cast_triton`` instead: these kernels remain the path without it and the rowwise amax.)"""
    from mcore_parallel.fp8 import scaling

    monkeypatch.setattr(scaling, "_COMPILED", {})
    real = scaling._kernel
    monkeypatch.setattr(scaling, "_kernel", lambda name, fn, device: real(name, fn, torch.device("cuda")))
    torch.manual_seed(3)
    # each dtype and format is a compile of its own: one pairing of each keeps this test short
    for shape, dtype, fmt in (((32, 48), torch.float32, E4M3), ((80, 16), torch.bfloat16, E5M2)):
        t = torch.randn(shape, dtype=dtype) * 3
        for rowwise in (False, True):
            s = current_scale(t, fmt, rowwise, 1, None)
            monkeypatch.setattr(scaling, "_kernel", lambda name, fn, device: fn)
            expected = current_scale(t, fmt, rowwise, 1, None)
            q_eager = quantize(t, fmt, expected)
            monkeypatch.setattr(scaling, "_kernel", lambda name, fn, device: real(name, fn, torch.device("cuda")))
            assert torch.equal(s, expected)
            q = quantize(t, fmt, s)
            assert torch.equal(q.data.view(torch.uint8), q_eager.data.view(torch.uint8))
            assert torch.equal(q.scale_inv, q_eager.scale_inv)
            if not rowwise:
                _, qt = quantize_with_transpose(t, fmt, s)
                assert torch.equal(qt.data.view(torch.uint8), q_eager.data.t().contiguous().view(torch.uint8))
    assert set(scaling._COMPILED) == {"amax_scale", "cast", "cast_t"}


def test_an_evaluation_leaves_the_history_alone() -> None:
    from mcore_parallel import Group
    from mcore_parallel.fp8 import Fp8RowParallelLinear, fp8_step

    layer = Fp8RowParallelLinear(32, 16, tp=Group.single(), recipe=Fp8Recipe("hybrid", "delayed"), seed=1)
    with fp8_step([layer]):
        layer(torch.ones(4, 32, requires_grad=True)).sum().backward()
    history = layer.fp8_scaling.amax_history.clone()
    with torch.no_grad(), fp8_step([layer], update_scaling=False):
        layer(torch.full((4, 32), 100.0))
    assert layer.fp8_scaling.amax.tolist() == [0.0, 0.0, 0.0] and torch.equal(layer.fp8_scaling.amax_history, history)
    with fp8_step([layer]):
        layer(torch.full((4, 32), 3.0, requires_grad=True)).sum().backward()
    assert layer.fp8_scaling.amax_history[0, 0].item() == 3.0  # training records again
