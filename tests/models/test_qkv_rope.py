"""``qkv_rope``: the QKV projection's split with RoPE, one kernel each way, against PyTorch's autograd of the
layer's own rotation (``apply_rotary``) in float64. The kernels run on GPUs, or on the CPU under
``TRITON_INTERPRET=1`` (float32); elsewhere the op computes with PyTorch ops, and the backward's hand-derived
transpose is checked against autograd the same way."""

from __future__ import annotations

import pytest
import torch

from mcore_models.transformer.qkv_rope import qkv_rope, qkv_rope_backward_reference, qkv_rope_reference
from mcore_models.transformer.rope import RotaryEmbedding, apply_rotary
from tests.models._kernels import KERNEL_DEVICES, needs_kernel


def _rotary(s: int, b: int, d: int, per_sample: bool, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(s)[:, None] + 7 * torch.arange(b)[None, :] if per_sample else torch.arange(s)
    cos, sin = RotaryEmbedding(d, 10000.0, None, "cpu")(pos, torch.float64)
    return cos.to(device), sin.to(device)


def _autograd_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, groups: int, d: int):
    """The split and rotation as the layer's PyTorch path computes them, differentiated by autograd."""
    s, b = qkv.shape[:2]
    x = qkv.view(s, b, groups, -1, d)
    pg = x.shape[3] - 2
    q = apply_rotary(x[:, :, :, :pg], cos[:, :, :, None], sin[:, :, :, None]).reshape(s, b, groups * pg, d)
    return q, apply_rotary(x[:, :, :, pg], cos, sin), x[:, :, :, pg + 1]


CASES = [  # s, b, groups, heads per group, head dim, per-sample positions
    (5, 3, 2, 4, 16, False),
    (9, 2, 3, 1, 8, True),  # multi-head attention (a key per query head), heads not a power of two
    (4, 1, 1, 6, 32, False),  # multi-query
    (17, 2, 4, 2, 64, True),
    (3, 2, 2, 4, 128, False),  # llama3-8b's head dim
]


@pytest.mark.parametrize("case", CASES)
def test_the_cpu_path_and_its_backward_equal_autograd_in_float64(case: tuple) -> None:
    s, b, g, pg, d, per_sample = case
    torch.manual_seed(s)
    qkv = torch.randn(s, b, g * (pg + 2) * d, dtype=torch.float64, requires_grad=True)
    cos, sin = _rotary(s, b, d, per_sample, "cpu")
    outs = qkv_rope(qkv, cos, sin, g, d)
    ref_qkv = qkv.detach().clone().requires_grad_(True)
    refs = _autograd_reference(ref_qkv, cos, sin, g, d)
    grads = [torch.randn_like(r) for r in refs]
    for o, r in zip(outs, refs, strict=True):
        assert o.shape == r.shape and o.is_contiguous()
        torch.testing.assert_close(o, r, rtol=1e-12, atol=1e-12)
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(refs, grads)
    torch.testing.assert_close(qkv.grad, ref_qkv.grad, rtol=1e-12, atol=1e-12)


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_kernels_equal_float64_autograd(device: str, case: tuple) -> None:
    s, b, g, pg, d, per_sample = case
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(s + d)
    qkv64 = torch.randn(s, b, g * (pg + 2) * d, dtype=torch.float64)
    cos64, sin64 = _rotary(s, b, d, per_sample, "cpu")
    qkv = qkv64.to(device, dtype).requires_grad_(True)
    cos, sin = cos64.to(device, dtype), sin64.to(device, dtype)
    outs = qkv_rope(qkv, cos, sin, g, d)
    ref_in = qkv.detach().double().cpu().requires_grad_(True)
    refs = _autograd_reference(ref_in, cos.double().cpu(), sin.double().cpu(), g, d)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for o, r in zip(outs, refs, strict=True):
        torch.testing.assert_close(o.double().cpu(), r, rtol=tol, atol=tol)
    # gradients in the strides an attention kernel hands back ([b, n, s, d] memory seen as [s, b, n, d])
    grads64 = [torch.randn_like(r) for r in refs]
    grads = [gr.permute(1, 2, 0, 3).contiguous().permute(2, 0, 1, 3).to(device, dtype) for gr in grads64]
    assert not grads[0].is_contiguous() or b == 1
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(refs, [gr.double().cpu() for gr in grads])
    torch.testing.assert_close(qkv.grad.double().cpu(), ref_in.grad, rtol=tol, atol=tol)


