"""Triton kernels for the Mamba-2 chunked SSD scan (state space duality, Dao & Gu 2024), forward and backward.

Per head ``h`` (group ``g = h // (H // G)`` for ``B`` and ``C``): ``state_t = exp(dt_t A_h) state_{t-1} + dt_t x_t B_t^T``
and ``y_t = state_t C_t + D_h x_t``, computed over chunks of ``L = chunk_size`` positions. With ``cum`` the inclusive
cumulative sum of ``dt A`` within a chunk, the forward is four kernels: ``dt`` (bias, softplus, clamp, ``cum``), the
chunk states ``S_c = sum_j exp(cum_last - cum_j) dt_j x_j B_j^T``, the pass over chunks (``state_in_{c+1} =
exp(cum_last) state_in_c + S_c``, parallel over batch, head and state tiles), and the chunk output ``y_i = sum_{j<=i}
(C_i . B_j) exp(cum_i - cum_j) dt_j x_j + exp(cum_i) state_in C_i + D x_i``. The backward runs the same chunk-state
kernel on ``exp(cum_i) dy_i C_i^T``, the same pass in reverse (the gradient of every chunk's state and of the initial
state), a kernel over columns ``j`` (``dx``, ``dB``, ``d dt``), one over rows ``i`` (``dC``) and a per-chunk kernel
that turns the gradient of ``cum`` into those of ``dt``, ``A``, ``dt_bias`` and ``D``. All math is float32 (matrix
products in TF32 for 16-bit inputs, or on 16-bit operands with :data:`LOW_PRECISION_DOTS`; IEEE float32 for float32
inputs); ``y`` comes back in ``x``'s dtype, the final
states in float32.

The forward and backward are ``torch.library`` custom ops (opaque to ``torch.compile``) under a
``torch.autograd.Function``. They run on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``);
the PyTorch path is ``mcore_models.ssm.ssd.ssd_scan(impl="torch")``.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch

__all__ = ["ssd_scan_triton"]

_ROWS = 64  # positions per row/column block inside a chunk (at most; at least 16, tl.dot's smallest tile): forward
_BWD_ROWS = 32  # the same for the backward's column and row kernels
_WARPS = 8  # warps per program of the forward's chunk kernels (b=2 s=2048 H=32 P=64 N=128 L=256 on an H200)
_BWD_WARPS = 4  # and of the backward's
_STATE_BLOCK = 1024  # state elements per program in the pass over chunks
LOW_PRECISION_DOTS = False
"""16-bit inputs: the chunk kernels' matrix products take 16-bit operands (the inputs' dtype, float32
accumulation; the elementwise math stays float32), as Mamba-2's published kernels do, instead of TF32 products of
float32 operands. Off until measured faster on the GPU (``bench/ssd_bench.py --low-precision-dots``)."""


@functools.cache
def _kernels() -> dict[str, Any]:
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise ImportError("ssd_scan_triton needs Triton (pip install mcore-models[gpu]); use impl='torch'") from e

    @triton.jit  # type: ignore[misc]
    def dt_fwd(DT, BIAS, A, DTP, CUM, s, lo, hi, H: tl.constexpr, L: tl.constexpr, BL: tl.constexpr,  # type: ignore[no-untyped-def]
               HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):  # fmt: skip
        c, bh = tl.program_id(0), tl.program_id(1)
        r = tl.arange(0, BL)
        t = c * L + r
        m = (r < L) & (t < s)
        z = tl.load(DT + ((bh // H) * s + t).to(tl.int64) * H + bh % H, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(BIAS + bh % H).to(tl.float32)
        if SOFTPLUS:  # max(z, 0) + log1p(exp(-|z|)), log1p(u) = u log(1 + u) / ((1 + u) - 1) where 1 + u != 1
            u = tl.exp(-tl.abs(z))
            w = 1.0 + u
            z = tl.maximum(z, 0.0) + tl.where(w == 1.0, u, u * tl.log(w) / (w - 1.0))
        d = tl.where(m, tl.minimum(tl.maximum(z, lo), hi), 0.0)
        cum = tl.cumsum(d * tl.load(A + bh % H).to(tl.float32), axis=0)
        o = bh.to(tl.int64) * s + t
        tl.store(DTP + o, d, mask=m)
        tl.store(CUM + o, cum, mask=m)

    @triton.jit  # type: ignore[misc]
    def chunk_state(X, Bm, DTP, CUM, OUT, s, nc, H: tl.constexpr, G: tl.constexpr, P: tl.constexpr,  # type: ignore[no-untyped-def]
                    N: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                    FROM_END: tl.constexpr, PREC: tl.constexpr, DOT: tl.constexpr,
                    DOT2: tl.constexpr):  # fmt: skip
        # OUT[c] = sum_t w_t X_t^T Bm_t: w = exp(cum_last - cum_t) dt_t (chunk states), else exp(cum_t) (backward)
        c, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        g = h // (H // G)
        p, n = tl.arange(0, BP), tl.arange(0, BN)
        cum_last = tl.load(CUM + bh.to(tl.int64) * s + tl.minimum(c * L + L, s) - 1)
        acc = tl.zeros([BP, BN], dtype=tl.float32)
        for k in range(0, L, BK):
            r = k + tl.arange(0, BK)
            t = c * L + r
            m = (r < L) & (t < s)
            bt = (b * s + t).to(tl.int64)
            xv = tl.load(X + (bt * H + h)[:, None] * P + p[None, :], mask=m[:, None] & (p < P)[None, :], other=0.0)
            bv = tl.load(Bm + (bt * G + g)[:, None] * N + n[None, :], mask=m[:, None] & (n < N)[None, :], other=0.0)
            cu = tl.load(CUM + bh.to(tl.int64) * s + t, mask=m, other=0.0)
            if FROM_END:
                w = tl.exp(tl.where(m, cum_last - cu, float("-inf")))
                w = w * tl.load(DTP + bh.to(tl.int64) * s + t, mask=m, other=0.0)
            else:
                w = tl.exp(tl.where(m, cu, float("-inf")))
            xw = xv.to(tl.float32) * w[:, None]
            acc += tl.dot(tl.trans(xw).to(DOT).to(DOT2), bv.to(DOT).to(DOT2), input_precision=PREC)
        o = ((b * nc + c) * H + h).to(tl.int64) * (P * N) + p[:, None] * N + n[None, :]
        tl.store(OUT + o, acc, mask=(p < P)[:, None] & (n < N)[None, :])

    @triton.jit  # type: ignore[misc]
    def state_pass(BUF, INIT, FINAL, CUM, STATES, TPART, s, nc, H: tl.constexpr, PN: tl.constexpr,  # type: ignore[no-untyped-def]
                   L: tl.constexpr, BS: tl.constexpr, HAS_INIT: tl.constexpr, REVERSE: tl.constexpr):  # fmt: skip
        # forward: BUF[c] holds S_c and is overwritten with state_in_c; FINAL = state_in_nc. REVERSE: BUF[c] holds
        # the direct gradient of state_in_c and is overwritten with the gradient of S_c; FINAL = d initial_states;
        # TPART gets this tile's part of exp(cum_last) <d state_in_{c+1}, state_in_c> (STATES: the forward's BUF).
        bh, tile = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        e = tile * BS + tl.arange(0, BS)
        m = e < PN
        st = tl.zeros([BS], dtype=tl.float32)
        if HAS_INIT:
            st = tl.load(INIT + bh.to(tl.int64) * PN + e, mask=m, other=0.0).to(tl.float32)
        for i in range(0, nc):
            c = i
            if REVERSE:
                c = nc - 1 - i
            dec = tl.exp(tl.load(CUM + bh.to(tl.int64) * s + tl.minimum(c * L + L, s) - 1))
            o = ((b * nc + c) * H + h).to(tl.int64) * PN + e
            v = tl.load(BUF + o, mask=m, other=0.0)
            tl.store(BUF + o, st, mask=m)
            if REVERSE:
                fwd = tl.load(STATES + o, mask=m, other=0.0)
                tl.store(
                    TPART + ((b * nc + c) * H + h).to(tl.int64) * tl.num_programs(1) + tile, dec * tl.sum(st * fwd)
                )
            st = dec * st + v
        tl.store(FINAL + bh.to(tl.int64) * PN + e, st, mask=m)

    @triton.jit  # type: ignore[misc]
    def chunk_out(X, Bm, Cm, DTP, CUM, STATES, Dv, Y, s, nc, H: tl.constexpr, G: tl.constexpr, P: tl.constexpr,  # type: ignore[no-untyped-def]
                  N: tl.constexpr, L: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                  HAS_D: tl.constexpr, PREC: tl.constexpr, DOT: tl.constexpr,
                    DOT2: tl.constexpr):  # fmt: skip
        blk, c, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = bh // H, bh % H
        g = h // (H // G)
        p, n = tl.arange(0, BP), tl.arange(0, BN)
        pm, nm = p < P, n < N
        ri = blk * BM + tl.arange(0, BM)
        ti = c * L + ri
        mi = (ri < L) & (ti < s)
        bti = (b * s + ti).to(tl.int64)
        ci = tl.load(Cm + (bti * G + g)[:, None] * N + n[None, :], mask=mi[:, None] & nm[None, :], other=0.0)
        ci = ci.to(tl.float32)
        cui = tl.load(CUM + bh.to(tl.int64) * s + ti, mask=mi, other=0.0)
        so = ((b * nc + c) * H + h).to(tl.int64) * (P * N) + p[:, None] * N + n[None, :]
        st = tl.load(STATES + so, mask=pm[:, None] & nm[None, :], other=0.0)
        acc = (
            tl.dot(ci.to(DOT).to(DOT2), tl.trans(st).to(DOT).to(DOT2), input_precision=PREC)
            * tl.exp(tl.where(mi, cui, float("-inf")))[:, None]
        )
        for k in range(0, (blk + 1) * BM, BM):
            rj = k + tl.arange(0, BM)
            tj = c * L + rj
            mj = (rj < L) & (tj < s)
            btj = (b * s + tj).to(tl.int64)
            bj = tl.load(Bm + (btj * G + g)[:, None] * N + n[None, :], mask=mj[:, None] & nm[None, :], other=0.0)
            xj = tl.load(X + (btj * H + h)[:, None] * P + p[None, :], mask=mj[:, None] & pm[None, :], other=0.0)
            cuj = tl.load(CUM + bh.to(tl.int64) * s + tj, mask=mj, other=0.0)
            dtj = tl.load(DTP + bh.to(tl.int64) * s + tj, mask=mj, other=0.0)
            keep = (ri[:, None] >= rj[None, :]) & mi[:, None] & mj[None, :]
            dec = tl.exp(tl.where(keep, cui[:, None] - cuj[None, :], float("-inf")))
            w = tl.dot(ci.to(DOT).to(DOT2), tl.trans(bj).to(DOT).to(DOT2), input_precision=PREC) * dec * dtj[None, :]
            acc += tl.dot(w.to(DOT).to(DOT2), xj.to(DOT).to(DOT2), input_precision=PREC)
        xo = (bti * H + h)[:, None] * P + p[None, :]
        om = mi[:, None] & pm[None, :]
        if HAS_D:
            acc += tl.load(Dv + h).to(tl.float32) * tl.load(X + xo, mask=om, other=0.0).to(tl.float32)
        tl.store(Y + xo, acc.to(Y.dtype.element_ty), mask=om)

    @triton.jit  # type: ignore[misc]
    def bwd_cols(X, Bm, Cm, DY, DTP, CUM, DS, Dv, DX, DB, AUX, s, nc, H: tl.constexpr, G: tl.constexpr,  # type: ignore[no-untyped-def]
                 P: tl.constexpr, N: tl.constexpr, L: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr,
                 BN: tl.constexpr, HAS_D: tl.constexpr, PREC: tl.constexpr, DOT: tl.constexpr,
                    DOT2: tl.constexpr):  # fmt: skip
        # columns j of the chunk: dx_j, dB_j (per head), d dt_j as a multiplier, and the parts of d cum_j and of
        # d cum_last that column j gives (AUX rows: d dt, minus d cum, d cum_last, sum_p dy x)
        blk, c, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = bh // H, bh % H
        g = h // (H // G)
        p, n = tl.arange(0, BP), tl.arange(0, BN)
        pm, nm = p < P, n < N
        rj = blk * BM + tl.arange(0, BM)
        tj = c * L + rj
        mj = (rj < L) & (tj < s)
        btj = (b * s + tj).to(tl.int64)
        xo = (btj * H + h)[:, None] * P + p[None, :]
        xm = mj[:, None] & pm[None, :]
        xj = tl.load(X + xo, mask=xm, other=0.0).to(tl.float32)
        dyj = tl.load(DY + xo, mask=xm, other=0.0).to(tl.float32)
        bj = tl.load(Bm + (btj * G + g)[:, None] * N + n[None, :], mask=mj[:, None] & nm[None, :], other=0.0)
        bj = bj.to(tl.float32)
        row = bh.to(tl.int64) * s
        cuj = tl.load(CUM + row + tj, mask=mj, other=0.0)
        dtj = tl.load(DTP + row + tj, mask=mj, other=0.0)
        ej = tl.exp(tl.where(mj, tl.load(CUM + row + tl.minimum(c * L + L, s) - 1) - cuj, float("-inf")))
        so = ((b * nc + c) * H + h).to(tl.int64) * (P * N) + p[:, None] * N + n[None, :]
        ds = tl.load(DS + so, mask=pm[:, None] & nm[None, :], other=0.0)
        inner = (
            tl.dot(bj.to(DOT).to(DOT2), tl.trans(ds).to(DOT).to(DOT2), input_precision=PREC) * ej[:, None]
        )  # d S / d (dt_j x_j)
        wj = dtj * tl.sum(xj * inner, axis=1)
        dbj = tl.dot(xj.to(DOT).to(DOT2), ds.to(DOT).to(DOT2), input_precision=PREC) * (ej * dtj)[:, None]
        q = tl.zeros([BM], dtype=tl.float32)
        for k in range(blk * BM, L, BM):
            ri = k + tl.arange(0, BM)
            ti = c * L + ri
            mi = (ri < L) & (ti < s)
            bti = (b * s + ti).to(tl.int64)
            ci = tl.load(Cm + (bti * G + g)[:, None] * N + n[None, :], mask=mi[:, None] & nm[None, :], other=0.0)
            ci = ci.to(tl.float32)
            dyi = tl.load(DY + (bti * H + h)[:, None] * P + p[None, :], mask=mi[:, None] & pm[None, :], other=0.0)
            dyi = dyi.to(tl.float32)
            cui = tl.load(CUM + row + ti, mask=mi, other=0.0)
            keep = (ri[None, :] >= rj[:, None]) & mi[None, :] & mj[:, None]
            dec = tl.exp(tl.where(keep, cui[None, :] - cuj[:, None], float("-inf")))  # [j, i]
            gt = tl.dot(bj.to(DOT).to(DOT2), tl.trans(ci).to(DOT).to(DOT2), input_precision=PREC) * dec
            inner += tl.dot(gt.to(DOT).to(DOT2), dyi.to(DOT).to(DOT2), input_precision=PREC)
            xdy = tl.dot(xj.to(DOT).to(DOT2), tl.trans(dyi).to(DOT).to(DOT2), input_precision=PREC)
            dbj += tl.dot((xdy * dec * dtj[:, None]).to(DOT).to(DOT2), ci.to(DOT).to(DOT2), input_precision=PREC)
            q += tl.sum(gt * xdy, axis=1)
        dxj = inner * dtj[:, None]
        if HAS_D:
            dxj += tl.load(Dv + h).to(tl.float32) * dyj
        tl.store(DX + xo, dxj.to(DX.dtype.element_ty), mask=xm)
        tl.store(DB + (btj * H + h)[:, None] * N + n[None, :], dbj, mask=mj[:, None] & nm[None, :])
        aux = AUX + row + tj
        stride = tl.num_programs(2) * s  # one AUX row: b * H * s
        tl.store(aux, tl.sum(xj * inner, axis=1), mask=mj)
        tl.store(aux + stride, q * dtj + wj, mask=mj)
        tl.store(aux + 2 * stride, wj, mask=mj)
        tl.store(aux + 3 * stride, tl.sum(dyj * xj, axis=1), mask=mj)

    @triton.jit  # type: ignore[misc]
    def bwd_rows(X, Bm, Cm, DY, DTP, CUM, STATES, DC, AUX, s, nc, H: tl.constexpr, G: tl.constexpr,  # type: ignore[no-untyped-def]
                 P: tl.constexpr, N: tl.constexpr, L: tl.constexpr, BM: tl.constexpr, BP: tl.constexpr,
                 BN: tl.constexpr, PREC: tl.constexpr, DOT: tl.constexpr,
                    DOT2: tl.constexpr):  # fmt: skip
        # rows i of the chunk: dC_i (per head) and the plus part of d cum_i (AUX row 4)
        blk, c, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = bh // H, bh % H
        g = h // (H // G)
        p, n = tl.arange(0, BP), tl.arange(0, BN)
        pm, nm = p < P, n < N
        ri = blk * BM + tl.arange(0, BM)
        ti = c * L + ri
        mi = (ri < L) & (ti < s)
        bti = (b * s + ti).to(tl.int64)
        row = bh.to(tl.int64) * s
        ci = tl.load(Cm + (bti * G + g)[:, None] * N + n[None, :], mask=mi[:, None] & nm[None, :], other=0.0)
        ci = ci.to(tl.float32)
        dyi = tl.load(DY + (bti * H + h)[:, None] * P + p[None, :], mask=mi[:, None] & pm[None, :], other=0.0)
        dyi = dyi.to(tl.float32)
        cui = tl.load(CUM + row + ti, mask=mi, other=0.0)
        ei = tl.exp(tl.where(mi, cui, float("-inf")))
        so = ((b * nc + c) * H + h).to(tl.int64) * (P * N) + p[:, None] * N + n[None, :]
        st = tl.load(STATES + so, mask=pm[:, None] & nm[None, :], other=0.0)
        dci = tl.dot(dyi.to(DOT).to(DOT2), st.to(DOT).to(DOT2), input_precision=PREC) * ei[:, None]
        plus = (
            tl.sum(dyi * tl.dot(ci.to(DOT).to(DOT2), tl.trans(st).to(DOT).to(DOT2), input_precision=PREC), axis=1) * ei
        )
        for k in range(0, (blk + 1) * BM, BM):
            rj = k + tl.arange(0, BM)
            tj = c * L + rj
            mj = (rj < L) & (tj < s)
            btj = (b * s + tj).to(tl.int64)
            bj = tl.load(Bm + (btj * G + g)[:, None] * N + n[None, :], mask=mj[:, None] & nm[None, :], other=0.0)
            bj = bj.to(tl.float32)
            xj = tl.load(X + (btj * H + h)[:, None] * P + p[None, :], mask=mj[:, None] & pm[None, :], other=0.0)
            cuj = tl.load(CUM + row + tj, mask=mj, other=0.0)
            dtj = tl.load(DTP + row + tj, mask=mj, other=0.0)
            keep = (ri[:, None] >= rj[None, :]) & mi[:, None] & mj[None, :]
            dec = tl.exp(tl.where(keep, cui[:, None] - cuj[None, :], float("-inf")))
            mt = tl.dot(dyi.to(DOT).to(DOT2), tl.trans(xj).to(DOT).to(DOT2), input_precision=PREC) * dec * dtj[None, :]
            dci += tl.dot(mt.to(DOT).to(DOT2), bj.to(DOT).to(DOT2), input_precision=PREC)
            plus += tl.sum(
                mt * tl.dot(ci.to(DOT).to(DOT2), tl.trans(bj).to(DOT).to(DOT2), input_precision=PREC), axis=1
            )
        tl.store(DC + (bti * H + h)[:, None] * N + n[None, :], dci, mask=mi[:, None] & nm[None, :])
        tl.store(AUX + 4 * (tl.num_programs(2) * s) + row + ti, plus, mask=mi)

    @triton.jit  # type: ignore[misc]
    def dt_bwd(DT, BIAS, A, DTP, AUX, TPART, DDT, PARTS, s, nc, nt, lo, hi, H: tl.constexpr, L: tl.constexpr,  # type: ignore[no-untyped-def]
               BL: tl.constexpr, BT: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):  # fmt: skip
        # d cum -> d (dt A) (a reverse cumulative sum) -> d dt, d A; then through the clamp and softplus to d dt_raw
        c, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        r = tl.arange(0, BL)
        t = c * L + r
        m = (r < L) & (t < s)
        row = AUX + bh.to(tl.int64) * s + t
        stride = tl.num_programs(1) * s
        ddt = tl.load(row, mask=m, other=0.0)
        dcum = tl.load(row + 4 * stride, mask=m, other=0.0) - tl.load(row + stride, mask=m, other=0.0)
        tp = tl.load(TPART + ((b * nc + c) * H + h).to(tl.int64) * nt + tl.arange(0, BT), mask=tl.arange(0, BT) < nt)
        last = tl.sum(tl.load(row + 2 * stride, mask=m, other=0.0)) + tl.sum(tl.where(tl.arange(0, BT) < nt, tp, 0.0))
        da = tl.where(m, tl.sum(dcum) - tl.cumsum(dcum, axis=0) + dcum + last, 0.0)
        d = tl.load(DTP + bh.to(tl.int64) * s + t, mask=m, other=0.0)
        ddt += tl.load(A + h).to(tl.float32) * da
        di = ((b * s + t).to(tl.int64)) * H + h
        z = tl.load(DT + di, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += tl.load(BIAS + h).to(tl.float32)
        v = z
        gate = tl.full([BL], 1.0, tl.float32)
        if SOFTPLUS:
            u = tl.exp(-tl.abs(z))
            w = 1.0 + u
            v = tl.maximum(z, 0.0) + tl.where(w == 1.0, u, u * tl.log(w) / (w - 1.0))
            gate = tl.sigmoid(z)
        dz = tl.where(m & (v >= lo) & (v <= hi), ddt * gate, 0.0)
        tl.store(DDT + di, dz.to(DDT.dtype.element_ty), mask=m)
        o = ((b * nc + c) * H + h).to(tl.int64)
        total = tl.num_programs(0) * tl.num_programs(1)
        tl.store(PARTS + o, tl.sum(d * da))
        tl.store(PARTS + total + o, tl.sum(dz))
        tl.store(PARTS + 2 * total + o, tl.sum(tl.load(row + 3 * stride, mask=m, other=0.0)))

    return {"dt_fwd": dt_fwd, "chunk_state": chunk_state, "state_pass": state_pass, "chunk_out": chunk_out,
            "bwd_cols": bwd_cols, "bwd_rows": bwd_rows, "dt_bwd": dt_bwd}  # fmt: skip


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _dot_dtypes(x: torch.Tensor) -> dict[str, Any]:
    """The chunk kernels' matrix-product operands: rounded to ``DOT`` (float32, giving TF32 products for 16-bit
    inputs, or with :data:`LOW_PRECISION_DOTS` the 16-bit input dtype) and multiplied as ``DOT2``: ``DOT`` on GPUs;
    float32 under Triton's interpreter, whose ``tl.dot`` of 16-bit operands is wrong (it multiplies their bit
    patterns; the products of 16-bit values are exact in float32, so the result is the 16-bit product's)."""
    import triton.language as tl

    dot = tl.float32
    if LOW_PRECISION_DOTS and x.dtype in (torch.bfloat16, torch.float16):
        dot = tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16
    return {"DOT": dot, "DOT2": tl.float32 if _interpreting() else dot}


