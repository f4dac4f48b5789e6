"""The Triton kernels of :mod:`mcore_models.ssm.ssd_triton` (the chunked SSD scan, forward and backward), built on
first use; the algorithm, the launches and their shapes are described there."""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["kernels"]


@functools.cache
def kernels() -> dict[str, Any]:
    """The kernels by name (an ImportError naming the fix without Triton)."""
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise ImportError("ssd_scan_triton needs Triton (pip install mcore-models[gpu]); use impl='torch'") from e

    @triton.jit  # type: ignore[misc]
    def dt_fwd(DT, BIAS, A, DTP, CUM, s, dts_b, dts_t, lo, hi, H: tl.constexpr, L: tl.constexpr,  # type: ignore[no-untyped-def]
               BL: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):  # fmt: skip
        c, bh = tl.program_id(0), tl.program_id(1)
        r = tl.arange(0, BL)
        t = c * L + r
        m = (r < L) & (t < s)
        di = (bh // H).to(tl.int64) * dts_b + t.to(tl.int64) * dts_t + bh % H
        z = tl.load(DT + di, mask=m, other=0.0).to(tl.float32)
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
    def chunk_state(X, Bm, DTP, CUM, OUT, s, nc, xs_b, xs_t, bs_b, bs_t, H: tl.constexpr, G: tl.constexpr,  # type: ignore[no-untyped-def]
                    P: tl.constexpr, N: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
                    BN: tl.constexpr, FROM_END: tl.constexpr, PREC: tl.constexpr, DOT: tl.constexpr,
                    DOT2: tl.constexpr):  # fmt: skip
        # OUT[c] = sum_t w_t X_t^T Bm_t: w = exp(cum_last - cum_t) dt_t (chunk states), else exp(cum_t) (backward)
        c, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        g = h // (H // G)
        p, n = tl.arange(0, BP), tl.arange(0, BN)
        X += b.to(tl.int64) * xs_b + h * P  # the inputs through their batch and position strides
        Bm += b.to(tl.int64) * bs_b + g * N
        cum_last = tl.load(CUM + bh.to(tl.int64) * s + tl.minimum(c * L + L, s) - 1)
        acc = tl.zeros([BP, BN], dtype=tl.float32)
        for k in range(0, L, BK):
            r = k + tl.arange(0, BK)
            t = c * L + r
            m = (r < L) & (t < s)
            t64 = t.to(tl.int64)
            xv = tl.load(X + (t64 * xs_t)[:, None] + p[None, :], mask=m[:, None] & (p < P)[None, :], other=0.0)
            bv = tl.load(Bm + (t64 * bs_t)[:, None] + n[None, :], mask=m[:, None] & (n < N)[None, :], other=0.0)
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
        # each chunk's loads are issued one iteration ahead (they do not depend on the running state), so two chunks'
        # reads are in flight: the pass is a chain of nc dependent steps, bound by load latency, not bandwidth
        row = bh.to(tl.int64) * s
        c = (nc - 1) if REVERSE else 0
        o = ((b * nc + c) * H + h).to(tl.int64) * PN + e
        v_next = tl.load(BUF + o, mask=m, other=0.0)
        dec_next = tl.exp(tl.load(CUM + row + tl.minimum(c * L + L, s) - 1))
        fwd_next = v_next
        if REVERSE:
            fwd_next = tl.load(STATES + o, mask=m, other=0.0)
        for i in range(0, nc):
            c = (nc - 1 - i) if REVERSE else i
            o = ((b * nc + c) * H + h).to(tl.int64) * PN + e
            v, dec, fwd = v_next, dec_next, fwd_next
            mn = m & (e * 0 + i + 1 < nc)  # the next chunk's elements, none after the last chunk
            cn = tl.maximum(c - 1, 0) if REVERSE else tl.minimum(c + 1, nc - 1)
            on = ((b * nc + cn) * H + h).to(tl.int64) * PN + e
            v_next = tl.load(BUF + on, mask=mn, other=0.0)
            dec_next = tl.exp(tl.load(CUM + row + tl.minimum(cn * L + L, s) - 1))
            if REVERSE:
                fwd_next = tl.load(STATES + on, mask=mn, other=0.0)
            tl.store(BUF + o, st, mask=m)
            if REVERSE:
                tl.store(
                    TPART + ((b * nc + c) * H + h).to(tl.int64) * tl.num_programs(1) + tile, dec * tl.sum(st * fwd)
                )
            st = dec * st + v
        tl.store(FINAL + bh.to(tl.int64) * PN + e, st, mask=m)

    @triton.jit  # type: ignore[misc]
    def chunk_out(X, Bm, Cm, DTP, CUM, STATES, Dv, Y, s, nc, xs_b, xs_t, bs_b, bs_t, cs_b, cs_t,  # type: ignore[no-untyped-def]
                  H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, L: tl.constexpr,
                  BM: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr, PREC: tl.constexpr,
                  DOT: tl.constexpr, DOT2: tl.constexpr):  # fmt: skip
        blk, c, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = bh // H, bh % H
        g = h // (H // G)
        p, n = tl.arange(0, BP), tl.arange(0, BN)
        pm, nm = p < P, n < N
        X += b.to(tl.int64) * xs_b + h * P  # the inputs through their batch and position strides
        Bm += b.to(tl.int64) * bs_b + g * N
        Cm += b.to(tl.int64) * cs_b + g * N
        ri = blk * BM + tl.arange(0, BM)
        ti = c * L + ri
        mi = (ri < L) & (ti < s)
        ti64 = ti.to(tl.int64)
        ci = tl.load(Cm + (ti64 * cs_t)[:, None] + n[None, :], mask=mi[:, None] & nm[None, :], other=0.0)
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
            tj64 = tj.to(tl.int64)
            bj = tl.load(Bm + (tj64 * bs_t)[:, None] + n[None, :], mask=mj[:, None] & nm[None, :], other=0.0)
            xj = tl.load(X + (tj64 * xs_t)[:, None] + p[None, :], mask=mj[:, None] & pm[None, :], other=0.0)
            cuj = tl.load(CUM + bh.to(tl.int64) * s + tj, mask=mj, other=0.0)
            dtj = tl.load(DTP + bh.to(tl.int64) * s + tj, mask=mj, other=0.0)
            keep = (ri[:, None] >= rj[None, :]) & mi[:, None] & mj[None, :]
            dec = tl.exp(tl.where(keep, cui[:, None] - cuj[None, :], float("-inf")))
            w = tl.dot(ci.to(DOT).to(DOT2), tl.trans(bj).to(DOT).to(DOT2), input_precision=PREC) * dec * dtj[None, :]
            acc += tl.dot(w.to(DOT).to(DOT2), xj.to(DOT).to(DOT2), input_precision=PREC)
        om = mi[:, None] & pm[None, :]
        if HAS_D:
            xi = tl.load(X + (ti64 * xs_t)[:, None] + p[None, :], mask=om, other=0.0)
            acc += tl.load(Dv + h).to(tl.float32) * xi.to(tl.float32)
        yo = (((b * s + ti).to(tl.int64)) * H + h)[:, None] * P + p[None, :]  # y: contiguous
        tl.store(Y + yo, acc.to(Y.dtype.element_ty), mask=om)

    @triton.jit  # type: ignore[misc]
    def bwd_cols(X, Bm, Cm, DY, DTP, CUM, DS, Dv, DX, DB, AUX, s, nc, xs_b, xs_t, bs_b, bs_t, cs_b, cs_t, ys_b,  # type: ignore[no-untyped-def]
                 ys_t, H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, L: tl.constexpr,
                 BM: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr, PER_HEAD_DB: tl.constexpr,
                 PREC: tl.constexpr, DOT: tl.constexpr, DOT2: tl.constexpr):  # fmt: skip
        # columns j of the chunk: dx_j, d dt_j as a multiplier (AUX row 0), sum_p dy x (row 2); with PER_HEAD_DB
        # also dB_j (per head) and the parts of d cum that column j gives: w_j (row 1: minus d cum_j and plus
        # d cum_last) and q_j dt_j (row 5: minus d cum_j); else the group kernels give those
        blk, c, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = bh // H, bh % H
        g = h // (H // G)
        p, n = tl.arange(0, BP), tl.arange(0, BN)
        pm, nm = p < P, n < N
        X += b.to(tl.int64) * xs_b + h * P  # the inputs through their batch and position strides
        DY += b.to(tl.int64) * ys_b + h * P
        Bm += b.to(tl.int64) * bs_b + g * N
        Cm += b.to(tl.int64) * cs_b + g * N
        rj = blk * BM + tl.arange(0, BM)
        tj = c * L + rj
        mj = (rj < L) & (tj < s)
        btj = (b * s + tj).to(tl.int64)
        tj64 = tj.to(tl.int64)
        xm = mj[:, None] & pm[None, :]
        # the input tiles stay in their dtype until used (exact: 16-bit to float32), so fewer registers hold them
        xj = tl.load(X + (tj64 * xs_t)[:, None] + p[None, :], mask=xm, other=0.0)
        bj = tl.load(Bm + (tj64 * bs_t)[:, None] + n[None, :], mask=mj[:, None] & nm[None, :], other=0.0)
        row = bh.to(tl.int64) * s
        cuj = tl.load(CUM + row + tj, mask=mj, other=0.0)
        dtj = tl.load(DTP + row + tj, mask=mj, other=0.0)
        ej = tl.exp(tl.where(mj, tl.load(CUM + row + tl.minimum(c * L + L, s) - 1) - cuj, float("-inf")))
        so = ((b * nc + c) * H + h).to(tl.int64) * (P * N) + p[:, None] * N + n[None, :]
        ds = tl.load(DS + so, mask=pm[:, None] & nm[None, :], other=0.0)
        inner = (
            tl.dot(bj.to(DOT).to(DOT2), tl.trans(ds).to(DOT).to(DOT2), input_precision=PREC) * ej[:, None]
        )  # d S / d (dt_j x_j)
        if PER_HEAD_DB:
            wj = dtj * tl.sum(xj.to(tl.float32) * inner, axis=1)
            dbj = tl.dot(xj.to(DOT).to(DOT2), ds.to(DOT).to(DOT2), input_precision=PREC) * (ej * dtj)[:, None]
            q = tl.zeros([BM], dtype=tl.float32)
        for k in range(blk * BM, L, BM):
            ri = k + tl.arange(0, BM)
            ti = c * L + ri
            mi = (ri < L) & (ti < s)
            ti64 = ti.to(tl.int64)
            ci = tl.load(Cm + (ti64 * cs_t)[:, None] + n[None, :], mask=mi[:, None] & nm[None, :], other=0.0)
            dyi = tl.load(DY + (ti64 * ys_t)[:, None] + p[None, :], mask=mi[:, None] & pm[None, :], other=0.0)
            cui = tl.load(CUM + row + ti, mask=mi, other=0.0)
            keep = (ri[None, :] >= rj[:, None]) & mi[None, :] & mj[:, None]
            dec = tl.exp(tl.where(keep, cui[None, :] - cuj[:, None], float("-inf")))  # [j, i]
            gt = tl.dot(bj.to(DOT).to(DOT2), tl.trans(ci).to(DOT).to(DOT2), input_precision=PREC) * dec
            inner += tl.dot(gt.to(DOT).to(DOT2), dyi.to(DOT).to(DOT2), input_precision=PREC)
            if PER_HEAD_DB:
                xdy = tl.dot(xj.to(DOT).to(DOT2), tl.trans(dyi).to(DOT).to(DOT2), input_precision=PREC)
                dbj += tl.dot((xdy * dec * dtj[:, None]).to(DOT).to(DOT2), ci.to(DOT).to(DOT2), input_precision=PREC)
                q += tl.sum(gt * xdy, axis=1)
        dyj = tl.load(DY + (tj64 * ys_t)[:, None] + p[None, :], mask=xm, other=0.0).to(tl.float32)
        xj = xj.to(tl.float32)
        dxj = inner * dtj[:, None]
        if HAS_D:
            dxj += tl.load(Dv + h).to(tl.float32) * dyj
        tl.store(DX + (btj * H + h)[:, None] * P + p[None, :], dxj.to(DX.dtype.element_ty), mask=xm)  # dx: contiguous
        aux = AUX + row + tj
        stride = tl.num_programs(2) * s  # one AUX row: b * H * s
        tl.store(aux, tl.sum(xj * inner, axis=1), mask=mj)
        tl.store(aux + 2 * stride, tl.sum(dyj * xj, axis=1), mask=mj)
        if PER_HEAD_DB:
            tl.store(DB + (btj * H + h)[:, None] * N + n[None, :], dbj, mask=mj[:, None] & nm[None, :])
            tl.store(aux + stride, wj, mask=mj)
            tl.store(aux + 5 * stride, q * dtj, mask=mj)

    @triton.jit  # type: ignore[misc]
    def bwd_rows(X, Bm, Cm, DY, DTP, CUM, STATES, DC, AUX, s, nc, xs_b, xs_t, bs_b, bs_t, cs_b, cs_t, ys_b, ys_t,  # type: ignore[no-untyped-def]
                 H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, L: tl.constexpr,
                 BM: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, DOT: tl.constexpr,
                 DOT2: tl.constexpr):  # fmt: skip
        # rows i of the chunk: dC_i (per head) and the plus part of d cum_i (AUX row 4)
        blk, c, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = bh // H, bh % H
        g = h // (H // G)
        p, n = tl.arange(0, BP), tl.arange(0, BN)
        pm, nm = p < P, n < N
        X += b.to(tl.int64) * xs_b + h * P  # the inputs through their batch and position strides
        DY += b.to(tl.int64) * ys_b + h * P
        Bm += b.to(tl.int64) * bs_b + g * N
        Cm += b.to(tl.int64) * cs_b + g * N
        ri = blk * BM + tl.arange(0, BM)
        ti = c * L + ri
        mi = (ri < L) & (ti < s)
        bti = (b * s + ti).to(tl.int64)
        ti64 = ti.to(tl.int64)
        row = bh.to(tl.int64) * s
        # the input tiles stay in their dtype until used (exact: 16-bit to float32), so fewer registers hold them
        ci = tl.load(Cm + (ti64 * cs_t)[:, None] + n[None, :], mask=mi[:, None] & nm[None, :], other=0.0)
        dyi = tl.load(DY + (ti64 * ys_t)[:, None] + p[None, :], mask=mi[:, None] & pm[None, :], other=0.0)
        cui = tl.load(CUM + row + ti, mask=mi, other=0.0)
        ei = tl.exp(tl.where(mi, cui, float("-inf")))
        so = ((b * nc + c) * H + h).to(tl.int64) * (P * N) + p[:, None] * N + n[None, :]
        st = tl.load(STATES + so, mask=pm[:, None] & nm[None, :], other=0.0)
        dci = tl.dot(dyi.to(DOT).to(DOT2), st.to(DOT).to(DOT2), input_precision=PREC) * ei[:, None]
        plus = (
            tl.sum(
                dyi.to(tl.float32) * tl.dot(ci.to(DOT).to(DOT2), tl.trans(st).to(DOT).to(DOT2), input_precision=PREC),
                axis=1,
            )
            * ei
        )
        for k in range(0, (blk + 1) * BM, BM):
            rj = k + tl.arange(0, BM)
            tj = c * L + rj
            mj = (rj < L) & (tj < s)
            tj64 = tj.to(tl.int64)
            bj = tl.load(Bm + (tj64 * bs_t)[:, None] + n[None, :], mask=mj[:, None] & nm[None, :], other=0.0)
            xj = tl.load(X + (tj64 * xs_t)[:, None] + p[None, :], mask=mj[:, None] & pm[None, :], other=0.0)
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
    def dt_bwd(DT, BIAS, A, DTP, AUX, TPART, DDT, PARTS, s, nc, nt, dts_b, dts_t, lo, hi, H: tl.constexpr,  # type: ignore[no-untyped-def]
               L: tl.constexpr, BL: tl.constexpr, BT: tl.constexpr, NB: tl.constexpr, BM: tl.constexpr,
               PLUS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):  # fmt: skip
        # d cum -> d (dt A) (a reverse cumulative sum) -> d dt, d A; then through the clamp and softplus to d dt_raw.
        # AUX rows: 0 d dt (x . inner), 1 w (minus d cum, plus d cum_last), 2 sum_p dy x, 3 (PLUS_STATE) plus d
        # cum, then NB rows of plus d cum and NB of minus d cum, partial sums over blocks of BM positions: row 4 + k
        # holds block k's columns' part of the rows in blocks >= k, row 4 + NB + k block k's rows' part of the
        # columns in blocks <= k
        c, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        r = tl.arange(0, BL)
        t = c * L + r
        m = (r < L) & (t < s)
        row = AUX + bh.to(tl.int64) * s + t
        stride = tl.num_programs(1) * s
        ddt = tl.load(row, mask=m, other=0.0)
        w = tl.load(row + stride, mask=m, other=0.0)
        dcum = -w
        if PLUS_STATE:
            dcum += tl.load(row + 3 * stride, mask=m, other=0.0)
        for k in tl.static_range(NB):
            dcum += tl.load(row + (4 + k) * stride, mask=m & (r // BM >= k), other=0.0)
            dcum -= tl.load(row + (4 + NB + k) * stride, mask=m & (r // BM <= k), other=0.0)
        tp = tl.load(TPART + ((b * nc + c) * H + h).to(tl.int64) * nt + tl.arange(0, BT), mask=tl.arange(0, BT) < nt)
        last = tl.sum(w) + tl.sum(tl.where(tl.arange(0, BT) < nt, tp, 0.0))
        da = tl.where(m, tl.sum(dcum) - tl.cumsum(dcum, axis=0) + dcum + last, 0.0)
        d = tl.load(DTP + bh.to(tl.int64) * s + t, mask=m, other=0.0)
        ddt += tl.load(A + h).to(tl.float32) * da
        z = tl.load(DT + b.to(tl.int64) * dts_b + t.to(tl.int64) * dts_t + h, mask=m, other=0.0).to(tl.float32)
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
        tl.store(DDT + ((b * s + t).to(tl.int64)) * H + h, dz.to(DDT.dtype.element_ty), mask=m)  # d dt: contiguous
        o = ((b * nc + c) * H + h).to(tl.int64)
        total = tl.num_programs(0) * tl.num_programs(1)
        tl.store(PARTS + o, tl.sum(d * da))
        tl.store(PARTS + total + o, tl.sum(dz))
        tl.store(PARTS + 2 * total + o, tl.sum(tl.load(row + 2 * stride, mask=m, other=0.0)))

    return {"dt_fwd": dt_fwd, "chunk_state": chunk_state, "state_pass": state_pass, "chunk_out": chunk_out,
            "bwd_cols": bwd_cols, "bwd_rows": bwd_rows, "dt_bwd": dt_bwd}  # fmt: skip
