"""The Triton kernels of :mod:`mcore_models.ssm.conv_triton` (the Mamba-2 mixer's causal depthwise convolution with
its SiLU, forward and backward), at module level so that the kernels can call the shared helpers (Triton's
interpreter resolves a kernel's callees among its module's globals); imported on first use. The algorithm and the
launches are described there."""

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
def dpre_tile(X, W, BIAS, DY, x0, t, c, cm, s, xs_s, dy0, dys_s, K: tl.constexpr,  # type: ignore[no-untyped-def]
              HAS_BIAS: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    # dpre = dy * silu'(pre) at positions t (pre recomputed from the K shifted input tiles), 0 past s
    pre = tl.zeros([BS, BC], dtype=tl.float32)
    if HAS_BIAS:
        pre += tl.load(BIAS + c, mask=cm, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(K):
        src = t - (K - 1) + k
        xm = ((src >= 0) & (src < s))[:, None] & cm[None, :]
        xv = tl.load(X + x0 + src.to(tl.int64)[:, None] * xs_s + c[None, :], mask=xm, other=0.0)
        pre += tl.load(W + c * K + k, mask=cm, other=0.0).to(tl.float32)[None, :] * xv.to(tl.float32)
    sig = tl.sigmoid(pre)
    m = (t < s)[:, None] & cm[None, :]
    dy = tl.load(DY + dy0 + t.to(tl.int64)[:, None] * dys_s + c[None, :], mask=m, other=0.0)
    return tl.where(m, dy.to(tl.float32) * sig * (1.0 + pre * (1.0 - sig)), 0.0)


@triton.jit  # type: ignore[misc]
def store_partials(X, PART, g, x0, t, c, cm, s, xs_s, C, K: tl.constexpr):  # type: ignore[no-untyped-def]
    # PART rows k < K: sum_t g[t] X[t - (K - 1) + k] (the partial dw), row K: sum_t g[t] (the partial dbias)
    for k in tl.static_range(K):
        src = t - (K - 1) + k
        xm = ((src >= 0) & (src < s))[:, None] & cm[None, :]
        xv = tl.load(X + x0 + src.to(tl.int64)[:, None] * xs_s + c[None, :], mask=xm, other=0.0)
        tl.store(PART + k * C, tl.sum(g * xv.to(tl.float32), axis=0), mask=cm)
    tl.store(PART + K * C, tl.sum(g, axis=0), mask=cm)


@triton.jit  # type: ignore[misc]
def dpre(X, W, BIAS, DY, DPRE, PART, s, C, xs_b, xs_s, dys_b, dys_s, K: tl.constexpr,  # type: ignore[no-untyped-def]
         HAS_BIAS: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    # DPRE = dy * silu'(pre) at the block's positions (pre recomputed), PART = its partial dw (K rows) and dbias
    pt, pc, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = pt * BS + tl.arange(0, BS)
    c = pc * BC + tl.arange(0, BC)
    cm = c < C
    x0 = b.to(tl.int64) * xs_b
    g = dpre_tile(X, W, BIAS, DY, x0, t, c, cm, s, xs_s, b.to(tl.int64) * dys_b, dys_s, K, HAS_BIAS, BS, BC)
    m = (t < s)[:, None] & cm[None, :]
    tl.store(DPRE + (b.to(tl.int64) * s + t)[:, None] * C + c[None, :], g.to(DPRE.dtype.element_ty), mask=m)
    part = PART + ((b * tl.num_programs(0) + pt) * (K + 1)).to(tl.int64) * C + c
    store_partials(X, part, g, x0, t, c, cm, s, xs_s, C, K)


@triton.jit  # type: ignore[misc]
def bwd(X, W, BIAS, DY, DX, PART, s, C, xs_b, xs_s, dys_b, dys_s, K: tl.constexpr,  # type: ignore[no-untyped-def]
        HAS_BIAS: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr):  # fmt: skip
    # dpre at BS positions from t0 = pt * (BS - (K - 1)), kept in registers; dx at the first BS - (K - 1) of
    # them (dpre shifted by k positions through tl.gather), PART their partial dw and dbias
    pt, pc, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i = tl.arange(0, BS)
    t = pt * (BS - (K - 1)) + i
    c = pc * BC + tl.arange(0, BC)
    cm = c < C
    x0 = b.to(tl.int64) * xs_b
    g = dpre_tile(X, W, BIAS, DY, x0, t, c, cm, s, xs_s, b.to(tl.int64) * dys_b, dys_s, K, HAS_BIAS, BS, BC)
    g16 = g.to(X.dtype.element_ty).to(tl.float32)  # dx from dpre rounded to x's dtype, as the unfused ops do
    acc = tl.zeros([BS, BC], dtype=tl.float32)
    for k in tl.static_range(K):
        if k == 0:
            gk = g16
        else:
            shift = tl.broadcast_to(tl.minimum(i + k, BS - 1)[:, None], (BS, BC))
            gk = tl.gather(g16, shift, axis=0)
        acc += tl.load(W + c * K + (K - 1 - k), mask=cm, other=0.0).to(tl.float32)[None, :] * gk
    own = (i < BS - (K - 1))[:, None] & (t < s)[:, None] & cm[None, :]
    tl.store(DX + (b.to(tl.int64) * s + t)[:, None] * C + c[None, :], acc.to(DX.dtype.element_ty), mask=own)
    part = PART + ((b * tl.num_programs(0) + pt) * (K + 1)).to(tl.int64) * C + c
    store_partials(X, part, tl.where(own, g, 0.0), x0, t, c, cm, s, xs_s, C, K)


KERNELS = {"conv": conv, "dpre": dpre, "bwd": bwd}
