"""Triton kernels for the Mamba-2 mixer's causal depthwise convolution with its SiLU, forward and backward.

Over ``x`` ``[b, s, C]`` (any strides with the channels contiguous: the mixer passes a view of the in-projection's
output), weights ``w`` ``[C, K]`` and an optional bias ``[C]``::

    pre[t, c] = bias[c] + sum_k w[c, k] x[t - (K - 1) + k, c]      (x before position 0 is 0)
    y[t, c]   = silu(pre[t, c])

The forward reads the ``K`` shifted input tiles (the overlap comes from the cache) and writes ``y``, one program per
(block of positions, block of channels, sequence); nothing is kept for the backward but the inputs. The backward is
two kernels: the first recomputes ``pre`` and writes ``dpre = dy · silu'(pre)`` (in ``x``'s dtype, as the unfused
ops round it), each program walking several consecutive position blocks and summing ``dw[c, k] = sum_t dpre[t]
x[t - (K - 1) + k]`` and ``dbias[c] = sum_t dpre[t]`` in float32 register accumulators; it writes one row set of
partial sums per program to a buffer summed afterwards (so the result does not depend on the order programs run in).
The second is the forward's kernel run anticausally, ``dx[t] = sum_k w[K - 1 - k] dpre[t + k]``.
(One kernel recomputing ``pre`` at the ``K - 1`` positions after its block instead of storing ``dpre`` read the input
tiles ``K`` times over and measured 2.5x slower on an H200; one computing ``dpre`` once for its block and the
``K - 1`` positions after it, kept in registers and shifted by each tap with ``tl.gather``, measured 1.42x slower
on an H100, ``bench/results/ssm/h100-conv-backward.json``.) The sums are float32; ``y`` and ``dx`` come back in
``x``'s dtype, ``dw`` and ``dbias`` in the weights'.

The forward and backward are ``torch.library`` custom ops (opaque to ``torch.compile``) under a
``torch.autograd.Function``; they run on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``).
The PyTorch path is ``F.conv1d`` followed by ``F.silu`` (``mcore_models.ssm.mixer.CausalConv1d``). The kernels
themselves are in :mod:`mcore_models.ssm._conv_kernels`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from mcore_models.ssm._launch import channels_contiguous, check_devices, load_kernels

__all__ = ["causal_conv1d_silu_triton"]

TILES: dict[str, tuple[int, ...]] = {
    "fwd": (16, 256, 4),
    "dpre": (8, 64, 4, 16),
    "dx": (64, 128, 4),
}
"""Each kernel's tile: (positions, channels, warps) per program of the forward and of the backward's anticausal
``dx``; (positions per step, channels, warps, steps) of the backward's ``dpre``, whose program walks ``steps``
consecutive blocks of positions (its partial sums: one row set per ``positions x steps``). The forward's and ``dx``'s
are the fastest of a sweep on one H200 (mamba2-1.3b's 4352 channels of the in-projection's 8512, batch 2 x 4096,
bf16; the forward 64 us); at (64, 128) and 4 warps an SM holds two ``dx`` programs (192 registers a thread,
``bench/kernel_registers.py``). ``dpre``'s: (8, 64) positions x channels a step keeps its five float32
accumulators small (56 registers a thread, nine programs an SM; 226 at (16, 128)); on one H100 at batch 8 x 4096
the conv's forward + backward took 2.229 ms with it and 2.225 ms at the sweep's fastest, (16, 64, 4, 16), against
2.8-8.6 ms with one block a program (``bench/results/ssm/h100-conv-tune-dpre.json``).
``bench/mamba_conv_bench.py --tune`` times each kernel's entry in turn."""


@functools.cache
def _kernels() -> dict[str, Any]:
    return load_kernels("_conv_kernels", "conv_kernel")


def _grid(x: torch.Tensor, tile: tuple[int, int]) -> tuple[int, int, int]:
    b, s, c = x.shape
    return -(-s // tile[0]), -(-c // tile[1]), b


@torch.library.custom_op("mcore_models::causal_conv1d_silu_fwd", mutates_args=())
def _conv_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    x, w = channels_contiguous(x), weight.reshape(weight.shape[0], -1).contiguous()
    b, s, c = x.shape
    y = torch.empty(b, s, c, dtype=x.dtype, device=x.device)
    bias_arg = bias.contiguous() if bias is not None else w
    bs, bc, warps = TILES["fwd"]
    _kernels()["conv"][_grid(x, (bs, bc))](x, w, bias_arg, y, s, c, x.stride(0), x.stride(1), K=w.shape[1],
                                           HAS_BIAS=bias is not None, ANTICAUSAL=False, BS=bs, BC=bc,
                                           num_warps=warps)  # fmt: skip
    return y


@_conv_fwd.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("mcore_models::causal_conv1d_silu_bwd", mutates_args=())
def _conv_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dx, dw, dbias)``: ``dw`` shaped as ``weight``, ``dbias`` float32 ``[C]`` (computed, and unused, without a
    bias)."""
    x, dy = channels_contiguous(x), channels_contiguous(dy)
    w = weight.reshape(weight.shape[0], -1).contiguous()
    b, s, c = x.shape
    k = w.shape[1]
    bias_arg = bias.contiguous() if bias is not None else w
    kernels = _kernels()
    dx = torch.empty(b, s, c, dtype=x.dtype, device=x.device)
    bs, bc, warps, blocks = TILES["dpre"]
    grid = _grid(x, (bs * blocks, bc))  # a program per blocks x bs positions
    g = torch.empty(b, s, c, dtype=x.dtype, device=x.device)  # dpre, in x's dtype (as the unfused ops round it)
    part = torch.empty(b * grid[0], k + 1, c, dtype=torch.float32, device=x.device)
    kernels["dpre"][grid](x, w, bias_arg, dy, g, part, s, c, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
                          K=k, HAS_BIAS=bias is not None, BS=bs, BC=bc, BLOCKS=blocks, num_warps=warps)  # fmt: skip
    bs, bc, warps = TILES["dx"]
    kernels["conv"][_grid(g, (bs, bc))](g, w, w, dx, s, c, g.stride(0), g.stride(1), K=k, HAS_BIAS=False,
                                        ANTICAUSAL=True, BS=bs, BC=bc, num_warps=warps)  # fmt: skip
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


def causal_conv1d_silu_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(causal depthwise conv1d(x))`` of ``x`` ``[b, s, C]`` with ``weight`` ``[C, 1, K]`` (or ``[C, K]``)
    and ``bias`` ``[C]``: ``[b, s, C]`` in ``x``'s dtype, contiguous; differentiable in all three."""
    if x.dim() != 3 or weight.shape[0] != x.shape[2] or weight.numel() % x.shape[2] or x.shape[1] == 0:
        raise ValueError(f"causal_conv1d_silu_triton: x [b, s, C] and weight [C, 1, K]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")  # fmt: skip
    check_devices("causal_conv1d_silu_triton", [t for t in (x, weight, bias) if t is not None])
    return _CausalConv.apply(x, weight, bias)
