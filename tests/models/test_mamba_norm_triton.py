"""``gated_rms_norm_triton``: the Mamba-2 mixer's gated RMSNorm as Triton kernels, forward and every gradient,
against the PyTorch ``GatedRMSNorm`` in float64: both gate orders, one and several groups, a group size that is not
a power of two, strided inputs (``y`` transposed, ``z`` a view of a wider tensor), a token count that is not a
multiple of the backward's block, float32 and bf16; a mixer with ``mamba.norm_kernel=triton`` against ``torch``;
the custom ops under ``torch.compile`` and their fake outputs; which inputs take the kernel. The kernels run on
GPUs, or on the CPU under ``TRITON_INTERPRET=1``; without either those tests are skipped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_models import MambaConfig
from mcore_models.ssm import Mamba2Mixer, norm_triton
from mcore_models.ssm.norm_triton import gated_rms_norm_triton
from tests.models._kernels import (
    KERNEL_DEVICES,
    assert_compiled_grads_equal,
    assert_mixers_agree,
    assert_relative_close,
    needs_kernel,
    tiny_mixer,
)


def _reference(y: torch.Tensor, z: torch.Tensor, w: torch.Tensor, gs: int, eps: float, before: bool) -> torch.Tensor:
    """The gated norm written out in float64 (not through the mixer's module)."""
    gate = z * torch.sigmoid(z)
    h = y if before else y * gate
    g = h.unflatten(-1, (-1, gs))
    out = (g * torch.rsqrt(g.square().mean(-1, keepdim=True) + eps)).flatten(-2) * w
    return out * gate if before else out


def _inputs(s: int, b: int, d: int, seed: int) -> dict[str, torch.Tensor]:
    """float64 leaves: ``yt`` ``[b, s, d]`` (the norm gets its transpose), ``zw`` ``[s, b, d + 11]`` (the norm gets
    channels 3 .. 3 + d), ``w``, ``dout``."""
    g = torch.Generator().manual_seed(seed)
    return {"yt": torch.randn(b, s, d, generator=g, dtype=torch.float64),
            "zw": torch.randn(s, b, d + 11, generator=g, dtype=torch.float64) * 2,
            "w": 1 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64),
            "dout": torch.randn(s, b, d, generator=g, dtype=torch.float64)}  # fmt: skip


