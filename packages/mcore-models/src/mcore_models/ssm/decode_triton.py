"""Triton kernels for one decode step of a Mamba-2 mixer over a batch of requests (the serving engine's decode path).

Each of ``R`` requests brings one token: the in-projection's ``[x, B, C]`` channels (before the convolution) and its
raw ``dt`` per head. Per request, at its state slot, the step is (Dao & Gu 2024's recurrence, one position)::

    window  = [conv_state, xBC]                         conv_state [C, K - 1] (the last K - 1 inputs), K = d_conv
    xBC'    = silu(sum_k window[:, k] w[:, k] + bias)   the causal depthwise conv at the new position
    dt      = clamp(softplus(dt_raw + dt_bias), dt_limit)
    state   = exp(dt A) state + dt x ⊗ B                 state [H, P, N], A = -exp(A_log); heads of a group share B, C
    y       = state C + D x

and the conv state becomes the window's last ``K - 1`` columns. Two kernels:

- ``conv_step``, one program per (request, block of channels): reads the conv state and the new input, writes the
  shifted window back in place and the activated ``xBC'`` (in the input's dtype) to a small ``[R, C]`` buffer. It is
  its own kernel because every head of a group reads the group's ``B`` and ``C`` channels: a program that both reads
  and shifts them could race with the other heads' programs;
- ``ssm_step``, one program per (request, head, block of ``P`` rows): the state block ``[BP, N]`` is read once and
  written once (float32, or bf16/fp16 to halve it: the math stays float32, the state is rounded when stored) and
  ``y`` for its rows is reduced from the new (unrounded) state. The state traffic (``H P N`` elements read and written
  per request) is the step's cost, so the block of rows shrinks for small batches until there are
  enough programs to keep the memory system busy.

The rounding follows ``mcore_models.ssm.inference.decode_step``'s PyTorch ops: the conv sums in float32 from the
conv state's dtype, its output is rounded to the input's dtype before and after SiLU, ``dt``, the decay, the state
and ``y`` are float32, ``y`` comes back in the input's dtype. No host data is read and the buffers' shapes depend on
``R`` only, so the step is captured by CUDA graphs; padded rows of a graph (all on the scratch slot 0) race only on
the scratch slot. Tensor parallelism needs nothing: each rank passes its own heads, groups and channels.

They run on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

__all__ = ["decode_step_triton", "ssm_rows_per_program"]

_CONV_BLOCK = 128  # channels per program of the conv kernel
_WARPS = 4
SSM_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The SSM state dtypes the decode step reads and writes (the math is float32 for each)."""
_MIN_PROGRAMS = 512  # ssm_step programs wanted (about 4 per SM of an H200) before the row block stops shrinking