@needs_kernel
@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_kernels_equal_the_reference_functions(device: str) -> None:
    """The op's two directions against the PyTorch reference functions the CPU path runs (float32, same math)."""
    s, b, g, pg, d = 6, 2, 2, 3, 32
    qkv = torch.randn(s, b, g * (pg + 2) * d, device=device)
    cos, sin = (t.float() for t in _rotary(s, b, d, True, device))
    for got, want in zip(qkv_rope(qkv, cos, sin, g, d), qkv_rope_reference(qkv, cos, sin, g, d), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    dq, dk, dv = (
        torch.randn(s, b, g * pg, d, device=device),
        torch.randn(s, b, g, d, device=device),
        torch.randn(s, b, g, d, device=device),
    )
    got = torch.ops.mcore_models.qkv_rope_backward(dq, dk, dv, cos, sin)
    torch.testing.assert_close(got, qkv_rope_backward_reference(dq, dk, dv, cos, sin), rtol=1e-6, atol=1e-6)


def test_partial_rotation_is_refused() -> None:
    qkv = torch.randn(2, 1, 3 * 16)
    cos, sin = _rotary(2, 1, 8, False, "cpu")
    with pytest.raises(ValueError, match="rotates whole heads: cos has 8 dims for head_dim 16"):
        qkv_rope(qkv, cos, sin, 1, 16)


def test_model_with_the_kernel_trains_like_pytorch_rotation() -> None:
    """The layer's training path through the op (default) against its PyTorch rotation, float64: loss and every
    gradient; both GQA and multi-head layouts."""
    from mcore_models import GPTModel
    from tests._model_configs import llama

    assert llama().rope_kernel == "triton"  # the default
    for groups in (2, 4):
        torch.manual_seed(groups)
        a = GPTModel(llama(rope_kernel="torch", num_query_groups=groups)).double().train()
        b = GPTModel(llama(rope_kernel="triton", num_query_groups=groups)).double().train()
        b.load_state_dict(a.state_dict())
        tokens = torch.randint(0, 100, (2, 10))
        losses = [m(tokens, labels=tokens).mean() for m in (a, b)]
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-12, atol=1e-12)
        for loss in losses:
            loss.backward()
        for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
            torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-9, atol=1e-9, msg=name)


def test_compiled_layers_call_the_op_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    from mcore_models import GPTModel
    from mcore_models.transformer import qkv_rope as qr
    from tests._model_configs import llama

    calls: list[str] = []
    fwd, bwd = qr.qkv_rope_reference, qr.qkv_rope_backward_reference
    monkeypatch.setattr(qr, "qkv_rope_reference", lambda *a: calls.append("fwd") or fwd(*a))
    monkeypatch.setattr(qr, "qkv_rope_backward_reference", lambda *a: calls.append("bwd") or bwd(*a))
    monkeypatch.setattr(qr, "_interpreting", lambda: False)  # the PyTorch path on the CPU, also under the interpreter
    torch._dynamo.reset()
    torch.manual_seed(3)
    a = GPTModel(llama(params_dtype="float32", rope_kernel="torch")).train()
    b = GPTModel(llama(params_dtype="float32")).train()
    b.load_state_dict(a.state_dict())
    b.compile_layers()
    tokens = torch.randint(0, 100, (2, 10))
    for m in (a, b):
        m(tokens, labels=tokens).mean().backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert calls.count("fwd") == 2 and calls.count("bwd") == 2  # two layers, from inside the compiled layers


def test_unknown_choice_is_refused() -> None:
    from tests._model_configs import llama

    with pytest.raises(ValueError, match="rope_kernel='cuda' is not one of torch, triton"):
        llama(rope_kernel="cuda")
