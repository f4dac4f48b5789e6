"""The Triton kernels of :mod:`mcore_models.ssm.conv_triton` (the Mamba-2 mixer's causal depthwise convolution with
its SiLU, forward and backward), imported on first use. The algorithm and the launches are described there."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["KERNELS"]


@triton.jit  # type: ignore[misc]
def conv(X, W, BIAS, OUT, s, C, xs_b, xs_s, K: tl.constexpr, HAS_BIAS: tl.constexpr,  # type: ignore[no-untyped-def]
         ANTICAUSAL: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    # causal: OUT = silu(bias + sum_k w[k] X[t - (K - 1) + k]) (the forward's y); ANTICAUSAL: OUT =
    # sum_k w[K - 1 - k] X[t + k] with no bias or SiLU (the backward's dx from dpre)
    pt, pc, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = pt * BS + tl.arange(0, BS)
    c = pc * BC + tl.arange(0, BC)
    cm = c < C
    x0 = b.to(tl.int64) * xs_b
    acc = tl.zeros([BS, BC], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(BIAS + c, mask=cm, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(K):
        if ANTICAUSAL:
            src, tap = t + k, K - 1 - k
        else:
            src, tap = t - (K - 1) + k, k
        xm = ((src >= 0) & (src < s))[:, None] & cm[None, :]
        xv = tl.load(X + x0 + src.to(tl.int64)[:, None] * xs_s + c[None, :], mask=xm, other=0.0)
        acc += tl.load(W + c * K + tap, mask=cm, other=0.0).to(tl.float32)[None, :] * xv.to(tl.float32)
    if not ANTICAUSAL:
        acc = acc * tl.sigmoid(acc)
    o = (b.to(tl.int64) * s + t)[:, None] * C + c[None, :]
    tl.store(OUT + o, acc.to(OUT.dtype.element_ty), mask=(t < s)[:, None] & cm[None, :])


@triton.jit  # type: ignore[misc]
def _tap(X, x0, t, k, s, xs_s, c, cm, K: tl.constexpr):  # type: ignore[no-untyped-def]
    # the input tile of tap k at positions t (float32; 0 outside the sequence): X[t - (K - 1) + k]
    src = t - (K - 1) + k
    xm = ((src >= 0) & (src < s))[:, None] & cm[None, :]
    return tl.load(X + x0 + src.to(tl.int64)[:, None] * xs_s + c[None, :], mask=xm, other=0.0).to(tl.float32)


@triton.jit  # type: ignore[misc]
def dpre(X, W, BIAS, DY, DPRE, PART, s, C, xs_b, xs_s, dys_b, dys_s, K: tl.constexpr,  # type: ignore[no-untyped-def]
         HAS_BIAS: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr, BLOCKS: tl.constexpr):  # fmt: skip
    # BLOCKS consecutive blocks of BS positions in turn: DPRE = dy * silu'(pre) (pre recomputed), the K dw products
    # and dpre itself (dbias) summed in float32 [BS, BC] accumulators; PART = their sums over positions, once
    pt, pc, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c = pc * BC + tl.arange(0, BC)
    cm = c < C
    x0 = b.to(tl.int64) * xs_b
    bias = tl.zeros([BC], dtype=tl.float32)
    if HAS_BIAS:
        bias += tl.load(BIAS + c, mask=cm, other=0.0).to(tl.float32)
    acc = (tl.zeros([BS, BC], dtype=tl.float32),) * (K + 1)  # dw's K taps, then dbias
    first = pt * (BLOCKS * BS)
    for i in range(tl.minimum(BLOCKS, tl.cdiv(s - first, BS))):  # the blocks that start inside the sequence
        t = first + i * BS + tl.arange(0, BS)
        pre = tl.zeros([BS, BC], dtype=tl.float32) + bias[None, :]
        for k in tl.static_range(K):
            w = tl.load(W + c * K + k, mask=cm, other=0.0).to(tl.float32)
            pre += w[None, :] * _tap(X, x0, t, k, s, xs_s, c, cm, K)
        sig = tl.sigmoid(pre)
        m = (t < s)[:, None] & cm[None, :]
        dy = tl.load(DY + b.to(tl.int64) * dys_b + t.to(tl.int64)[:, None] * dys_s + c[None, :], mask=m, other=0.0)
        g = tl.where(m, dy.to(tl.float32) * sig * (1.0 + pre * (1.0 - sig)), 0.0)
        tl.store(DPRE + (b.to(tl.int64) * s + t)[:, None] * C + c[None, :], g.to(DPRE.dtype.element_ty), mask=m)
        for k in tl.static_range(K):  # the taps again (from the cache), rather than K tiles kept live
            acc = acc[:k] + (acc[k] + g * _tap(X, x0, t, k, s, xs_s, c, cm, K),) + acc[k + 1 :]
        acc = acc[:K] + (acc[K] + g,)
    part = PART + ((b * tl.num_programs(0) + pt) * (K + 1)).to(tl.int64) * C + c
    for k in tl.static_range(K + 1):
        tl.store(part + k * C, tl.sum(acc[k], axis=0), mask=cm)


KERNELS = {"conv": conv, "dpre": dpre}
