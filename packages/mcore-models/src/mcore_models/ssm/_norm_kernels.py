"""The Triton kernels of :mod:`mcore_models.ssm.norm_triton` (the Mamba-2 mixer's gated RMSNorm, forward and
backward), imported on first use. The math and the launches are described there."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["KERNELS"]


@triton.jit  # type: ignore[misc]
def _row(T, r, nb, s_s, s_b, c, m):  # type: ignore[no-untyped-def]
    # row r of the [s, b] token grid (r = i_s * nb + i_b) of a tensor with those two strides, channels contiguous
    i_s, i_b = r // nb, r % nb
    return tl.load(T + i_s.to(tl.int64) * s_s + i_b.to(tl.int64) * s_b + c, mask=m, other=0.0).to(tl.float32)


@triton.jit  # type: ignore[misc]
def fwd(Y, Z, W, OUT, RSTD, nb, ys_s, ys_b, zs_s, zs_b, D, GS, eps,  # type: ignore[no-untyped-def]
        GATE_FIRST: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # one program per (row, group): OUT[r, group] = rmsnorm(h) * w (* silu(z) unless GATE_FIRST), h = y (* silu(z)
    # when GATE_FIRST); RSTD[r, group] = 1 / sqrt(mean(h^2) + eps)
    r, g = tl.program_id(0), tl.program_id(1)
    k = tl.arange(0, BLOCK)
    m = k < GS
    c = g * GS + k
    y = _row(Y, r, nb, ys_s, ys_b, c, m)
    z = _row(Z, r, nb, zs_s, zs_b, c, m)
    gate = z * tl.sigmoid(z)
    h = y * gate if GATE_FIRST else y
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / GS + eps)
    out = h * rstd * tl.load(W + c, mask=m, other=0.0).to(tl.float32)
    if not GATE_FIRST:
        out = out * gate
    tl.store(OUT + r.to(tl.int64) * D + c, out.to(OUT.dtype.element_ty), mask=m)
    tl.store(RSTD + r * tl.num_programs(1) + g, rstd)


@triton.jit  # type: ignore[misc]
def bwd(DO, Y, Z, W, RSTD, DY, DZ, PART, R, nb, dos_s, dos_b, ys_s, ys_b, zs_s, zs_b,  # type: ignore[no-untyped-def]
        dys_s, dys_b, D, GS, GATE_FIRST: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    # one program per (block of ROWS rows, group): DY (strides dys_*), DZ ([R, D] contiguous) and the block's partial
    # dw row (float32, PART[block, group's channels])
    pr, g = tl.program_id(0), tl.program_id(1)
    k = tl.arange(0, BLOCK)
    c = g * GS + k
    w = tl.load(W + c, mask=k < GS, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ROWS):
        r = pr * ROWS + i
        m = (k < GS) & (r + 0 * k < R)
        do = _row(DO, r, nb, dos_s, dos_b, c, m)
        y = _row(Y, r, nb, ys_s, ys_b, c, m)
        z = _row(Z, r, nb, zs_s, zs_b, c, m)
        rstd = tl.load(RSTD + tl.minimum(r, R - 1) * tl.num_programs(1) + g)  # rows past R: do = 0, nothing added
        sig = tl.sigmoid(z)
        gate = z * sig
        dgate = sig * (1.0 + z * (1.0 - sig))  # silu'(z)
        h = y * gate if GATE_FIRST else y
        n = h * rstd
        dn = do * w if GATE_FIRST else do * w * gate
        dh = rstd * (dn - n * (tl.sum(dn * n, axis=0) / GS))
        if GATE_FIRST:
            dy, dz = dh * gate, dh * y * dgate
            dw += do * n
        else:
            dy, dz = dh, do * n * w * dgate
            dw += do * n * gate
        i_s, i_b = r // nb, r % nb
        tl.store(DY + i_s.to(tl.int64) * dys_s + i_b.to(tl.int64) * dys_b + c, dy.to(DY.dtype.element_ty), mask=m)
        tl.store(DZ + r.to(tl.int64) * D + c, dz.to(DZ.dtype.element_ty), mask=m)
    tl.store(PART + pr.to(tl.int64) * D + c, dw, mask=k < GS)


KERNELS = {"fwd": fwd, "bwd": bwd}
