"""Triton kernels for the Mamba-2 mixer's causal depthwise convolution with its SiLU, forward and backward.

Over ``x`` ``[b, s, C]`` (any strides with the channels contiguous: the mixer passes a view of the in-projection's
output), weights ``w`` ``[C, K]`` and an optional bias ``[C]``::

    pre[t, c] = bias[c] + sum_k w[c, k] x[t - (K - 1) + k, c]      (x before position 0 is 0)
    y[t, c]   = silu(pre[t, c])

One program per (block of positions, block of channels, sequence). The forward reads the ``K`` shifted input tiles
(the overlap comes from the cache) and writes ``y``; nothing is kept for the backward but the inputs. The backward
recomputes ``pre`` and ``dpre = dy · silu'(pre)`` at the block's positions and at the ``K - 1`` after them, which
gives ``dx[t] = sum_k w[k] dpre[t + (K - 1) - k]`` without a second pass; every program writes its partial sums of
``dw[c, k] = sum_t dpre[t] x[t - (K - 1) + k]`` and ``dbias[c] = sum_t dpre[t]`` (float32) to a buffer that is summed
afterwards, so the result does not depend on the order programs run in. The sums are float32; ``y`` and ``dx`` come
back in ``x``'s dtype, ``dw`` and ``dbias`` in the weights'.

The forward and backward are ``torch.library`` custom ops (opaque to ``torch.compile``) under a
``torch.autograd.Function``; they run on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``).
The PyTorch path is ``F.conv1d`` followed by ``F.silu`` (``mcore_models.ssm.mixer.CausalConv1d``).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

__all__ = ["causal_conv1d_silu_triton"]

# (positions, channels) per program and warps: tiles that compile for Hopper without register spills
# (python bench/kernel_registers.py: the forward at 72 registers a thread, the backward, which keeps K shifted
# pre-activations and their gradients, at 126; at 64 x 128 and 4 warps it spills 1.3 KB), not yet timed on a GPU
_FWD_TILE = (32, 128)
_BWD_TILE = (32, 64)
_WARPS = 8


@functools.cache
def _kernels() -> dict[str, Any]:
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise ImportError("mamba.conv_kernel=triton needs Triton (pip install mcore-models[gpu]); use torch") from e

    @triton.jit  # type: ignore[misc]
    def conv(X, W, BIAS, DY, OUT, PART, s, C, xs_b, xs_s, dys_b, dys_s, K: tl.constexpr,  # type: ignore[no-untyped-def]
             HAS_BIAS: tl.constexpr, BACKWARD: tl.constexpr, SHIFTS: tl.constexpr, BS: tl.constexpr,
             BC: tl.constexpr):  # fmt: skip
        # forward: OUT = y; backward: OUT = dx, PART = this program's partial dw (K rows) and dbias (one row)
        pt, pc, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        t = pt * BS + tl.arange(0, BS)
        c = pc * BC + tl.arange(0, BC)
        cm = c < C
        x0 = b.to(tl.int64) * xs_b
        acc = tl.zeros([BS, BC], dtype=tl.float32)  # y, or dx
        for j in tl.static_range(SHIFTS):  # backward (SHIFTS = K): dpre at t + j feeds dx[t] through tap K - 1 - j
            tj = t + j
            pre = tl.zeros([BS, BC], dtype=tl.float32)  # the convolution before SiLU at positions tj
            if HAS_BIAS:
                pre += tl.load(BIAS + c, mask=cm, other=0.0).to(tl.float32)[None, :]
            for k in tl.static_range(K):
                src = tj - (K - 1) + k
                xm = ((src >= 0) & (src < s))[:, None] & cm[None, :]
                xv = tl.load(X + x0 + src.to(tl.int64)[:, None] * xs_s + c[None, :], mask=xm, other=0.0)
                pre += tl.load(W + c * K + k, mask=cm, other=0.0).to(tl.float32)[None, :] * xv.to(tl.float32)
            sig = tl.sigmoid(pre)
            if BACKWARD:
                m = (tj < s)[:, None] & cm[None, :]
                dy = tl.load(DY + b.to(tl.int64) * dys_b + tj.to(tl.int64)[:, None] * dys_s + c[None, :], mask=m,
                             other=0.0)  # fmt: skip
                dpre = tl.where(m, dy.to(tl.float32) * sig * (1.0 + pre * (1.0 - sig)), 0.0)
                acc += tl.load(W + c * K + (K - 1 - j), mask=cm, other=0.0).to(tl.float32)[None, :] * dpre
                if j == 0:  # this block's own dpre: its partial dw and dbias
                    part = PART + ((b * tl.num_programs(0) + pt) * (K + 1)).to(tl.int64) * C + c
                    for k in tl.static_range(K):
                        src = t - (K - 1) + k
                        xm = ((src >= 0) & (src < s))[:, None] & cm[None, :]
                        xv = tl.load(X + x0 + src.to(tl.int64)[:, None] * xs_s + c[None, :], mask=xm, other=0.0)
                        tl.store(part + k * C, tl.sum(dpre * xv.to(tl.float32), axis=0), mask=cm)
                    tl.store(part + K * C, tl.sum(dpre, axis=0), mask=cm)
            else:
                acc = pre * sig
        o = (b.to(tl.int64) * s + t)[:, None] * C + c[None, :]
        tl.store(OUT + o, acc.to(OUT.dtype.element_ty), mask=(t < s)[:, None] & cm[None, :])

    return {"conv": conv}


def _grid(x: torch.Tensor, tile: tuple[int, int]) -> tuple[int, int, int]:
    b, s, c = x.shape
    return -(-s // tile[0]), -(-c // tile[1]), b


def _channels_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@torch.library.custom_op("mcore_models::causal_conv1d_silu_fwd", mutates_args=())
def _conv_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x, w = _channels_contiguous(x), weight.reshape(weight.shape[0], -1).contiguous()
    b, s, c = x.shape
    y = torch.empty(b, s, c, dtype=x.dtype, device=x.device)
    bias_arg = bias.contiguous() if bias is not None else w
    bs, bc = _FWD_TILE
    _kernels()["conv"][_grid(x, _FWD_TILE)](x, w, bias_arg, x, y, y, s, c, x.stride(0), x.stride(1), 0, 0,
                                            K=w.shape[1], HAS_BIAS=bias is not None, BACKWARD=False, SHIFTS=1, BS=bs,
                                            BC=bc, num_warps=_WARPS)  # fmt: skip
    return y


@_conv_fwd.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("mcore_models::causal_conv1d_silu_bwd", mutates_args=())
def _conv_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dx, dw, dbias)``: ``dw`` shaped as ``weight``, ``dbias`` float32 ``[C]`` (computed, and unused, without a
    bias)."""
    x, dy = _channels_contiguous(x), _channels_contiguous(dy)
    w = weight.reshape(weight.shape[0], -1).contiguous()
    b, s, c = x.shape
    k = w.shape[1]
    grid, (bs, bc) = _grid(x, _BWD_TILE), _BWD_TILE
    dx = torch.empty(b, s, c, dtype=x.dtype, device=x.device)
    part = torch.empty(b * grid[0], k + 1, c, dtype=torch.float32, device=x.device)
    bias_arg = bias.contiguous() if bias is not None else w
    _kernels()["conv"][grid](x, w, bias_arg, dy, dx, part, s, c, x.stride(0), x.stride(1), dy.stride(0),
                             dy.stride(1), K=k, HAS_BIAS=bias is not None, BACKWARD=True, SHIFTS=k, BS=bs,
                             BC=bc, num_warps=_WARPS)  # fmt: skip
    sums = part.sum(0)  # [K + 1, C]
    # a contiguous copy (a new tensor: outputs may not alias each other), the strides the fake kernel declares
    dw = sums[:k].t().contiguous().view(weight.shape).to(weight.dtype)
    return dx, dw, sums[k].clone()


