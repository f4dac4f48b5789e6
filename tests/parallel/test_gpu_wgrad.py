"""Gradient-accumulation fusion on a GPU: the weight-gradient GEMM accumulates bf16 products into float32 main_grad
in place (``aten::addmm.dtype_out``); run through the device tool, skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from mcore_parallel.tensor.mappings import weight_grad

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_weight_gradient_accumulates_in_place(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w = torch.zeros(384, 256, device="cuda", dtype=dtype)
    w.main_grad = torch.randn(384, 256, device="cuda")  # type: ignore[attr-defined]
    start = w.main_grad.clone()  # type: ignore[attr-defined]
    ptr = w.main_grad.data_ptr()  # type: ignore[attr-defined]
    g2 = torch.randn(1000, 384, device="cuda", dtype=dtype)
    x2 = torch.randn(1000, 256, device="cuda", dtype=dtype)
    placeholder = weight_grad(w, g2, x2, True)
    assert placeholder.shape == w.shape and w.grad_added_to_main_grad  # type: ignore[attr-defined]
    assert w.main_grad.data_ptr() == ptr  # type: ignore[attr-defined]
    want = start + g2.float().t() @ x2.float()
    torch.testing.assert_close(w.main_grad, want, rtol=1e-3, atol=1e-2)  # type: ignore[attr-defined]