def _views(leaves: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = leaves["w"].shape[0]
    return leaves["yt"].transpose(0, 1), leaves["zw"][:, :, 3 : 3 + d], leaves["w"]


def _compare(t: dict[str, torch.Tensor], gs: int, before: bool, device: str, dtype: torch.dtype, tol: float) -> None:
    eps, names = 1e-5, ("yt", "zw", "w")
    ref = {k: t[k].clone().requires_grad_() for k in names}
    want = _reference(*_views(ref), gs, eps, before)
    want.backward(t["dout"])
    ins = {k: t[k].to(device, dtype if k != "w" else torch.float32).requires_grad_() for k in names}
    y, z, w = _views(ins)
    assert not z.is_contiguous()
    got = gated_rms_norm_triton(y, z, w, gs, eps, before)
    assert got.dtype == dtype and got.shape == y.shape and got.is_contiguous()
    got.backward(t["dout"].to(device, dtype))
    assert_relative_close([("out", got, want), *((f"d {n}", ins[n].grad, ref[n].grad) for n in names)], tol)


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("before", [False, True], ids=["gate-first", "norm-before-gate"])
@pytest.mark.parametrize("s,b,d,gs", [(7, 3, 48, 48), (5, 2, 40, 20), (3, 1, 24, 8)],
                         ids=["one-group", "two-groups-of-20", "three-groups-one-sequence"])  # fmt: skip
def test_kernels_equal_the_float64_norm(device: str, before: bool, s: int, b: int, d: int, gs: int,
                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setitem(norm_triton.TILES, "bwd", (4, 2))  # several token blocks, the last one partial
    _compare(_inputs(s, b, d, seed=s * 10 + d), gs, before, device, torch.float32, 2e-6)


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_bf16_inputs(device: str) -> None:
    _compare(_inputs(9, 2, 64, seed=4), 32, False, device, torch.bfloat16, 2e-2)


def _mixer(impl: str, device: str) -> Mamba2Mixer:
    mixer: Mamba2Mixer = tiny_mixer(device, norm_kernel=impl, scan="torch", conv_kernel="torch")
    return mixer


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_mixer_with_the_kernel_equals_the_torch_mixer(device: str) -> None:
    """``mamba.norm_kernel=triton`` against ``torch``: the same parameters, the mixer's output and every
    parameter's gradient."""
    reference, mixer = _mixer("torch", device), _mixer("triton", device)
    x = torch.randn(21, 2, 32, generator=torch.Generator().manual_seed(1)).to(device)
    assert not reference.norm.uses_kernel(x) and mixer.norm.uses_kernel(x)
    assert_mixers_agree(reference, mixer, x)


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_compiled_graph_keeps_the_ops(device: str) -> None:
    t = _inputs(6, 2, 16, seed=9)
    ins = [t[k].to(device, torch.float32).requires_grad_() for k in ("yt", "zw", "w")]

    def f(yt: torch.Tensor, zw: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm_triton(*_views({"yt": yt, "zw": zw, "w": w}), 8, 1e-5).square().sum()

    assert_compiled_grads_equal(f, ins)


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_fake_kernels_match_the_real_outputs(device: str) -> None:
    """``opcheck`` compares each op's fake outputs with its real ones, shapes and strides (inductor asserts the
    declared strides): ``dy`` keeps a transposed ``y``'s strides."""
    t = {k: v.to(device, torch.float32) for k, v in _inputs(6, 2, 16, seed=3).items()}
    (y, z, w), dout = _views(t), t["dout"]
    fwd, bwd = torch.ops.mcore_models.gated_rms_norm_fwd, torch.ops.mcore_models.gated_rms_norm_bwd
    tests = ["test_schema", "test_faketensor"]
    torch.library.opcheck(fwd, (y, z, w, 8, 1e-5, True), test_utils=tests)
    rstd = fwd(y, z, w, 8, 1e-5, True)[1]
    torch.library.opcheck(bwd, (dout, y, z, w, rstd, 8, True), test_utils=tests)
    dy = bwd(dout, y, z, w, rstd, 8, False)[0]
    assert dy.stride() == y.stride()


def test_which_inputs_take_the_kernel() -> None:
    norm = _mixer("auto", "cpu").norm
    assert not norm.uses_kernel(torch.zeros(1, 1, 1))  # auto: CUDA only
    norm.impl = "triton"
    assert norm.uses_kernel(torch.zeros(1, 1, 1))
    assert not norm.uses_kernel(torch.zeros(1, 1, 1, dtype=torch.float64)) and not norm.uses_kernel(torch.zeros(1, 1))
    norm.impl = "torch"
    assert not norm.uses_kernel(torch.zeros(1, 1, 1))
    assert MambaConfig().norm_kernel == "auto"
    assert any("mamba.norm_kernel='cuda'" in p for p in MambaConfig(norm_kernel="cuda").problems(64))  # type: ignore[arg-type]


def test_bad_inputs_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    y, z, w = _views(_inputs(4, 2, 8, seed=0))
    with pytest.raises(ValueError, match="needs its tensors on one CUDA device"):
        gated_rms_norm_triton(y, z, w, 4, 1e-5)
    with pytest.raises(ValueError, match="group_size dividing d"):
        gated_rms_norm_triton(y, z, w, 3, 1e-5)
    with pytest.raises(ValueError, match="weight \\[d\\]"):
        gated_rms_norm_triton(y, z, w[:4], 4, 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_realistic_shape_in_bf16_on_the_gpu() -> None:
    """mamba2-1.3b's gated norm (d_inner 4096, one group) on 1024 positions x batch 4, bf16, against float64; and
    the same against ``F.rms_norm`` in float32, as the PyTorch path computes it."""
    _compare(_inputs(1024, 4, 4096, seed=5), 4096, False, "cuda", torch.bfloat16, 2e-2)
    y, z, w = _views({k: v.to("cuda", torch.float32) for k, v in _inputs(64, 2, 4096, seed=6).items()})
    want = F.rms_norm(y * F.silu(z), (4096,), eps=1e-5) * w
    torch.testing.assert_close(gated_rms_norm_triton(y, z, w, 4096, 1e-5), want, rtol=1e-5, atol=1e-5)
