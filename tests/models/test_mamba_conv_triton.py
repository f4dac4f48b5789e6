"""``causal_conv1d_silu_triton``: the Mamba-2 mixer's causal depthwise convolution with SiLU as Triton kernels,
forward and every gradient, against ``F.conv1d`` + ``F.silu`` in float64: with and without bias, 4 and 2 taps, a
strided view of the in-projection's output as input, sequences that are not a multiple of the position block and
several channel blocks, ``dpre`` programs of several position blocks, float32 and bf16; a mixer with
``mamba.conv_kernel=triton`` against ``torch``; the custom ops under ``torch.compile``; which inputs take the kernel.
The kernels run on GPUs, or on the CPU under ``TRITON_INTERPRET=1``; without either those tests are skipped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_models import MambaConfig
from mcore_models.ssm import Mamba2Mixer, conv_triton
from mcore_models.ssm.conv_triton import causal_conv1d_silu_triton
from tests.models._kernels import (
    KERNEL_DEVICES,
    assert_compiled_grads_equal,
    assert_mixers_agree,
    assert_relative_close,
    needs_kernel,
    tiny_mixer,
)


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    s = x.shape[1]
    h = F.conv1d(x.transpose(1, 2), w, b, padding=w.shape[-1] - 1, groups=w.shape[0])
    return F.silu(h[..., :s]).transpose(1, 2)


def _inputs(s: int, c: int, k: int, bias: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """float64: ``x`` a view of a wider ``[2, s, c + 13]`` tensor (channels contiguous, rows strided)."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(2, s, c + 13, generator=g, dtype=torch.float64)
    t = {"x": wide[:, :, 5 : 5 + c], "w": torch.randn(c, 1, k, generator=g, dtype=torch.float64) / k}
    if bias:
        t["b"] = torch.randn(c, generator=g, dtype=torch.float64)
    t["dy"] = torch.randn(2, s, c, generator=g, dtype=torch.float64)
    return t


def _compare(t: dict[str, torch.Tensor], device: str, dtype: torch.dtype, tol: float) -> None:
    ref = {k: v.clone().requires_grad_() for k, v in t.items() if k != "dy"}
    want = _reference(ref["x"], ref["w"], ref.get("b"))
    want.backward(t["dy"])
    ins = {k: v.to(device, dtype if k == "x" else torch.float32).requires_grad_() for k, v in t.items() if k != "dy"}
    x = ins["x"]
    got = causal_conv1d_silu_triton(x, ins["w"], ins.get("b"))
    assert got.dtype == dtype and got.shape == x.shape
    got.backward(t["dy"].to(device, dtype))
    assert_relative_close([("y", got, want), *((f"d {n}", ins[n].grad, ref[n].grad) for n in ins)], tol)


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("s,c,k,bias", [(37, 40, 4, True), (16, 24, 2, False), (3, 8, 4, True)],
                         ids=["s37-k4-bias", "s16-k2", "s3-shorter-than-the-kernel"])  # fmt: skip