@functools.cache
def _kernels() -> dict[str, Any]:
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise ImportError(
            "mamba.decode_kernel=triton needs Triton (pip install mcore-models[gpu]; it comes with PyTorch's CUDA "
            "wheels); use mamba.decode_kernel=torch"
        ) from e

    @triton.jit  # type: ignore[misc]
    def conv_step(XBC, CS, W, BIAS, SLOTS, OUT, channels, xbc_row, slot_step, cs_slot, cs_chan, cs_tap, w_chan, w_tap,  # type: ignore[no-untyped-def]
                  K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        r = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < channels
        slot = tl.load(SLOTS + r * slot_step).to(tl.int64)
        new = tl.load(XBC + r.to(tl.int64) * xbc_row + c, mask=m, other=0.0).to(CS.dtype.element_ty)
        state = CS + slot * cs_slot + c.to(tl.int64) * cs_chan
        wrow = W + c.to(tl.int64) * w_chan
        h = tl.zeros([BLOCK], dtype=tl.float32)
        # taps in window order; each channel's loads and stores are one thread's, so the shift cannot race
        for j in tl.static_range(K - 1):
            v = tl.load(state + j * cs_tap, mask=m, other=0.0)
            h += v.to(tl.float32) * tl.load(wrow + j * w_tap, mask=m, other=0.0).to(tl.float32)
            if j > 0:
                tl.store(state + (j - 1) * cs_tap, v, mask=m)
        h += new.to(tl.float32) * tl.load(wrow + (K - 1) * w_tap, mask=m, other=0.0).to(tl.float32)
        if K > 1:
            tl.store(state + (K - 2) * cs_tap, new, mask=m)
        if HAS_BIAS:
            h += tl.load(BIAS + c, mask=m, other=0.0).to(tl.float32)
        h = h.to(OUT.dtype.element_ty).to(tl.float32)
        act = h / (1.0 + tl.exp(-h))
        tl.store(OUT + r.to(tl.int64) * channels + c, act.to(OUT.dtype.element_ty), mask=m)

    @triton.jit  # type: ignore[misc]
    def ssm_step(ACT, DT, DT_BIAS, A_LOG, D, SLOTS, SS, Y, dt_row, slot_step, lo, hi, ss_slot, ss_head, ss_row, ss_col,  # type: ignore[no-untyped-def]
                 H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr,
                 BN: tl.constexpr):  # fmt: skip
        r, h, pb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        g = h // (H // G)
        p = pb * BP + tl.arange(0, BP)
        n = tl.arange(0, BN)
        mp, mn = p < P, n < N
        row = ACT + r.to(tl.int64) * (H * P + 2 * G * N)  # [x | B | C] after the conv
        x = tl.load(row + h * P + p, mask=mp, other=0.0).to(tl.float32)
        b = tl.load(row + H * P + g * N + n, mask=mn, other=0.0).to(tl.float32)
        c = tl.load(row + H * P + G * N + g * N + n, mask=mn, other=0.0).to(tl.float32)
        z = tl.load(DT + r.to(tl.int64) * dt_row + h).to(tl.float32) + tl.load(DT_BIAS + h).to(tl.float32)
        # softplus as PyTorch's (z above 20 stays z): max(z, 0) + log1p(exp(-|z|)), log1p(u) = u log(w) / (w - 1)
        u = tl.exp(-tl.abs(z))
        w = 1.0 + u
        sp = tl.maximum(z, 0.0) + tl.where(w == 1.0, u, u * tl.log(w) / (w - 1.0))
        step = tl.minimum(tl.maximum(tl.where(z > 20.0, z, sp), lo), hi)
        decay = tl.exp(step * -tl.exp(tl.load(A_LOG + h).to(tl.float32)))
        slot = tl.load(SLOTS + r * slot_step).to(tl.int64)
        ptr = SS + slot * ss_slot + h * ss_head + p[:, None].to(tl.int64) * ss_row + n[None, :] * ss_col
        keep = mp[:, None] & mn[None, :]
        st = tl.load(ptr, mask=keep, other=0.0).to(tl.float32)
        st = decay * st + (step * x)[:, None] * b[None, :]
        tl.store(ptr, st.to(SS.dtype.element_ty), mask=keep)  # (a 16-bit state: rounded here, y from the float32)
        y = tl.sum(st * c[None, :], axis=1) + tl.load(D + h).to(tl.float32) * x
        tl.store(Y + r.to(tl.int64) * (H * P) + h * P + p, y.to(Y.dtype.element_ty), mask=mp)

    return {"conv_step": conv_step, "ssm_step": ssm_step, "next_power_of_2": triton.next_power_of_2}


def ssm_rows_per_program(requests: int, heads: int, head_dim: int) -> int:
    """Rows ``BP`` of a head's ``[P, N]`` state per ``ssm_step`` program: 16, halved (down to 4) while the
    ``requests x heads x ceil(P / BP)`` programs are fewer than ``_MIN_PROGRAMS``; never more than ``P`` rounded up to
    a power of two."""
    bp = min(16, 1 << max(head_dim - 1, 0).bit_length())
    while bp > 4 and requests * heads * -(-head_dim // bp) < _MIN_PROGRAMS:
        bp //= 2
    return bp


def _check(xbc: torch.Tensor, dt: torch.Tensor, slots: torch.Tensor, conv_state: torch.Tensor,
           ssm_state: torch.Tensor, heads: int, groups: int) -> None:  # fmt: skip
    R = xbc.shape[0]
    _, H, P, N = ssm_state.shape
    channels = H * P + 2 * groups * N
    if heads != H or H % groups or xbc.shape != (R, channels) or dt.shape != (R, H) or slots.shape != (R,):
        raise ValueError(
            f"decode_step_triton: xbc [R, H*P + 2GN], dt [R, H], slots [R] for ssm_state [slots, H, P, N] with "
            f"H % G == 0; got xbc {tuple(xbc.shape)}, dt {tuple(dt.shape)}, slots {tuple(slots.shape)}, ssm_state "
            f"{tuple(ssm_state.shape)}, heads {heads}, groups {groups}"
        )
    if conv_state.shape[:2] != (ssm_state.shape[0], channels) or ssm_state.dtype not in SSM_STATE_DTYPES:
        raise ValueError(f"decode_step_triton: conv_state [slots, {channels}, d_conv - 1] and a float32, bfloat16 or "
                         f"float16 ssm_state; got {tuple(conv_state.shape)} and {ssm_state.dtype}")  # fmt: skip
    on = xbc.device
    tensors = (dt, slots, conv_state, ssm_state)
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if any(t.device != on for t in tensors) or not (on.type == "cuda" or (on.type == "cpu" and interpreting)):
        raise ValueError("decode_step_triton needs all tensors on one CUDA device (or the CPU under "
                         "TRITON_INTERPRET=1); use mamba.decode_kernel=torch")  # fmt: skip


def decode_step_triton(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    slots: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    *,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
    groups: int,
) -> torch.Tensor:
    """One token of each of ``R`` requests: ``xbc`` ``[R, H P + 2 G N]`` (before the conv; rows may be strided, as
    views of the in-projection's output are), raw ``dt`` ``[R, H]``, their state ``slots`` ``[R]`` (any stride). Advances
    ``conv_state`` ``[slots, C, d_conv - 1]`` and ``ssm_state`` ``[slots, H, P, N]`` (float32, or 16-bit: the math in
    float32, the state rounded when stored) in place at the slots
    and returns ``y`` ``[R, H P]`` in ``xbc``'s dtype. ``conv_weight`` ``[C, 1, d_conv]``; ``A_log``, ``D``,
    ``dt_bias`` ``[H]``; ``groups`` of ``B`` and ``C``."""
    H, P, N = ssm_state.shape[1:]
    _check(xbc, dt, slots, conv_state, ssm_state, A_log.shape[0], groups)
    xbc = xbc if xbc.stride(-1) == 1 else xbc.contiguous()
    dt = dt if dt.stride(-1) == 1 else dt.contiguous()
    k = _kernels()
    R, channels = xbc.shape
    act = xbc.new_empty(R, channels)
    y = xbc.new_empty(R, H * P)
    if R == 0:
        return y
    K = conv_weight.shape[-1]
    bias = conv_bias if conv_bias is not None else conv_weight
    cs = conv_state.stride()
    k["conv_step"][(R, -(-channels // _CONV_BLOCK))](
        xbc, conv_state, conv_weight, bias, slots, act, channels, xbc.stride(0), slots.stride(0), cs[0], cs[1], cs[2],
        conv_weight.stride(0), conv_weight.stride(2), K=K, HAS_BIAS=conv_bias is not None, BLOCK=_CONV_BLOCK,
        num_warps=_WARPS,
    )  # fmt: skip
    bp = ssm_rows_per_program(R, H, P)
    ss = ssm_state.stride()
    k["ssm_step"][(R, H, -(-P // bp))](
        act, dt, dt_bias, A_log, D, slots, ssm_state, y, dt.stride(0), slots.stride(0), float(dt_limit[0]),
        float(dt_limit[1]),
        ss[0], ss[1], ss[2], ss[3], H=H, G=groups, P=P, N=N, BP=bp, BN=k["next_power_of_2"](N), num_warps=_WARPS,
    )  # fmt: skip
    return y
