"""A Triton kernel for attention over the paged KV cache, reading blocks in place (no gather into a copy).

One program per (query token, key/value group): it loads the group's query heads, walks the token's request's
block table up to the token's context length with an online softmax, and writes the heads' outputs. Decode tokens
and prefill chunks use the same kernel: a prefill token at position ``p`` has context length ``p + 1`` (its own
key/value was written to the cache before the call). Works under CUDA-graph capture (no host syncs).

Small decode batches (batch 1 gives only ``groups`` programs, a few of the GPU's 132 SMs) split each token's blocks
among several programs (flash-decoding); each writes its partial softmax state (running max, sum, unnormalised
output) and a second kernel combines them. In such split decode steps each program loads its first block of cached
keys and values before it waits for the kernel that writes the queries (a programmatic dependent launch): earlier
steps wrote those, so the block's two dependent loads (block table, then cache) overlap the QKV projection.
``store_kv_triton`` writes a step's keys and values into the cache in one kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mcore_infer._attention_host import (
    AttentionLaunch,
    _check_kv,
    _pow2,
    _query_layout,
    _rotary_rows,
    _sm_count,
    _split_scratch,
    default_launch,
    num_splits,
)
from mcore_infer.errors import MissingDependencyError
from mcore_infer.kernels import l2_prefetch
from mcore_infer.kernels._counters import zeroed_counters
from mcore_infer.kernels.norm_linear import gdc_launch

__all__ = ["num_splits", "paged_attention_triton", "store_kv_triton", "triton_available"]

_KERNEL: Any = None
_prefetch_l2: Any = None  # l2_prefetch's helper (set when the kernels are made: Triton looks callees up in globals)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    try:
        import triton
        import triton.language as tl
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError as e:
        raise MissingDependencyError("triton", "gpu") from e

    @triton.jit  # type: ignore[misc]
    def _rotate(x, row, mask, cos_row, sin_row, d, ROT: tl.constexpr):  # type: ignore[no-untyped-def]
        """``x * cos + rotate_half(x) * sin`` over dims ``< ROT`` of ``x`` (loaded from ``row + d``), rounded to
        ``x``'s dtype as the unfused path rounds its rotated tensors; dims ``>= ROT`` pass through."""
        half: tl.constexpr = ROT // 2
        in_rot = d < ROT
        partner = tl.where(in_rot, (d + half) % ROT, d)
        x_p = tl.load(row + partner, mask=mask, other=0.0).to(tl.float32)
        cos = tl.load(cos_row + d, mask=in_rot, other=1.0).to(tl.float32)
        sin = tl.load(sin_row + d, mask=in_rot, other=0.0).to(tl.float32)
        sign = tl.where(d < half, -1.0, 1.0)
        return (x.to(tl.float32) * cos + sign * x_p * sin).to(x.dtype)

    @triton.jit  # type: ignore[misc]
    def _combine_group(Out, PM, PL, PACC, t, heads, hmask, d, stride_ot, stride_oh, active,  # type: ignore[no-untyped-def]
                       HEADS: tl.constexpr, HPG_PAD: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):  # fmt: skip
        """The outputs of one group's ``heads`` from the partial softmax states of their first ``active`` splits
        (``combine``'s formula, the splits' outputs added in split order), read from L2 (``.cg``: other programs
        wrote them)."""
        sp = tl.arange(0, SPLITS)
        rows = (t * HEADS + heads)[:, None] * SPLITS + sp[None, :]  # [heads, splits]
        live = hmask[:, None] & (sp[None, :] < active)
        m = tl.load(PM + rows, mask=live, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(PL + rows, mask=live, other=0.0, cache_modifier=".cg")
        m_max = tl.max(m, 1)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a padded graph row attends to nothing
        w = tl.exp(m - m_max[:, None])
        den = tl.sum(l_s * w, 1)
        num = tl.zeros([HPG_PAD, D], tl.float32)
        for s in tl.static_range(SPLITS):
            w_s = tl.sum(tl.where(sp[None, :] == s, w, 0.0), 1)
            part = tl.load(PACC + ((t * HEADS + heads) * SPLITS + s)[:, None] * D + d[None, :],
                           mask=hmask[:, None] & ((s + 0 * d[None, :]) < active), other=0.0,
                           cache_modifier=".cg")  # fmt: skip
            num += part * w_s[:, None]
        out = tl.where(den[:, None] > 0, num / tl.where(den > 0, den, 1.0)[:, None], 0.0)
        tl.store(Out + t * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
                 mask=hmask[:, None])  # fmt: skip

    @triton.jit  # type: ignore[misc]
    def _attend_block(q, k, v, start, cached, offs, m_i, l_i, acc, scale, IEEE: tl.constexpr):  # type: ignore[no-untyped-def]
        """The online softmax state after the block of keys ``k`` and values ``v`` at positions ``start + offs``
        (those at or past ``cached`` masked out)."""
        if IEEE:  # float32 caches: exact products (no TF32), as the plain path computes
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
        s = tl.where((start + offs)[None, :] < cached, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        return m_new, l_i, acc

    @triton.jit  # type: ignore[misc]
    def _kv_tile(K, V, bt_row, j0, last, offs, d, g, stride_kb, stride_ks, stride_kg,  # type: ignore[no-untyped-def]
                 BLOCK: tl.constexpr, STEP: tl.constexpr, MASK: tl.constexpr):  # fmt: skip
        """Keys and values ``[STEP * BLOCK, D]`` of group ``g`` in the cache blocks ``j0 ..`` of the block-table
        row ``bt_row`` (``offs``: the tile's token offsets); with ``MASK`` the blocks from ``last`` on read as
        zeros (else every block of the tile is below ``last``)."""
        if STEP == 1:
            if MASK:
                live = (offs[:, None] + 0 * d[None, :]) < tl.where(j0 < last, BLOCK, 0)
                blk = tl.load(bt_row + tl.where(j0 < last, j0, 0)).to(tl.int64)
            else:
                blk = tl.load(bt_row + j0).to(tl.int64)
            base = blk * stride_kb + offs[:, None] * stride_ks + g * stride_kg + d[None, :]
        else:  # several blocks: each token's block id gathered from the table (one load for the whole tile)
            jb = j0 + offs // BLOCK
            live = (jb[:, None] + 0 * d[None, :]) < last
            blk = tl.load(bt_row + tl.where(jb < last, jb, 0)).to(tl.int64)
            base = blk[:, None] * stride_kb + (offs % BLOCK)[:, None] * stride_ks + g * stride_kg + d[None, :]
        if MASK or STEP > 1:
            k = tl.load(K + base, mask=live, other=0.0)
            v = tl.load(V + base, mask=live, other=0.0)
        else:
            k = tl.load(K + base)
            v = tl.load(V + base)
        return k, v

    globals()["_rotate"] = _rotate  # Triton resolves a kernel's callees among its module's globals
    globals()["_combine_group"] = _combine_group
    globals()["_attend_block"] = _attend_block
    globals()["_kv_tile"] = _kv_tile
    globals()["_prefetch_l2"] = l2_prefetch.helper()

    @triton.jit  # type: ignore[misc]
    def attend(  # type: ignore[no-untyped-def]
        Q,
        K,
        V,
        Out,
        PM,
        PL,
        PACC,
        BT,
        TSEQ,
        TCTX,
        COS,
        SIN,
        KIN,
        VIN,
        SLOTS,
        CNT,
        PF,
        pf_bytes,
        PF2,
        pf2_bytes,
        scale,
        stride_qt,
        stride_qg,
        stride_qh,
        stride_ct,
        stride_kin_t,
        stride_kin_g,
        stride_vin_t,
        stride_vin_g,
        stride_kb,
        stride_ks,
        stride_kg,
        stride_bt,
        stride_ot,
        stride_oh,
        HEADS: tl.constexpr,
        HPG: tl.constexpr,
        HPG_PAD: tl.constexpr,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        SPLITS: tl.constexpr,
        IEEE: tl.constexpr,
        ROT: tl.constexpr,
        NEW_KV: tl.constexpr,
        GDC: tl.constexpr,
        FOLD: tl.constexpr,
        PRE: tl.constexpr,
        STEP: tl.constexpr,
        SKIP: tl.constexpr,
        MIN_PER: tl.constexpr,
        PF_ROWS: tl.constexpr,
        PF_ASM: tl.constexpr,
    ):
        t = tl.program_id(0)
        g = tl.program_id(1)
        split = tl.program_id(2)
        if GDC:  # (a programmatic dependent launch: the step's metadata is read before the wait, q after it)
            gdc_launch_dependents()
        if PF_ROWS > 0:
            first_pf = tl.num_programs(0) - PF_ROWS
            if t >= first_pf:
                if GDC:
                    gdc_wait()  # (not before: the kernel before this one streams its own weight)
                if t == first_pf:
                    _prefetch_l2(PF, pf_bytes, g * SPLITS + split, tl.num_programs(1) * SPLITS, PF_ASM)
                else:
                    _prefetch_l2(PF2, pf2_bytes, g * SPLITS + split, tl.num_programs(1) * SPLITS, PF_ASM)
                return
        seq = tl.load(TSEQ + t)
        ctx = tl.load(TCTX + t)
        offs = tl.arange(0, STEP * BLOCK)  # token offsets of a loop step's tile of STEP blocks
        d = tl.arange(0, D)
        if NEW_KV:  # decode: this token's own key/value come from the inputs; the cache holds the ones before it
            cached = ctx - 1
        else:
            cached = ctx  # keys read from the cache
        num_blocks = (cached + BLOCK - 1) // BLOCK
        per_split = (num_blocks + SPLITS - 1) // SPLITS  # this program's share of the token's blocks
        if MIN_PER > 1:  # a short context goes to fewer splits (the rest have no block)
            per_split = tl.maximum(per_split, MIN_PER)
        if STEP > 1:  # whole tiles: a split's last tile ends at its last block or at the context's end
            per_split = (per_split + STEP - 1) // STEP * STEP
        first = split * per_split
        last = tl.minimum(num_blocks, first + per_split)
        if SKIP:  # (FOLD) splits with no blocks take no part: the last of the first `active` to finish combines
            active = tl.maximum(1, (num_blocks + per_split - 1) // tl.maximum(per_split, 1))
            if split >= active:
                return
        else:
            active = SPLITS
        bt_row = BT + seq * stride_bt
        if PRE:  # (decode steps, NEW_KV) earlier steps wrote the cached keys and values: this program's first tile
            # is loaded before the wait, while the kernel that writes q finishes (a prefill's keys may be this step's)
            k_pre, v_pre = _kv_tile(K, V, bt_row, first, last, offs, d, g, stride_kb, stride_ks, stride_kg, BLOCK,
                                    STEP, True)  # fmt: skip
        if GDC:
            gdc_wait()
        h = tl.arange(0, HPG_PAD)
        hmask = h < HPG
        heads = g * HPG + h
        q_row = Q + t * stride_qt + g * stride_qg + h[:, None] * stride_qh
        q = tl.load(q_row + d[None, :], mask=hmask[:, None], other=0.0)
        if ROT > 0:  # RoPE (rotate-half over the first ROT dims) applied here instead of in a kernel of its own
            q = _rotate(q, q_row, hmask[:, None], COS + t * stride_ct, SIN + t * stride_ct, d, ROT)
        m_i = tl.full([HPG_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([HPG_PAD], tl.float32)
        acc = tl.zeros([HPG_PAD, D], tl.float32)
        if NEW_KV:  # split 0 also writes the new key/value to the cache
            kin_row = KIN + t * stride_kin_t + g * stride_kin_g
            k_new = tl.load(kin_row + d)
            if ROT > 0:
                k_new = _rotate(k_new, kin_row, d < D, COS + t * stride_ct, SIN + t * stride_ct, d, ROT)
            k_new = k_new.to(K.dtype.element_ty)
            v_new = tl.load(VIN + t * stride_vin_t + g * stride_vin_g + d).to(V.dtype.element_ty)
            owner = split == 0
            slot = tl.load(SLOTS + t).to(tl.int64)
            tl.store(K + slot * stride_ks + g * stride_kg + d, k_new, mask=tl.where(owner, d < D, False))
            tl.store(V + slot * stride_ks + g * stride_kg + d, v_new, mask=tl.where(owner, d < D, False))
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale
            has_new = owner & (ctx > 0)
            m_i = tl.where(has_new, s_new, m_i)
            l_i = tl.where(has_new, 1.0, l_i)
            acc = tl.where(has_new, tl.zeros([HPG_PAD, D], tl.float32) + v_new.to(tl.float32)[None, :], acc)
        if PRE:
            if first < last:
                m_i, l_i, acc = _attend_block(q, k_pre, v_pre, first * BLOCK, cached, offs, m_i, l_i, acc, scale, IEEE)
            first += STEP
        for j in range(first, last, STEP):
            k, v = _kv_tile(K, V, bt_row, j, last, offs, d, g, stride_kb, stride_ks, stride_kg, BLOCK, STEP, False)
            m_i, l_i, acc = _attend_block(q, k, v, j * BLOCK, cached, offs, m_i, l_i, acc, scale, IEEE)
        single = SPLITS == 1
        if SKIP:  # one split with blocks (a short context): it writes the output itself, no partial state
            single = active == 1
        if single:
            denom = tl.where(l_i > 0, l_i, 1.0)
            out = acc / denom[:, None]
            tl.store(
                Out + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
                out.to(Out.dtype.element_ty),
                mask=hmask[:, None],
            )
        else:  # partial softmax state of this split: [t, head, split] maxima and sums, [t, head, split, d] outputs
            row = (t * HEADS + heads) * SPLITS + split
            tl.store(PM + row, m_i, mask=hmask)
            tl.store(PL + row, l_i, mask=hmask)
            tl.store(PACC + row[:, None] * D + d[None, :], acc, mask=hmask[:, None])
            if FOLD:  # the last of the group's splits to finish combines them (no second kernel)
                tl.debug_barrier()  # every thread's partial stored before the counter is released
                counter = CNT + t * tl.num_programs(1) + g
                if tl.atomic_add(counter, 1, sem="acq_rel") == active - 1:
                    _combine_group(Out, PM, PL, PACC, t, heads, hmask, d, stride_ot, stride_oh, active, HEADS, HPG_PAD,
                                   D, SPLITS)  # fmt: skip
                    tl.atomic_xchg(counter, 0)  # ready for the next call (a CUDA graph replays the same counters)

    @triton.jit  # type: ignore[misc]
    def combine(  # type: ignore[no-untyped-def]
        Out, PM, PL, PACC, stride_ot, stride_oh, HEADS: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
        GDC: tl.constexpr
    ):  # fmt: skip
        if GDC:
            gdc_launch_dependents()
            gdc_wait()
        t = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.arange(0, SPLITS)
        d = tl.arange(0, D)
        row = (t * HEADS + h) * SPLITS + sp
        m = tl.load(PM + row)
        l_s = tl.load(PL + row)
        acc = tl.load(PACC + row[:, None] * D + d[None, :])
        m_max = tl.max(m, 0)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a padded graph row attends to nothing
        w = tl.exp(m - m_max)
        num = tl.sum(acc * w[:, None], 0)
        den = tl.sum(l_s * w, 0)
        out = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
        tl.store(Out + t * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty))

    @triton.jit  # type: ignore[misc]
    def store_kv(  # type: ignore[no-untyped-def]
        Kin,
        Vin,
        K,
        V,
        SLOTS,
        COS,
        SIN,
        stride_kt,
        stride_kg,
        stride_vt,
        stride_vg,
        stride_slot,
        stride_ct,
        GD_PAD: tl.constexpr,
        G: tl.constexpr,
        D: tl.constexpr,
        ROT: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(SLOTS + t).to(tl.int64)
        i = tl.arange(0, GD_PAD)
        mask = i < G * D
        g, d = i // D, i % D
        k_row = Kin + t * stride_kt + g * stride_kg
        k = tl.load(k_row + d, mask=mask)
        if ROT > 0:
            k = _rotate(k, k_row, mask, COS + t * stride_ct, SIN + t * stride_ct, d, ROT)
        v = tl.load(Vin + t * stride_vt + g * stride_vg + d, mask=mask)
        tl.store(K + slot * stride_slot + i, k.to(K.dtype.element_ty), mask=mask)
        tl.store(V + slot * stride_slot + i, v.to(V.dtype.element_ty), mask=mask)

    _KERNEL = (attend, combine, store_kv)
    return _KERNEL


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_seq: torch.Tensor,
    token_ctx: torch.Tensor,
    scale: float,
    splits: int | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    pdl: bool = False,
    fold: bool = False,
    launch: AttentionLaunch | None = None,
    prefetch: Sequence[l2_prefetch.Region] | None = None,
) -> torch.Tensor:
    """``q`` ``[T, heads, d]`` or grouped ``[T, groups, heads / groups, d]`` (any strides but a unit-stride head dim:
    a view into the QKV projection's output is read in place); caches ``[blocks, block_size, groups, d]``;
    ``block_tables`` ``[S, max_blocks]``; ``token_seq``/``token_ctx`` ``[T]`` (row of the block table, keys to
    attend). Returns ``[T, heads, d]``.

    ``splits`` (a power of two; default :func:`num_splits`) divides each token's blocks among that many programs,
    whose partial softmax states a second kernel combines: small decode batches then keep every SM busy.
    ``rotary`` (cos, sin of each token's position, ``[T, 1, 1, rot]``) rotates the queries as they are loaded.
    ``new_kv`` (keys, values ``[T, groups, d]``, cache slots ``[T]``), for decode steps only (each token the one new
    token of its request): the tokens' own keys/values are taken from there (rotated with ``rotary``) and written to
    the cache by the same kernel, instead of a :func:`store_kv_triton` call first.
    ``pdl``: both kernels launched as programmatic dependents on Hopper and later (each starts while the kernel
    before it finishes, and reads that kernel's output after waiting for it).
    ``fold``: with splits, the last split of each (token, group) to finish combines the group's partial states
    (a per-(token, group) counter taken with an atomic add, reset by that program), so no second kernel runs; the
    counters are zeroed once per device and kept (:func:`~mcore_infer.kernels._counters.zeroed_counters`). Inside
    a CUDA-graph capture that finds no counters large enough, the combine kernel runs instead.
    ``launch`` (:class:`~mcore_infer._attention_host.AttentionLaunch`; None: :func:`default_launch` of the step's
    token count): the blocks per loop step, the cap on :func:`num_splits`, whether a folded combine skips splits that
    get no block, the warps and the fewest blocks a split takes.
    ``prefetch``: up to two (tensor, bytes) regions (the next kernels' weights) that rows of programs added to the
    grid pull into L2 while the others attend (:mod:`~mcore_infer.kernels.l2_prefetch`; no value changes)."""
    _, block_size, groups, _ = k_cache.shape
    q, hpg, stride_qg, stride_qh = _query_layout(q, groups)
    t, d = q.shape[0], q.shape[-1]
    launch = default_launch(t) if launch is None else launch.checked()
    heads = hpg * groups
    out = torch.empty(t, heads, d, device=q.device, dtype=q.dtype)
    if t == 0:
        return out
    if splits is None:
        splits = num_splits(t, groups, block_tables.shape[1], _sm_count(q.device), launch.max_splits)
    if splits & (splits - 1):
        raise ValueError(f"splits={splits}: must be a power of two")
    cos, sin, stride_ct, rot = _rotary_rows(rotary, t, d, out)
    if new_kv is not None:
        k_in, v_in, slots = new_kv
        _check_kv(k_in, v_in, k_cache, v_cache, "new_kv")
    else:
        k_in = v_in = slots = out  # unused
    attend, combine, _ = _kernel()
    pm, pl, pacc = _split_scratch(out, splits)
    counters = zeroed_counters(q.device, t * groups, "attention") if fold and splits > 1 else None
    pf = l2_prefetch.prefetch_args(prefetch, out)
    # fmt: off
    attend[(t + pf["PF_ROWS"], groups, splits)](
        q, k_cache, v_cache, out, pm, pl, pacc, block_tables, token_seq, token_ctx, cos, sin, k_in, v_in, slots,
        counters if counters is not None else slots, *(pf.pop(k) for k in ("PF", "pf_bytes", "PF2", "pf2_bytes")),
        scale, q.stride(0),
        stride_qg, stride_qh, stride_ct, k_in.stride(0), k_in.stride(1), v_in.stride(0), v_in.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        HEADS=heads, HPG=hpg, HPG_PAD=max(16, _pow2(hpg)), D=d, BLOCK=block_size, SPLITS=splits,
        IEEE=k_cache.dtype == torch.float32, ROT=rot, NEW_KV=new_kv is not None, FOLD=counters is not None,
        PRE=new_kv is not None and (splits > 1 or launch.step > 1), STEP=launch.step,
        SKIP=counters is not None and bool(launch.skip_empty), MIN_PER=launch.min_blocks, num_warps=launch.warps,
        **pf, **gdc_launch(q, pdl),
    )
    # fmt: on
    if splits > 1 and counters is None:
        combine[(t, heads)](out, pm, pl, pacc, out.stride(0), out.stride(1), HEADS=heads, D=d, SPLITS=splits,
                            **gdc_launch(q, pdl))  # fmt: skip
    return out


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write ``k``/``v`` ``[T, groups, d]`` (any strides of the last two dims' rows) at cache ``slots`` ``[T]`` of
    ``[blocks, block_size, groups, d]`` caches: one kernel for both (instead of an ``index_copy_`` for each).
    ``rotary`` (cos, sin ``[T, 1, 1, rot]``) rotates the keys on the way in."""
    t, groups, d = k.shape
    if t == 0:
        return
    _check_kv(k, v, k_cache, v_cache, "store_kv_triton")
    cos, sin, stride_ct, rot = _rotary_rows(rotary, t, d, k)
    _, _, store = _kernel()
    store[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        cos,
        sin,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        groups * d,
        stride_ct,
        GD_PAD=_pow2(groups * d),
        G=groups,
        D=d,
        ROT=rot,
    )
