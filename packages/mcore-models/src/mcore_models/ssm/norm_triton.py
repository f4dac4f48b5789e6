"""Triton kernels for the Mamba-2 mixer's gated RMSNorm, forward and backward.

Over ``y`` and ``z`` ``[s, b, d]`` (any strides with the channels contiguous: the mixer passes the scan's output
transposed and a view of the in-projection's output) and ``weight`` ``[d]``, per token and per group of ``group_size``
channels, computed in float32::

    gate = silu(z)
    h    = y * gate                          (norm_before_gate: h = y)
    out  = h * rstd * weight                 (norm_before_gate: out = h * rstd * weight * gate)
    rstd = 1 / sqrt(mean(h²) + eps)

The forward is one program per (token, group): it reads ``y`` and ``z`` once and writes ``out`` (``[s, b, d]``
contiguous, ``y``'s dtype) and ``rstd`` (float32, one per token and group, kept for the backward). The backward is
one program per (block of tokens, group): from ``dout``, ``y``, ``z`` and ``rstd`` it writes ``dy`` (``y``'s
strides), ``dz`` (contiguous) and the block's partial ``dweight`` (float32, summed afterwards, so the result does not
depend on the order programs run in), reading each input once. The PyTorch path
(:class:`~mcore_models.ssm.mixer.GatedRMSNorm` without the kernel) is the same math in float32 through
``F.rms_norm``; under ``torch.compile`` its backward becomes several passes over the three inputs.

The forward and backward are ``torch.library`` custom ops (opaque to ``torch.compile``) under a
``torch.autograd.Function``; they run on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``).
The kernels themselves are in :mod:`mcore_models.ssm._norm_kernels`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from mcore_models.ssm._launch import channels_contiguous, check_devices, load_kernels

__all__ = ["gated_rms_norm_triton"]

TILES: dict[str, tuple[int, ...]] = {"fwd": (8,), "bwd": (16, 8)}
"""``fwd``: (warps,); ``bwd``: (tokens per program, warps). On one H100 (``bench/mamba_norm_bench.py --tune``,
mamba2-1.3b's norm at batch 4 x 4096) every entry swept timed within 3% of these but a 64-token, 8-warp backward
(15% slower); ``bench/results/ssm/h100-norm.json``."""


@functools.cache
def _kernels() -> dict[str, Any]:
    return load_kernels("_norm_kernels", "norm_kernel")


def _block(group_size: int) -> int:
    return 1 << (group_size - 1).bit_length()


@torch.library.custom_op("mcore_models::gated_rms_norm_fwd", mutates_args=())
def _norm_fwd(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float,
              gate_first: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    s, b, d = y.shape
    out = torch.empty(s, b, d, dtype=y.dtype, device=y.device)
    rstd = torch.empty(s * b, d // group_size, dtype=torch.float32, device=y.device)
    (warps,) = TILES["fwd"]
    _kernels()["fwd"][(s * b, d // group_size)](y, z, weight, out, rstd, b, y.stride(0), y.stride(1), z.stride(0),
                                                z.stride(1), d, group_size, eps, GATE_FIRST=gate_first,
                                                BLOCK=_block(group_size), num_warps=warps)  # fmt: skip
    return out, rstd


@_norm_fwd.register_fake
def _(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float,
      gate_first: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    s, b, d = y.shape
    return y.new_empty(s, b, d), y.new_empty(s * b, d // group_size, dtype=torch.float32)


@torch.library.custom_op("mcore_models::gated_rms_norm_bwd", mutates_args=())
def _norm_bwd(dout: torch.Tensor, y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
              group_size: int, gate_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dy, dz, dweight)``: ``dy`` with ``y``'s strides (``empty_like``), ``dz`` contiguous, ``dweight`` in the
    weight's dtype."""
    s, b, d = y.shape
    rows, warps = TILES["bwd"]
    blocks = -(-(s * b) // rows)
    dy = torch.empty_like(y)
    dz = torch.empty(s, b, d, dtype=z.dtype, device=z.device)
    part = torch.empty(blocks, d, dtype=torch.float32, device=y.device)
    _kernels()["bwd"][(blocks, d // group_size)](dout, y, z, weight, rstd, dy, dz, part, s * b, b, dout.stride(0),
                                                 dout.stride(1), y.stride(0), y.stride(1), z.stride(0), z.stride(1),
                                                 dy.stride(0), dy.stride(1), d, group_size, GATE_FIRST=gate_first,
                                                 ROWS=rows, BLOCK=_block(group_size), num_warps=warps)  # fmt: skip
    return dy, dz, part.sum(0).to(weight.dtype)


@_norm_bwd.register_fake
def _(dout: torch.Tensor, y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
      group_size: int, gate_first: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return torch.empty_like(y), z.new_empty(z.shape), weight.new_empty(weight.shape)


class _GatedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float,
                gate_first: bool) -> torch.Tensor:  # fmt: skip
        out, rstd = _norm_fwd(y, z, weight, group_size, eps, gate_first)
        ctx.save_for_backward(y, z, weight, rstd)
        ctx.group_size, ctx.gate_first = group_size, gate_first
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y, z, weight, rstd = ctx.saved_tensors
        dy, dz, dw = _norm_bwd(channels_contiguous(dout), y, z, weight, rstd, ctx.group_size, ctx.gate_first)
        return dy, dz, dw, None, None, None


def gated_rms_norm_triton(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float,
                          norm_before_gate: bool = False) -> torch.Tensor:  # fmt: skip
    """The gated RMSNorm of ``y`` by ``z`` (both ``[s, b, d]``) with ``weight`` ``[d]`` over groups of
    ``group_size`` channels (see the module docstring): ``[s, b, d]`` in ``y``'s dtype, contiguous; differentiable
    in all three."""
    if y.dim() != 3 or z.shape != y.shape or weight.shape != y.shape[-1:] or group_size < 1 or y.shape[-1] % group_size:
        raise ValueError(f"gated_rms_norm_triton: y and z [s, b, d], weight [d], group_size dividing d; got "
                         f"{tuple(y.shape)}, {tuple(z.shape)}, {tuple(weight.shape)}, {group_size}")  # fmt: skip
    check_devices("gated_rms_norm_triton", [y, z, weight])
    y, z = channels_contiguous(y), channels_contiguous(z)
    out: torch.Tensor = _GatedNorm.apply(y, z, weight, group_size, eps, not norm_before_gate)
    return out
