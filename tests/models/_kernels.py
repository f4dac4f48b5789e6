"""Where the Triton kernels of the model package can run in tests: CUDA with Triton, or the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``, float32)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
KERNEL_DEVICES: list = []
if torch.cuda.is_available() and HAS_TRITON:
    KERNEL_DEVICES.append(pytest.param("cuda", marks=pytest.mark.gpu))
if os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON:
    KERNEL_DEVICES.append("cpu")
needs_kernel = pytest.mark.skipif(not KERNEL_DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 + Triton")


def tiny_mixer(device: str, **mamba: object) -> Any:
    """A one-layer ``Mamba2Mixer`` of width 32 (4 heads of 8, two groups of state 16, chunks of 8) with these
    ``MambaConfig`` fields, on ``device``."""
    from mcore_models import LayerSpec, MambaConfig, ModelContext, TransformerConfig
    from mcore_models.ssm import Mamba2Mixer
    from mcore_parallel import Group

    m = MambaConfig(d_state=16, head_dim=8, n_groups=2, chunk_size=8, **mamba)  # type: ignore[arg-type]
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, normalization="rmsnorm",
                               add_bias_linear=False, position_embedding="none", vocab_size=64, mamba=m,
                               hybrid_pattern="M")  # fmt: skip
    return Mamba2Mixer(config, ModelContext(Group.single("tp")), LayerSpec(), "decoder.layers.0.mixer").to(device)


def assert_mixers_agree(reference: Any, other: Any, x: torch.Tensor) -> None:
    """``other`` (given ``reference``'s parameters) computes ``reference``'s output and every parameter's gradient
    on ``x`` (a fixed weighting of the output as the loss)."""
    other.load_state_dict(reference.state_dict())
    outs = []
    for mx in (reference, other):
        y = mx(x)
        (y * torch.linspace(-1, 1, y.numel(), device=x.device).view_as(y)).sum().backward()
        outs.append((y.detach(), {n: p.grad for n, p in mx.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-6)
    for name, grad in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], grad, rtol=1e-5, atol=1e-6, msg=name)


def assert_relative_close(pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]], tol: float) -> None:
    """Each ``(name, got, want)``: the largest difference at most ``tol`` times the largest ``|want|`` (``got`` on
    any device and dtype, ``want`` the float64 reference on the CPU)."""
    for name, a, b in pairs:
        assert a is not None and b is not None, name
        a, b = a.detach().double().cpu(), b.detach()
        err = (a - b).abs().max().item() / (b.abs().max().item() + 1e-30)
        assert err <= tol, f"{name}: relative max error {err:.3g}"


def assert_compiled_grads_equal(f: Any, ins: list[torch.Tensor]) -> None:
    """``f`` (of ``ins``, to a scalar) compiled whole (``fullgraph``: the custom ops traced, no graph break) gives
    the eager gradients."""
    eager_grads = torch.autograd.grad(f(*ins), ins)
    torch._dynamo.reset()
    compiled_grads = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(*ins), ins)
    for a, b in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b)