@_conv_bwd.register_fake
def _(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return x.new_empty(x.shape), weight.new_empty(weight.shape), x.new_empty(x.shape[-1], dtype=torch.float32)


class _CausalConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight, bias)
        return _conv_fwd(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, bias = ctx.saved_tensors
        dx, dw, dbias = _conv_bwd(dy, x, weight, bias)
        return dx, dw, dbias.to(bias.dtype) if bias is not None else None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def causal_conv1d_silu_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(causal depthwise conv1d(x))`` of ``x`` ``[b, s, C]`` with ``weight`` ``[C, 1, K]`` (or ``[C, K]``)
    and ``bias`` ``[C]``: ``[b, s, C]`` in ``x``'s dtype, contiguous; differentiable in all three."""
    if x.dim() != 3 or weight.shape[0] != x.shape[2] or weight.numel() % x.shape[2] or x.shape[1] == 0:
        raise ValueError(f"causal_conv1d_silu_triton: x [b, s, C] and weight [C, 1, K]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")  # fmt: skip
    tensors = [t for t in (x, weight, bias) if t is not None]
    on = x.device
    if any(t.device != on for t in tensors) or not (on.type == "cuda" or (on.type == "cpu" and _interpreting())):
        raise ValueError("causal_conv1d_silu_triton needs its tensors on one CUDA device (or the CPU under "
                         f"TRITON_INTERPRET=1); got {sorted({str(t.device) for t in tensors})}")  # fmt: skip
    return _CausalConv.apply(x, weight, bias)