def test_kernels_equal_conv1d_and_silu(device: str, s: int, c: int, k: int, bias: bool,
                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    # several position blocks (the last one partial) and several channel blocks, each kernel its own tile
    monkeypatch.setitem(conv_triton.TILES, "fwd", (16, 16, 4))
    monkeypatch.setitem(conv_triton.TILES, "dpre", (16, 32, 4, 1))
    monkeypatch.setitem(conv_triton.TILES, "dx", (32, 16, 2))
    _compare(_inputs(s, c, k, bias, seed=s), device, torch.float32, 2e-6)


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("s,k,bias,dpre_tile", [(38, 4, True, (4, 16, 2, 4)), (5, 4, True, (8, 16, 2, 4)),
                                                (7, 2, False, (4, 16, 1, 2))],
                         ids=["s38-last-program-two-of-four-blocks", "s5-shorter-than-a-block", "s7-k2"])  # fmt: skip
def test_dpre_walks_several_position_blocks(device: str, s: int, k: int, bias: bool, dpre_tile: tuple[int, ...],
                                            monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """``dpre``'s programs of several blocks of positions each (``BLOCKS``): a sequence that ends inside a program's
    second block of four (its last two blocks are past the end), one shorter than a single block, one of two blocks
    the second partial; two channel blocks (the last one partial), batch 2."""
    monkeypatch.setitem(conv_triton.TILES, "dpre", dpre_tile)
    _compare(_inputs(s, 24, k, bias, seed=s), device, torch.float32, 2e-6)


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_bf16_inputs(device: str) -> None:
    _compare(_inputs(40, 48, 4, True, seed=3), device, torch.bfloat16, 2e-2)


def _mixer(impl: str, device: str) -> Mamba2Mixer:
    mixer: Mamba2Mixer = tiny_mixer(device, conv_kernel=impl)
    return mixer


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_mixer_with_the_kernel_equals_the_torch_mixer(device: str) -> None:
    """``mamba.conv_kernel=triton`` against ``torch``: the same parameters, the mixer's output and every
    parameter's gradient (the scan is the PyTorch one in both, the kernel's input a view of the in-projection)."""
    reference, mixer = (tiny_mixer(device, conv_kernel=impl, scan="torch") for impl in ("torch", "triton"))
    assert not reference.conv1d.uses_kernel(torch.zeros(1, device=device))
    assert mixer.conv1d.uses_kernel(torch.zeros(1, device=device))
    assert_mixers_agree(reference, mixer, torch.randn(21, 2, 32, generator=torch.Generator().manual_seed(1)).to(device))


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_compiled_graph_keeps_the_ops(device: str) -> None:
    t = _inputs(12, 16, 4, True, seed=9)
    ins = [t[k].to(device, torch.float32).requires_grad_() for k in ("x", "w", "b")]

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return causal_conv1d_silu_triton(x, w, b).square().sum()

    assert_compiled_grads_equal(f, ins)


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_fake_kernels_match_the_real_outputs(device: str) -> None:
    """``opcheck`` compares each op's fake (meta) outputs with its real ones, shapes and strides: inductor asserts
    the declared strides, so a ``dw`` returned as a transposed view fails a compiled backward on the GPU."""
    t = _inputs(12, 16, 4, True, seed=3)
    x, w, b, dy = (t[k].to(device, torch.float32) for k in ("x", "w", "b", "dy"))
    fwd, bwd = torch.ops.mcore_models.causal_conv1d_silu_fwd, torch.ops.mcore_models.causal_conv1d_silu_bwd
    tests = ["test_schema", "test_faketensor"]
    torch.library.opcheck(fwd, (x, w, b), test_utils=tests)
    torch.library.opcheck(bwd, (dy, x, w, b), test_utils=tests)
    torch.library.opcheck(bwd, (dy, x, w, None), test_utils=tests)
    dw = bwd(dy, x, w, b)[1]
    assert dw.shape == w.shape and dw.stride() == w.stride()


def test_which_inputs_take_the_kernel() -> None:
    mixer = _mixer("auto", "cpu")
    conv = mixer.conv1d
    assert not conv.uses_kernel(torch.zeros(1))  # auto: CUDA only
    conv.impl = "triton"
    assert conv.uses_kernel(torch.zeros(1)) and not conv.uses_kernel(torch.zeros(1, dtype=torch.float64))
    conv.impl = "torch"
    assert not conv.uses_kernel(torch.zeros(1))
    assert MambaConfig().conv_kernel == "auto"
    assert any("mamba.conv_kernel='cuda'" in p for p in MambaConfig(conv_kernel="cuda").problems(64))  # type: ignore[arg-type]


def test_cpu_without_the_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    t = _inputs(4, 8, 4, True)
    with pytest.raises(ValueError, match="needs its tensors on one CUDA device"):
        causal_conv1d_silu_triton(t["x"], t["w"], t["b"])
    with pytest.raises(ValueError, match="x \\[b, s, C\\] and weight"):
        causal_conv1d_silu_triton(t["x"], t["w"][:4], t["b"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_realistic_shape_in_bf16_on_the_gpu() -> None:
    """mamba2-1.3b's conv (d_inner 4096 + 2 x 128 state channels, 4 taps) on 2 x 2048 positions, bf16, against the
    float64 reference."""
    _compare(_inputs(2048, 4352, 4, True, seed=5), "cuda", torch.bfloat16, 2e-2)