def _blocks(x: torch.Tensor, B: torch.Tensor, chunk_size: int, rows: int) -> dict[str, Any]:
    """The shape constants of the chunk kernels (tiles padded to powers of two, at least 16 for ``tl.dot``)."""
    H, P = x.shape[2:]
    G, N = B.shape[2:]
    prec = "ieee" if x.dtype in (torch.float32, torch.float64) else "tf32"
    bm = max(16, min(rows, _pow2(chunk_size)))
    return {"H": H, "G": G, "P": P, "N": N, "L": chunk_size, "BP": max(16, _pow2(P)), "BN": max(16, _pow2(N)),
            "BM": bm, "PREC": prec, **_dot_dtypes(x)}  # fmt: skip


def _dims(x: torch.Tensor, B: torch.Tensor, chunk_size: int) -> tuple[int, int, int, int, int, int]:
    b, s, H, P = x.shape
    return b, s, H, P, B.shape[3], -(-s // chunk_size)


Fwd = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@torch.library.custom_op("mcore_models::ssd_scan_fwd", mutates_args=())
def _ssd_fwd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_states: torch.Tensor | None,
             chunk_size: int, dt_softplus: bool, dt_lo: float, dt_hi: float) -> Fwd:  # fmt: skip
    """``(y, final_states, state_in per chunk, processed dt, cum)``: the last three are kept for the backward."""
    k = _kernels()
    b, s, H, P, N, nc = _dims(x, B, chunk_size)
    x, dt, A, B, C = (t.contiguous() for t in (x, dt, A, B, C))
    f32: dict[str, Any] = {"device": x.device, "dtype": torch.float32}
    dtp, cum = torch.empty(b, H, s, **f32), torch.empty(b, H, s, **f32)
    bias = dt_bias.contiguous() if dt_bias is not None else A
    k["dt_fwd"][(nc, b * H)](dt, bias, A, dtp, cum, s, dt_lo, dt_hi, H=H, L=chunk_size, BL=_pow2(chunk_size),
                             HAS_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus)  # fmt: skip
    cfg = _blocks(x, B, chunk_size, _ROWS)
    bm = cfg.pop("BM")
    states = torch.empty(b, nc, H, P, N, **f32)
    k["chunk_state"][(nc, b * H)](x, B, dtp, cum, states, s, nc, BK=bm, FROM_END=True, num_warps=_WARPS, **cfg)
    final = torch.empty(b, H, P, N, **f32)
    init = initial_states.contiguous() if initial_states is not None else final
    bs = min(_STATE_BLOCK, _pow2(P * N))
    k["state_pass"][(b * H, -(-P * N // bs))](states, init, final, cum, states, final, s, nc, H=H, PN=P * N,
                                              L=chunk_size, BS=bs, HAS_INIT=initial_states is not None,
                                              REVERSE=False)  # fmt: skip
    y = torch.empty_like(x)
    d = D.contiguous() if D is not None else A
    grid = (-(-chunk_size // bm), nc, b * H)
    k["chunk_out"][grid](x, B, C, dtp, cum, states, d, y, s, nc, BM=bm, HAS_D=D is not None, num_warps=_WARPS, **cfg)
    return y, final, states, dtp, cum


@_ssd_fwd.register_fake
def _(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
      D: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_states: torch.Tensor | None,
      chunk_size: int, dt_softplus: bool, dt_lo: float, dt_hi: float) -> Fwd:  # fmt: skip
    b, s, H, P, N, nc = _dims(x, B, chunk_size)
    f32: dict[str, Any] = {"device": x.device, "dtype": torch.float32}
    return (torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(b, H, P, N, **f32),
            x.new_empty(b, nc, H, P, N, **f32), x.new_empty(b, H, s, **f32), x.new_empty(b, H, s, **f32))  # fmt: skip


Grads = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]


@torch.library.custom_op("mcore_models::ssd_scan_bwd", mutates_args=())
def _ssd_bwd(dy: torch.Tensor, dfinal: torch.Tensor | None, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None,
             states: torch.Tensor, dtp: torch.Tensor, cum: torch.Tensor, chunk_size: int, dt_softplus: bool,
             dt_lo: float, dt_hi: float) -> Grads:  # fmt: skip
    """``(dx, d dt, dA, dB, dC, dD, d dt_bias, d initial_states)``; ``dD`` and ``d dt_bias`` float32 when absent,
    ``d initial_states`` float32."""
    k = _kernels()
    b, s, H, P, N, nc = _dims(x, B, chunk_size)
    dy, x, dt, A, B, C = (t.contiguous() for t in (dy, x, dt, A, B, C))
    f32: dict[str, Any] = {"device": x.device, "dtype": torch.float32}
    cfg = _blocks(x, B, chunk_size, _BWD_ROWS)
    bm = cfg.pop("BM")
    ds = torch.empty(b, nc, H, P, N, **f32)  # the direct gradient of state_in_c, then the gradient of S_c
    k["chunk_state"][(nc, b * H)](dy, C, dtp, cum, ds, s, nc, BK=bm, FROM_END=False, num_warps=_WARPS, **cfg)
    bs = min(_STATE_BLOCK, _pow2(P * N))
    nt = -(-P * N // bs)
    dinit, tpart = torch.empty(b, H, P, N, **f32), torch.empty(b, nc, H, nt, **f32)
    dfin = dfinal.contiguous().float() if dfinal is not None else dinit
    k["state_pass"][(b * H, nt)](ds, dfin, dinit, cum, states, tpart, s, nc, H=H, PN=P * N, L=chunk_size, BS=bs,
                                 HAS_INIT=dfinal is not None, REVERSE=True)  # fmt: skip
    dx = torch.empty_like(x)
    db, dc = torch.empty(b, s, H, N, **f32), torch.empty(b, s, H, N, **f32)  # per head: summed over groups below
    aux = torch.empty(5, b, H, s, **f32)
    d = D.contiguous() if D is not None else A
    grid = (-(-chunk_size // bm), nc, b * H)
    k["bwd_cols"][grid](x, B, C, dy, dtp, cum, ds, d, dx, db, aux, s, nc, BM=bm, HAS_D=D is not None,
                        num_warps=_BWD_WARPS, **cfg)  # fmt: skip
    k["bwd_rows"][grid](x, B, C, dy, dtp, cum, states, dc, aux, s, nc, BM=bm, num_warps=_BWD_WARPS, **cfg)
    ddt, parts = torch.empty_like(dt), torch.empty(3, b, nc, H, **f32)
    bias = dt_bias.contiguous() if dt_bias is not None else A
    k["dt_bwd"][(nc, b * H)](dt, bias, A, dtp, aux, tpart, ddt, parts, s, nc, nt, dt_lo, dt_hi, H=H, L=chunk_size,
                             BL=_pow2(chunk_size), BT=_pow2(nt), HAS_BIAS=dt_bias is not None,
                             SOFTPLUS=dt_softplus)  # fmt: skip
    G = B.shape[2]
    dB = db.view(b, s, G, H // G, N).sum(3).to(B.dtype)
    dC = dc.view(b, s, G, H // G, N).sum(3).to(C.dtype)
    dD = parts[2].sum((0, 1)).to(D.dtype if D is not None else torch.float32)
    dbias = parts[1].sum((0, 1)).to(dt_bias.dtype if dt_bias is not None else torch.float32)
    return dx, ddt, parts[0].sum((0, 1)).to(A.dtype), dB, dC, dD, dbias, dinit


@_ssd_bwd.register_fake
def _(dy: torch.Tensor, dfinal: torch.Tensor | None, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
      B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None, dt_bias: torch.Tensor | None, states: torch.Tensor,
      dtp: torch.Tensor, cum: torch.Tensor, chunk_size: int, dt_softplus: bool, dt_lo: float,
      dt_hi: float) -> Grads:  # fmt: skip
    b, _, H, P, N, _ = _dims(x, B, chunk_size)
    like = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (x, dt, A, B, C)]
    dD, dbias = (A.new_empty(H, dtype=t.dtype if t is not None else torch.float32) for t in (D, dt_bias))
    return (*like, dD, dbias, x.new_empty(b, H, P, N, dtype=torch.float32))  # type: ignore[return-value]


class _SSDScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_states: torch.Tensor | None,
                chunk_size: int, dt_softplus: bool, dt_lo: float, dt_hi: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        cfg = (chunk_size, dt_softplus, dt_lo, dt_hi)
        y, final, states, dtp, cum = _ssd_fwd(x, dt, A, B, C, D, dt_bias, initial_states, *cfg)
        ctx.save_for_backward(x, dt, A, B, C, D, dt_bias, initial_states, states, dtp, cum)
        ctx.cfg = cfg
        return y, final

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, dfinal: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, dt, A, B, C, D, dt_bias, init, states, dtp, cum = ctx.saved_tensors
        grads = _ssd_bwd(dy, dfinal, x, dt, A, B, C, D, dt_bias, states, dtp, cum, *ctx.cfg)
        dx, ddt, dA, dB, dC, dD, dbias, dinit = grads
        return (dx, ddt, dA, dB, dC, dD if D is not None else None, dbias if dt_bias is not None else None,
                dinit.to(init.dtype) if init is not None else None, None, None, None, None)  # fmt: skip


def _check(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
           chunk_size: int, tensors: list[torch.Tensor]) -> None:  # fmt: skip
    if x.dim() != 4 or B.dim() != 4 or B.shape != C.shape or B.shape[:2] != x.shape[:2]:
        raise ValueError(f"ssd_scan: x [b, s, H, P] and B, C [b, s, G, N]; got {tuple(x.shape)}, {tuple(B.shape)}, "
                         f"{tuple(C.shape)}")  # fmt: skip
    H, G = x.shape[2], B.shape[2]
    if dt.shape != x.shape[:3] or A.shape != (H,) or H % G or chunk_size < 1 or x.shape[1] == 0:
        raise ValueError(f"ssd_scan: dt [b, s, H], A [H], H % G == 0, chunk_size >= 1 and s >= 1; got dt "
                         f"{tuple(dt.shape)}, A {tuple(A.shape)}, G={G}, chunk_size={chunk_size}")  # fmt: skip
    on = x.device
    if any(t.device != on for t in tensors) or not (on.type == "cuda" or (on.type == "cpu" and _interpreting())):
        raise ValueError(f"ssd_scan_triton needs all tensors on one CUDA device (or the CPU under TRITON_INTERPRET=1); "
                         f"got {sorted({str(t.device) for t in tensors})}; use impl='torch'")  # fmt: skip


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def ssd_scan_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The chunked SSD scan: ``y`` ``[b, s, H, P]`` in ``x``'s dtype (and the final states ``[b, H, P, N]``, float32,
    with ``return_final_states``); differentiable in every tensor argument. ``dt`` is raw: ``dt_bias`` is added,
    then softplus (``dt_softplus``), then the clamp to ``dt_limit``."""
    tensors = [t for t in (x, dt, A, B, C, D, dt_bias, initial_states) if t is not None]
    _check(x, dt, A, B, C, chunk_size, tensors)
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    y, final = _SSDScan.apply(x, dt, A, B, C, D, dt_bias, initial_states, chunk_size, dt_softplus, lo, hi)
    return (y, final) if return_final_states else y
