"""``decode_step_triton``: the Triton decode step of a Mamba-2 mixer (conv window, time step, state update, output)
against the PyTorch decode path (``mcore_models.ssm.inference.decode_step_torch``): ``y`` and both states updated in
place at the requests' slots, for several batch sizes, one and several groups of B and C, a 4-tap conv (and a 2-tap
one without bias and with a clamped time step), float32 and bfloat16 models, slots in arbitrary order beside the
scratch slot 0 that padded rows of a CUDA graph use, and strided inputs (views of the in-projection's output, a view of slots). The
kernels run on GPUs, or on the CPU under ``TRITON_INTERPRET=1``; without either those tests are skipped."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_models import LayerSpec, MambaConfig, ModelContext, TransformerConfig
from mcore_models.ssm import Mamba2Mixer
from mcore_models.ssm.decode_triton import decode_step_triton, ssm_rows_per_program
from mcore_models.ssm.inference import decode_step, decode_step_torch, mamba_state_shapes, uses_decode_kernel
from mcore_parallel import Group
from tests.models._kernels import KERNEL_DEVICES, needs_kernel

SLOTS = 9


def _mixer(groups: int, dtype: torch.dtype, device: str, **mamba: Any) -> Mamba2Mixer:
    """hidden 32: d_inner 64, 8 heads of 8 channels, state 16; parameters drawn away from their initial values (D is
    1 there, the conv bias small)."""
    m = MambaConfig(**{**dict(d_state=16, head_dim=8, n_groups=groups, chunk_size=4), **mamba})
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, normalization="rmsnorm",
                               add_bias_linear=False, position_embedding="none", vocab_size=64, mamba=m,
                               hybrid_pattern="M")  # fmt: skip
    mixer = Mamba2Mixer(config, ModelContext(Group.single("tp")), LayerSpec(), "decoder.layers.0.mixer")
    g = torch.Generator().manual_seed(groups)
    with torch.no_grad():
        mixer.D.copy_(torch.randn(mixer.D.shape, generator=g))
        mixer.dt_bias.add_(0.5 * torch.randn(mixer.dt_bias.shape, generator=g))
        if mixer.conv1d.bias is not None:
            mixer.conv1d.bias.copy_(torch.randn(mixer.conv1d.bias.shape, generator=g))
    return mixer.to(device=device, dtype=dtype)


def _states(mixer: Mamba2Mixer, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    (c, k), shape = mamba_state_shapes(mixer)
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(SLOTS, c, k, generator=g).to(device=device, dtype=mixer.D.dtype)
    ssm = torch.randn(SLOTS, *shape, generator=g).to(device)
    return conv, ssm


def _inputs(mixer: Mamba2Mixer, rows: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``xbc`` and raw ``dt`` as strided views of one ``[rows, z | xBC | dt]`` tensor, as the in-projection gives."""
    d, gn, heads = mixer.d_local, mixer.gn_local, mixer.heads_local
    g = torch.Generator().manual_seed(seed)
    zxbcdt = torch.randn(rows, 2 * d + 2 * gn + heads, generator=g).to(device=device, dtype=mixer.D.dtype)
    _, xbc, dt = zxbcdt.split([d, d + 2 * gn, heads], dim=-1)
    return xbc, dt


def _kernel(mixer: Mamba2Mixer, *args: torch.Tensor) -> torch.Tensor:
    return decode_step_triton(*args, conv_weight=mixer.conv1d.weight, conv_bias=mixer.conv1d.bias,
                              A_log=mixer.A_log, D=mixer.D, dt_bias=mixer.dt_bias, dt_limit=mixer.mamba.dt_limit,
                              groups=mixer.groups_local)  # fmt: skip


def _close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    """Within ``tol`` of ``want``'s largest magnitude (``y`` sums terms that may cancel: its error scales with them)."""
    err, scale = (got.float() - want.float()).abs().max(), want.float().abs().max().clamp(min=1.0)
    assert err <= tol * scale, (what, float(err), float(scale))


