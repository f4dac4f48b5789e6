"""The SSD scan's backward with the products through ``B`` and ``C`` taken once per group
(``ssd_triton.BACKWARD = "groups"``), built on first use.

Within a chunk, ``y_i`` gets ``sum_{j<=i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j`` from every head of the group of
``B`` and ``C``. So the gradients of ``C_i`` and ``B_j`` through that term are ``dCB . B`` and ``dCBᵀ . C`` with one
``L x L`` matrix per group and chunk, ``dCB[i, j] = sum_h (dy_i . x_j) exp(cum_i - cum_j) dt_j`` (:func:`bwd_dcb`
sums it over the heads), instead of two ``[rows, N]`` products per head and pair of blocks. Their terms through the
chunk's states (``exp(cum_i) dy_i . state_in`` for ``C``, ``exp(cum_last - cum_j) dt_j x_j . dS`` for ``B``) are
one product each over the group's heads (:func:`bwd_dbdc`). Each head's ``dx`` comes from ``bwd_cols`` of
:mod:`mcore_models.ssm._ssd_kernels` without its ``dB`` part.

The gradient of ``cum`` takes, per head, the row and column sums of ``(dy_i . x_j) exp(cum_i - cum_j) dt_j (C_i .
B_j)`` (:func:`bwd_dcb`, one partial row per block of the other index: ``AUX`` rows ``4 + k`` and ``4 + NB + k``)
and the row sums of the state terms above times ``C_i`` and ``B_j`` (:func:`bwd_dbdc`, ``AUX`` rows 3 and 1); the
scan's ``dt_bwd`` adds them up.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["kernels"]


@functools.cache
def kernels() -> dict[str, Any]:
    """The kernels by name (Triton is imported by :func:`mcore_models.ssm._ssd_kernels.kernels` first)."""
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[misc]
    def bwd_dcb(X, Bm, Cm, DY, DTP, CUM, DCB, AUX, s, nc, xs_b, xs_t, bs_b, bs_t, cs_b, cs_t, ys_b, ys_t,  # type: ignore[no-untyped-def]
                H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, L: tl.constexpr,
                BM: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, PREC: tl.constexpr,
                DOT: tl.constexpr, DOT2: tl.constexpr):  # fmt: skip
        # one block pair (rows bi >= columns bj) of one chunk and group: dCB's block summed over the group's heads,
        # and per head the plus (rows) and q dt (columns) partial sums of d cum
        pair, c, bg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        bi = 0
        for k in tl.static_range(1, NB):  # the pairs in order (0, 0), (1, 0), (1, 1), (2, 0), ...
            bi += (pair >= k * (k + 1) // 2).to(tl.int32)
        bj = pair - bi * (bi + 1) // 2
        b, g = bg // G, bg % G
        p, n = tl.arange(0, BP), tl.arange(0, BN)
        pm, nm = p < P, n < N
        ri, rj = bi * BM + tl.arange(0, BM), bj * BM + tl.arange(0, BM)
        ti, tj = c * L + ri, c * L + rj
        mi, mj = (ri < L) & (ti < s), (rj < L) & (tj < s)
        ti64, tj64 = ti.to(tl.int64), tj.to(tl.int64)
        ci = tl.load(Cm + b.to(tl.int64) * cs_b + g * N + (ti64 * cs_t)[:, None] + n[None, :],
                     mask=mi[:, None] & nm[None, :], other=0.0)  # fmt: skip
        bv = tl.load(Bm + b.to(tl.int64) * bs_b + g * N + (tj64 * bs_t)[:, None] + n[None, :],
                     mask=mj[:, None] & nm[None, :], other=0.0)  # fmt: skip
        cb = tl.dot(ci.to(DOT).to(DOT2), tl.trans(bv).to(DOT).to(DOT2), input_precision=PREC)  # [i, j]
        keep = (ri[:, None] >= rj[None, :]) & mi[:, None] & mj[None, :]
        dcb = tl.zeros([BM, BM], dtype=tl.float32)
        rows = tl.num_programs(2) // G * H * s  # one AUX row: b * H * s
        for hh in range(0, H // G):
            h = g * (H // G) + hh
            row = (b * H + h).to(tl.int64) * s
            cui = tl.load(CUM + row + ti, mask=mi, other=0.0)
            cuj = tl.load(CUM + row + tj, mask=mj, other=0.0)
            dtj = tl.load(DTP + row + tj, mask=mj, other=0.0)
            dyi = tl.load(DY + b.to(tl.int64) * ys_b + h * P + (ti64 * ys_t)[:, None] + p[None, :],
                          mask=mi[:, None] & pm[None, :], other=0.0)  # fmt: skip
            xj = tl.load(X + b.to(tl.int64) * xs_b + h * P + (tj64 * xs_t)[:, None] + p[None, :],
                         mask=mj[:, None] & pm[None, :], other=0.0)  # fmt: skip
            dec = tl.exp(tl.where(keep, cui[:, None] - cuj[None, :], float("-inf")))
            md = tl.dot(dyi.to(DOT).to(DOT2), tl.trans(xj).to(DOT).to(DOT2), input_precision=PREC) * dec * dtj[None, :]
            dcb += md
            t = md * cb
            tl.store(AUX + (4 + bj) * rows + row + ti, tl.sum(t, axis=1), mask=mi)
            tl.store(AUX + (4 + NB + bi) * rows + row + tj, tl.sum(t, axis=0), mask=mj)
        o = ((b * nc + c) * G + g).to(tl.int64) * (L * L) + ri[:, None] * L + rj[None, :]
        tl.store(DCB + o, dcb, mask=(ri < L)[:, None] & (rj < L)[None, :])

    @triton.jit  # type: ignore[misc]
    def bwd_dbdc(R, Q, E, DCB, CUM, DTP, ST, OUT, AUX, s, nc, r_b, r_t, q_b, q_t, e_b, e_t,  # type: ignore[no-untyped-def]
                 H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, L: tl.constexpr,
                 BM: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, FOR_B: tl.constexpr,
                 PREC: tl.constexpr, DOT: tl.constexpr, DOT2: tl.constexpr):  # fmt: skip
        # one block of rows of one chunk and group. dC (FOR_B false): R = dy, Q = B, E = C, ST the chunk's state_in;
        # dC_r = sum_{k<=r} dCB[r, k] B_k + sum_h exp(cum_r) dy_r,h . ST_h, and AUX row 3 = the state term times C_r
        # summed over N. dB: R = x, Q = C, E = B, ST the gradient of the chunk's state; dB_r = sum_{k>=r} dCB[k, r]ᵀ
        # C_k + sum_h exp(cum_last - cum_r) dt_r x_r,h . ST_h, and AUX row 1 = the state term times B_r summed
        blk, c, bg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, g = bg // G, bg % G
        p, n = tl.arange(0, BP), tl.arange(0, BN)
        pm, nm = p < P, n < N
        rr = blk * BM + tl.arange(0, BM)
        tr = c * L + rr
        mr = (rr < L) & (tr < s)
        tr64 = tr.to(tl.int64)
        cbo = ((b * nc + c) * G + g).to(tl.int64) * (L * L)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        if FOR_B:
            lo, hi, out_row = blk, NB, 1
        else:
            lo, hi, out_row = 0, blk + 1, 3
        for kb in range(lo, hi):
            rk = kb * BM + tl.arange(0, BM)
            tk = c * L + rk
            mk = (rk < L) & (tk < s)
            qk = tl.load(Q + b.to(tl.int64) * q_b + g * N + (tk.to(tl.int64) * q_t)[:, None] + n[None, :],
                         mask=mk[:, None] & nm[None, :], other=0.0)  # fmt: skip
            if FOR_B:  # the block (kb, blk) of dCB, transposed: [r, k]
                d = tl.trans(tl.load(DCB + cbo + rk[:, None] * L + rr[None, :], mask=mk[:, None] & mr[None, :],
                                     other=0.0))  # fmt: skip
            else:
                d = tl.load(DCB + cbo + rr[:, None] * L + rk[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
            acc += tl.dot(d.to(DOT).to(DOT2), qk.to(DOT).to(DOT2), input_precision=PREC)
        er = tl.load(E + b.to(tl.int64) * e_b + g * N + (tr64 * e_t)[:, None] + n[None, :],
                     mask=mr[:, None] & nm[None, :], other=0.0).to(tl.float32)  # fmt: skip
        rows = tl.num_programs(2) // G * H * s  # one AUX row: b * H * s
        for hh in range(0, H // G):
            h = g * (H // G) + hh
            row = (b * H + h).to(tl.int64) * s
            cur = tl.load(CUM + row + tr, mask=mr, other=0.0)
            if FOR_B:
                last = tl.load(CUM + row + tl.minimum(c * L + L, s) - 1)
                w = tl.exp(tl.where(mr, last - cur, float("-inf"))) * tl.load(DTP + row + tr, mask=mr, other=0.0)
            else:
                w = tl.exp(tl.where(mr, cur, float("-inf")))
            rv = tl.load(R + b.to(tl.int64) * r_b + h * P + (tr64 * r_t)[:, None] + p[None, :],
                         mask=mr[:, None] & pm[None, :], other=0.0)  # fmt: skip
            so = ((b * nc + c) * H + h).to(tl.int64) * (P * N) + p[:, None] * N + n[None, :]
            st = tl.load(ST + so, mask=pm[:, None] & nm[None, :], other=0.0)
            term = tl.dot(rv.to(DOT).to(DOT2), st.to(DOT).to(DOT2), input_precision=PREC) * w[:, None]
            acc += term
            tl.store(AUX + out_row * rows + row + tr, tl.sum(term * er, axis=1), mask=mr)
        o = ((b * s + tr).to(tl.int64) * G + g)[:, None] * N + n[None, :]  # dB, dC: contiguous [b, s, G, N]
        tl.store(OUT + o, acc.to(OUT.dtype.element_ty), mask=mr[:, None] & nm[None, :])

    return {"bwd_dcb": bwd_dcb, "bwd_dbdc": bwd_dbdc}
