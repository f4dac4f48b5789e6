"""The one-pass SwiGLU backward (``model.swiglu_backward=triton``) against autograd of ``silu(gate) * up``."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from mcore_models import GPTModel
from mcore_models.transformer import swiglu as sw
from tests._model_configs import llama


def _autograd(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    gate, up = x.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(grad)
    assert x.grad is not None
    return x.grad


def test_reference_backward_is_autograd() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 2 * 7, dtype=torch.float64) * 3
    grad = torch.randn(3, 5, 7, dtype=torch.float64)
    torch.testing.assert_close(sw.swiglu_backward_reference(x, grad), _autograd(x, grad), rtol=1e-6, atol=1e-6)
    # through the autograd function and the custom op (CPU: the same PyTorch math)
    y = x.detach().requires_grad_()
    sw.swiglu(y).backward(grad)
    torch.testing.assert_close(y.grad, _autograd(x, grad), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sw.swiglu(x), F.silu(x[..., :7]) * x[..., 7:])


@pytest.mark.parametrize("path", ["swiglu", "activation"])
def test_the_forward_rounds_once(path: str) -> None:
    """In 16 bits ``silu(gate) * up`` is computed in float32 and rounded once (as compiled layers and the FP8 SwiGLU
    kernels round it), not after ``silu`` too as eager bf16 ops would; float64 stays float64."""
    from mcore_models.transformer.mlp import activation_fn

    fn = sw.swiglu if path == "swiglu" else activation_fn("swiglu")
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    gate, up = x.chunk(2, dim=-1)
    once = (F.silu(gate.float()) * up.float()).to(torch.bfloat16)
    assert torch.equal(fn(x), once)
    assert not torch.equal(F.silu(gate) * up, once)  # the double rounding differs somewhere: the check can fail
    x64 = x.double()
    assert torch.equal(fn(x64), F.silu(x64[:, :256]) * x64[:, 256:])


def test_model_with_the_option_trains_like_the_autograd_backward() -> None:
    assert llama().swiglu_backward == "triton"  # the default
    torch.manual_seed(1)
    a = GPTModel(llama(swiglu_backward="torch")).double().train()
    b = GPTModel(llama(swiglu_backward="triton")).double().train()
    b.load_state_dict(a.state_dict())
    tokens = torch.randint(0, 100, (2, 10))
    for m in (a, b):
        m(tokens, labels=tokens).mean().backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-9, atol=1e-9, msg=name)


def test_compiled_layers_use_the_op(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    reference = sw.swiglu_backward_reference

    def counted(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape)
        return reference(x, grad)

    monkeypatch.setattr(sw, "swiglu_backward_reference", counted)
    torch._dynamo.reset()
    torch.manual_seed(2)
    a = GPTModel(llama(params_dtype="float32", swiglu_backward="torch")).train()
    b = GPTModel(llama(params_dtype="float32", swiglu_backward="triton")).train()
    b.load_state_dict(a.state_dict())
    b.compile_layers()
    tokens = torch.randint(0, 100, (2, 10))
    for m in (a, b):
        m(tokens, labels=tokens).mean().backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert len(calls) == 2  # one backward call per layer, from inside the compiled layers


def test_unknown_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="swiglu_backward='cuda' is not one of torch, triton"):
        llama(swiglu_backward="cuda")


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernel on CPU needs TRITON_INTERPRET=1 and triton"
)
def test_triton_kernel_in_the_interpreter() -> None:
    torch.manual_seed(3)
    x = torch.randn(5, 2 * 1500) * 3  # a second, partial column block
    grad = torch.randn(5, 1500)
    torch.testing.assert_close(sw._launch(x, grad), _autograd(x, grad), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_on_gpu(dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    x = (torch.randn(4, 257, 2 * 3000, device="cuda") * 3).to(dtype)
    grad = torch.randn(4, 257, 3000, device="cuda").to(dtype)
    got = sw.swiglu_backward(x, grad)
    want = sw.swiglu_backward_reference(x, grad)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
        ),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_swiglu_gives_the_eager_gradients(device: str, dtype: torch.dtype) -> None:
    """``swiglu`` inside ``torch.compile`` against eager (on CUDA with torch 2.11, a float32 forward through no-op
    dtype casts gave the input a zero gradient once compiled)."""
    torch.manual_seed(0)
    w1 = torch.randn(32, 128, device=device, dtype=dtype, requires_grad=True)
    w2 = torch.randn(64, 32, device=device, dtype=dtype)
    xin = torch.randn(16, 32, device=device, dtype=dtype)

    def f(xin: torch.Tensor) -> torch.Tensor:
        return (sw.swiglu(xin @ w1) @ w2).float().square().sum()

    grads = []
    for fn in (f, torch.compile(f)):
        w1.grad = None
        fn(xin).backward()
        assert w1.grad is not None
        grads.append(w1.grad.float())
    torch._dynamo.reset()
    assert grads[0].abs().max() > 0
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(grads[1], grads[0], rtol=tol, atol=tol * float(grads[0].abs().max()))
