"""The SSD scan's pass over chunks taking several chunks a step (``ssd_triton.PASS_CHUNKS`` > 1), at module level
so that the kernel can call its scan's combine function (Triton's interpreter resolves a kernel's callees among its
module's globals); imported on first use.

The pass is the linear recurrence ``state_{k+1} = dec_k state_k + v_k`` over the chunks (in reverse for the
backward). The one-chunk kernel (``state_pass`` of :mod:`mcore_models.ssm._ssd_kernels`) is a chain of ``nc``
dependent steps, each waiting on one chunk's loads. This one loads ``KC`` chunks at once and composes their steps with
an associative scan (``(a1, b1) then (a2, b2)`` is ``(a1 a2, a2 b1 + b2)``), so ``KC`` chunks' loads are in flight
together and the chain is ``nc / KC`` steps long. The products are the same; only their order differs.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["state_pass_blocks"]


@triton.jit  # type: ignore[misc]
def _compose(a1, b1, a2, b2):  # type: ignore[no-untyped-def]
    # x -> a1 x + b1, then x -> a2 x + b2
    return a1 * a2, a2 * b1 + b2


@triton.jit  # type: ignore[misc]
def state_pass_blocks(BUF, INIT, FINAL, CUM, STATES, TPART, s, nc, H: tl.constexpr, PN: tl.constexpr,  # type: ignore[no-untyped-def]
                      L: tl.constexpr, BS: tl.constexpr, KC: tl.constexpr, HAS_INIT: tl.constexpr,
                      REVERSE: tl.constexpr):  # fmt: skip
    # as state_pass: forward, BUF[c] holds S_c and is overwritten with state_in_c, FINAL = state_in_nc; REVERSE,
    # BUF[c] holds the direct gradient of state_in_c and is overwritten with the gradient of S_c, FINAL = d initial
    # states, TPART gets this tile's part of exp(cum_last) <d state_in_{c+1}, state_in_c> (STATES: the forward's BUF)
    bh, tile = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    e = tile * BS + tl.arange(0, BS)
    m = e < PN
    st = tl.zeros([BS], dtype=tl.float32)
    if HAS_INIT:
        st = tl.load(INIT + bh.to(tl.int64) * PN + e, mask=m, other=0.0).to(tl.float32)
    row = bh.to(tl.int64) * s
    kk = tl.arange(0, KC)
    prev = tl.broadcast_to(tl.maximum(kk - 1, 0)[:, None], (KC, BS))  # each step's predecessor in the block
    for i in range(0, nc, KC):
        j = i + kk  # the steps of this block, in the pass's order
        ok = j < nc
        if REVERSE:
            j = nc - 1 - j
        c = tl.where(ok, j, 0)
        o = (((b * nc + c) * H + h).to(tl.int64) * PN)[:, None] + e[None, :]
        om = ok[:, None] & m[None, :]
        v = tl.load(BUF + o, mask=om, other=0.0)  # steps past the last: v 0, dec 1 (the identity)
        dec = tl.exp(tl.load(CUM + row + tl.minimum(c * L + L, s) - 1, mask=ok, other=0.0))
        a, bb = tl.associative_scan((tl.broadcast_to(dec[:, None], (KC, BS)), v), 0, _compose)
        after = a * st[None, :] + bb  # the state after each step
        before = tl.where(kk[:, None] == 0, st[None, :], tl.gather(after, prev, 0))  # ... and before it
        tl.store(BUF + o, before, mask=om)
        if REVERSE:
            fwd = tl.load(STATES + o, mask=om, other=0.0)
            t = ((b * nc + c) * H + h).to(tl.int64) * tl.num_programs(1) + tile
            tl.store(TPART + t, dec * tl.sum(before * fwd, axis=1), mask=ok)
        st = tl.sum(tl.where(kk[:, None] == KC - 1, after, 0.0), axis=0)
    tl.store(FINAL + bh.to(tl.int64) * PN + e, st, mask=m)