# a batch's slots: arbitrary order; a padded row on the scratch slot 0 (alone there, so its result is defined)
# bf16: the conv output is rounded to bf16 twice and y once; the interpreter rounds float32 -> bf16 toward zero (the
# GPU to nearest, as PyTorch): y moves by a few ulps (~1% of its norm), the state by dt B times an ulp of x
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1e-2)}  # (y, ssm state)
SLOT_ORDERS = {1: [4], 3: [7, 0, 2], 6: [5, 1, 8, 3, 0, 6]}
VARIANTS = {"conv4": {}, "conv2-nobias-limit": dict(d_conv=2, conv_bias=False, dt_limit=(0.05, 0.4))}


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("rows", list(SLOT_ORDERS))
def test_kernel_equals_the_pytorch_decode_step(device: str, variant: str, dtype: torch.dtype, groups: int,
                                               rows: int) -> None:  # fmt: skip
    """Two steps in a row from the same states: every slot of both states (the batch's advanced, the others
    untouched) and ``y`` equal the PyTorch path's; the conv state is a shift of stored values, so exactly equal."""
    mixer = _mixer(groups, dtype, device, **VARIANTS[variant])
    # a strided view, as the slots of a mixed step's one-token requests are
    slots = torch.tensor(SLOT_ORDERS[rows], device=device).repeat_interleave(2)[::2]
    assert slots.stride(0) == 2
    conv_t, ssm_t = _states(mixer, device, seed=rows)
    conv_k, ssm_k = conv_t.clone(), ssm_t.clone()
    before = ssm_t.clone()
    with torch.no_grad():
        for step in range(2):
            xbc, dt = _inputs(mixer, rows, device, seed=10 * rows + step)
            assert xbc.stride(0) != xbc.shape[1]  # a strided view
            want = decode_step_torch(mixer, xbc, dt, slots, conv_t, ssm_t)
            got = _kernel(mixer, xbc, dt, slots, conv_k, ssm_k)
            assert got.shape == want.shape and got.dtype == want.dtype == dtype
            _close(got, want, TOL[dtype][0], f"y, step {step}")
            assert torch.equal(conv_k, conv_t), f"conv state, step {step}"
            _close(ssm_k, ssm_t, TOL[dtype][1], f"ssm state, step {step}")
    untouched = [s for s in range(SLOTS) if s not in SLOT_ORDERS[rows]]
    assert torch.equal(ssm_k[untouched], before[untouched])
    assert not torch.allclose(ssm_k[slots], before[slots])  # the states did move


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_padded_rows_share_the_scratch_slot(device: str) -> None:
    """Three padded rows of a captured batch all on slot 0: the real rows' outputs and states are the PyTorch
    path's whatever the padded rows do to the scratch slot."""
    mixer = _mixer(2, torch.float32, device)
    slots = torch.tensor([3, 0, 6, 0, 0], device=device)
    conv_t, ssm_t = _states(mixer, device, seed=1)
    conv_k, ssm_k = conv_t.clone(), ssm_t.clone()
    xbc, dt = _inputs(mixer, 5, device, seed=2)
    with torch.no_grad():
        want = decode_step_torch(mixer, xbc, dt, slots, conv_t, ssm_t)
        got = _kernel(mixer, xbc, dt, slots, conv_k, ssm_k)
    real = [0, 2]
    _close(got[real], want[real], 2e-5, "y")
    assert torch.equal(conv_k[1:], conv_t[1:])
    _close(ssm_k[1:], ssm_t[1:], 2e-5, "ssm state")
    assert torch.isfinite(got).all() and torch.isfinite(ssm_k[0]).all()


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_decode_step_dispatches_on_the_switch(device: str) -> None:
    """``mamba.decode_kernel=triton`` runs the kernels through :func:`decode_step` (so the CPU under the interpreter
    takes them), ``torch`` the PyTorch ops; both give the same step."""
    outs = []
    for choice in ("triton", "torch"):
        mixer = _mixer(1, torch.float32, device, decode_kernel=choice)
        conv, ssm = _states(mixer, device, seed=3)
        xbc, dt = _inputs(mixer, 2, device, seed=4)
        assert uses_decode_kernel(mixer, xbc, ssm) == (choice == "triton")
        with torch.no_grad():
            outs.append((decode_step(mixer, xbc, dt, torch.tensor([2, 5], device=device), conv, ssm), conv, ssm))
    for got, want in zip(outs[0], outs[1]):
        _close(got, want, 2e-5, "y or state")


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("state", [torch.bfloat16, torch.float16], ids=["bf16-state", "fp16-state"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_16_bit_state_steps_like_the_pytorch_path(device: str, state: torch.dtype, dtype: torch.dtype) -> None:
    """``EngineConfig.mamba_ssm_dtype``: the state read and stored in 16 bits, the step's math in float32 on both
    paths; ``y`` from the unrounded state. Within a 16-bit rounding of each other (the interpreter rounds toward
    zero, the GPU and PyTorch to nearest)."""
    mixer = _mixer(2, dtype, device)
    slots = torch.tensor([7, 0, 2], device=device)
    conv_t, ssm32 = _states(mixer, device, seed=5)
    ssm_t = ssm32.to(state)
    conv_k, ssm_k = conv_t.clone(), ssm_t.clone()
    with torch.no_grad():
        for step in range(2):
            xbc, dt = _inputs(mixer, 3, device, seed=40 + step)
            want = decode_step_torch(mixer, xbc, dt, slots, conv_t, ssm_t)
            got = _kernel(mixer, xbc, dt, slots, conv_k, ssm_k)
            assert ssm_k.dtype == ssm_t.dtype == state
            _close(got, want, TOL[torch.bfloat16][0], f"y, step {step}")
            assert torch.equal(conv_k, conv_t), f"conv state, step {step}"
            _close(ssm_k, ssm_t, 1e-2, f"ssm state, step {step}")
    assert uses_decode_kernel(_mixer(2, dtype, "cpu", decode_kernel="triton"), xbc.cpu(), ssm_t.cpu())


def test_the_switch_and_its_limits() -> None:
    """``auto`` takes the kernels only on CUDA; no choice takes them for a float64 model (its states are float64)."""
    for choice, device_kernel in (("auto", False), ("triton", True), ("torch", False)):
        mixer = _mixer(1, torch.float32, "cpu", decode_kernel=choice)
        _, ssm = _states(mixer, "cpu", seed=0)
        xbc, _ = _inputs(mixer, 1, "cpu", seed=0)
        assert uses_decode_kernel(mixer, xbc, ssm) == device_kernel
        assert not uses_decode_kernel(mixer.double(), xbc.double(), ssm.double())
    assert MambaConfig(decode_kernel="cuda").problems(32) == [  # type: ignore[arg-type]
        "mamba.decode_kernel='cuda' is not one of auto, torch, triton"
    ]


def test_rows_per_program_fill_the_gpu() -> None:
    """mamba2-1.3b (64 heads of 64 rows): 8 rows per program at batch 1 (512 programs), 16 from batch 2 on; a head
    narrower than 16 rows is never blocked wider than its power of two, and never finer than 4 rows."""
    assert ssm_rows_per_program(1, 64, 64) == 8
    assert ssm_rows_per_program(2, 64, 64) == 16 and ssm_rows_per_program(64, 64, 64) == 16
    assert ssm_rows_per_program(64, 8, 8) == 8 and ssm_rows_per_program(1, 8, 6) == 4


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_bad_shapes_are_refused(device: str) -> None:
    mixer = _mixer(2, torch.float32, device)
    conv, ssm = _states(mixer, device, seed=0)
    xbc, dt = _inputs(mixer, 2, device, seed=0)
    with pytest.raises(ValueError, match="xbc"):
        _kernel(mixer, xbc[:, 1:], dt, torch.tensor([1, 2], device=device), conv, ssm)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16 ssm_state; got .* and torch.float64"):
        _kernel(mixer, xbc, dt, torch.tensor([1, 2], device=device), conv, ssm.double())
