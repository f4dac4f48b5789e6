"""SwiGLU, ``silu(gate) * up`` over the ``[gate; up]`` halves of the up-projection, with a one-pass backward.

Under ``torch.compile`` the backward of ``silu(gate) * up`` becomes a kernel that walks the concatenated
``[d_gate; d_up]`` output and reads the inputs once per half: on an H200 it moved its bytes at ~2 TB/s, the slowest
of the layer's fused kernels (41 ms of an 866 ms llama-1b step, ``docs/performance.md``). ``swiglu_backward`` walks
the ``[tokens, ffn]`` elements once, reading gate, up and the incoming gradient and writing both halves of the input
gradient (2.5 bytes moved per element pair instead of ~4). It is a ``torch.library`` custom op, so compiled layers
call it as one opaque kernel; the CUDA implementation is a Triton kernel, everything else uses PyTorch ops.

``TransformerConfig.swiglu_backward``: ``triton`` (the default: the one-pass kernel on CUDA, PyTorch ops elsewhere) or
``torch`` (PyTorch/inductor's own backward).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mcore_parallel.autograd import as_dtype

__all__ = ["silu_mul", "swiglu", "swiglu_backward", "swiglu_backward_reference"]

_KERNEL: Any = None


def swiglu_backward_reference(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The input gradient ``[d_gate; d_up]`` of ``silu(gate) * up`` (PyTorch ops, float32 math)."""
    gate, up = x.float().chunk(2, dim=-1)
    g = grad.float()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    d_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
    return torch.cat([d_gate, g * silu], dim=-1).to(x.dtype)


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is None:
        try:
            import triton
            import triton.language as tl
        except ImportError as e:
            raise ImportError(
                "model.swiglu_backward=triton needs Triton on CUDA (pip install mcore-models[gpu]; it comes with PyTorch's CUDA wheels); "
                "use swiglu_backward=torch"
            ) from e

        @triton.jit  # type: ignore[misc]
        def swiglu_bwd(X, G, DX, n_rows, ffn, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]  # fmt: skip
            row = tl.program_id(0)
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            mask = cols < ffn
            base_x = row.to(tl.int64) * (2 * ffn)
            gate = tl.load(X + base_x + cols, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(X + base_x + ffn + cols, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(G + row.to(tl.int64) * ffn + cols, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gate)
            d_gate = g * up * sig * (1.0 + gate * (1.0 - sig))
            d_up = g * gate * sig
            tl.store(DX + base_x + cols, d_gate.to(DX.dtype.element_ty), mask=mask)
            tl.store(DX + base_x + ffn + cols, d_up.to(DX.dtype.element_ty), mask=mask)

        _KERNEL = swiglu_bwd
    return _KERNEL


def _launch(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    ffn = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * ffn).contiguous()
    g2 = grad.reshape(-1, ffn).contiguous()
    out = torch.empty_like(x2)
    block = 1024
    grid = (x2.shape[0], (ffn + block - 1) // block)
    _kernel()[grid](x2, g2, out, x2.shape[0], ffn, BLOCK=block, num_warps=4)
    return out.view(x.shape)


_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@torch.library.custom_op("mcore_models::swiglu_backward", mutates_args=())
def swiglu_backward(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``[d_gate; d_up]`` of ``silu(gate) * up`` for ``x = [gate; up]`` (last dimension) and the output gradient."""
    if x.is_cuda and x.dtype in _KERNEL_DTYPES and grad.dtype == x.dtype:
        return _launch(x, grad)
    return swiglu_backward_reference(x, grad)  # the CPU, and float64 (checks against references)


@swiglu_backward.register_fake
def _(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)  # contiguous, as both implementations return it


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in float32 (or wider) math, rounded once to the inputs' dtype: what compiled layers compute
    (inductor keeps a fused kernel's intermediates in float32) and what the FP8 SwiGLU kernels round
    (``mcore_models.transformer.fp8_swiglu``); eager 16-bit ops would round ``silu(gate)`` first."""
    cdt = torch.promote_types(gate.dtype, torch.float32)
    return as_dtype(F.silu(gate.to(cdt)) * up.to(cdt), gate.dtype)  # never a no-op cast (mcore_parallel.autograd)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        ctx.save_for_backward(x)
        return silu_mul(gate, up)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return swiglu_backward(x, grad)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` with the one-pass backward (:func:`swiglu_backward`)."""
    return _SwiGLU.apply(x)
