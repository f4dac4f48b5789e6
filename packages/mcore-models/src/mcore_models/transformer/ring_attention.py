"""Causal attention over a sequence split across the context-parallel (``cp``) group: ring attention.

Every cp rank holds two chunks of the sequence (of ``2 * cp``; rank ``r`` chunks ``r`` and ``2cp - 1 - r``, see
:mod:`mcore_parallel.context_parallel`) and their queries, keys and values. The K/V of each rank visit every other
rank: with ``cp_comm="p2p"`` they rotate around the ring (``cp - 1`` sends to the next rank, each started before
the attention of the block in hand so the transfer runs beside it); with ``"allgather"`` one all-gather, started
before the local block's attention, brings all of them. Each block gives a partial output and its log-sum-exp per
query; partial results merge with the online-softmax rule ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a *
exp(lse_a - lse) + out_b * exp(lse_b - lse)``.

With the balanced chunks, the block of rank ``r`` against the K/V of rank ``j`` is:

* ``j == r``: causal attention over the local sequence (local order is increasing in position);
* ``j < r``: every local query against the first K/V chunk (``j``) in full; the second (``2cp-1-j``) is later;
* ``j > r``: the second local chunk's queries (``2cp-1-r``) against both K/V chunks in full; the first sees none.

so every step but the first costs the same half block on every rank. Packed sequences add each token's document:
a key of another document is masked in every block (the queries' ids are this rank's, the keys' those of the rank
the K/V came from, all gathered once per micro-batch by :func:`ring_document_mask`); a query with no key of its
document in a block gets nothing from it, and the causal structure above is unchanged. The backward runs the same ring: the K/V
rotate again and the dK/dV of each block travel with them, accumulated by every rank they pass, and reach their
owner after the last step (one more send); ``allgather`` gathers K/V again and reduce-scatters dK/dV. Grouped-query
attention keeps K/V at their ``groups`` heads throughout: queries are viewed as ``[b, groups, heads / groups * s,
d]`` so each group's queries meet its key head in one matmul, and nothing is expanded before or after the exchange.

A block of an unpacked sequence runs through PyTorch's fused attention kernel that returns the log-sum-exp (flash
attention on CUDA for 16-bit inputs, the CPU's flash kernel on CPUs; :func:`fused_block_forward`), and its backward
through the same kernel's backward given the *merged* output and log-sum-exp, which is the flash-attention backward
of the block's share of the whole softmax (:func:`fused_block_backward`). Grouped K/V are repeated to the query
heads for the kernel only after the exchange, and their gradients summed back over each group. Packed blocks (a
document mask) and other inputs are computed exactly (scores in float32, float64 for float64 inputs; row tiles
bound the memory): :func:`block_forward` / :func:`block_backward`, the reference of the fused path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mcore_models.config import TransformerConfig
from mcore_models.transformer.attention import SDPACoreAttention
from mcore_models.transformer.context import ModelContext
from mcore_models.transformer.packed import DocumentMask
from mcore_parallel import Group
from mcore_parallel.autograd import as_dtype
from mcore_parallel.context_parallel import CP_COMMS, ring_exchange, wait_all
from mcore_parallel.tensor import _comm

if TYPE_CHECKING:
    from mcore_models.spec import LayerSpec

__all__ = [
    "RingAttention",
    "block_backward",
    "block_forward",
    "context_parallel_spec",
    "fused_block_backward",
    "fused_block_forward",
    "ring_attention",
    "ring_document_mask",
]

Block = tuple[slice, slice, bool]
"""(query rows, key rows, causal) of one block of a ring step."""

RingDocs = tuple[torch.Tensor, torch.Tensor] | None
"""Packed sequences: this rank's document ids ``[b, n]`` and every cp rank's ``[cp, b, n]`` (None: unpacked)."""


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _blocks(r: int, j: int, c: int) -> list[Block]:
    """The blocks of rank ``r``'s queries against rank ``j``'s K/V, each chunk ``c`` tokens (module docstring)."""
    if j == r:
        return [(slice(None), slice(None), True)]
    if j < r:
        return [(slice(None), slice(0, c), False)]
    return [(slice(c, None), slice(None), False)]


SCORE_TILE_ELEMENTS = 1 << 28
"""Scores computed at once (1 GiB in float32): a block's query rows are processed in tiles of at most this many
scores, so a long block never materialises its whole score matrix (rows are independent: each has its own
softmax over all the block's keys)."""


def _row_tiles(q: torch.Tensor, m: int) -> list[tuple[int, int]]:
    b, g, hg, n, _ = q.shape
    rows = max(1, SCORE_TILE_ELEMENTS // max(1, b * g * hg * m))
    return [(i, min(n, i + rows)) for i in range(0, n, rows)]


Docs = tuple[torch.Tensor, torch.Tensor] | None
"""Packed sequences: the document ids ``[b, n]`` of a block's queries and ``[b, m]`` of its keys (None: unpacked)."""


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, row0: int, docs: Docs = None
            ) -> torch.Tensor:  # fmt: skip
    """``[b, G, hg, n, m]`` scaled scores of queries ``[b, G, hg, n, d]`` (rows ``row0`` on of the block) and keys
    ``[b, G, m, d]`` (accumulation dtype); causal: keys after a query's row at -inf; ``docs``: keys of another
    document than the query's at -inf too."""
    b, g, hg, n, d = q.shape
    m = k.shape[2]
    acc = _acc(q.dtype)
    s = torch.matmul(q.reshape(b, g, hg * n, d).to(acc), k.to(acc).transpose(-1, -2)).view(b, g, hg, n, m) * scale
    if causal:
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1 + row0), float("-inf"))
    if docs is not None:
        qd, kd = docs
        other = qd[:, row0 : row0 + n, None] != kd[:, None, :]  # [b, n, m]
        s = s.masked_fill(other[:, None, None], float("-inf"))
    return s


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, docs: Docs = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[b, G, hg, n, d]`` over ``k``, ``v`` ``[b, G, m, d]``: (out ``[b, G, hg, n, d]``,
    log-sum-exp ``[b, G, hg, n]``), both in the accumulation dtype. ``causal`` needs ``n == m``. A query that may
    attend to none of the keys (``docs``: none of its document here) gets out 0 and log-sum-exp -inf, which the
    merge passes over."""
    outs, lses = [], []
    for lo, hi in _row_tiles(q, k.shape[2]):
        s = _scores(q[:, :, :, lo:hi], k, causal, scale, lo, docs)
        b, g, hg, n, m = s.shape
        lse = torch.logsumexp(s, dim=-1)
        safe = lse.masked_fill(lse == float("-inf"), 0.0) if docs is not None else lse
        p = torch.exp(s - safe[..., None])
        outs.append(torch.matmul(p.view(b, g, hg * n, m), v.to(s.dtype)).view(b, g, hg, n, -1))
        lses.append(lse)
    return torch.cat(outs, 3), torch.cat(lses, 3)


def block_backward(
    dout: torch.Tensor,
    delta: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    docs: Docs = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block given the final output's gradient ``dout`` ``[b, G, hg, n, d]``, ``delta`` =
    rowsum(dout * out) and the final log-sum-exp ``lse`` ``[b, G, hg, n]`` (the flash-attention backward; the final
    log-sum-exp is finite: every query attends at least to itself)."""
    dqs, dk, dv = [], None, None
    for lo, hi in _row_tiles(q, k.shape[2]):
        s = _scores(q[:, :, :, lo:hi], k, causal, scale, lo, docs)
        b, g, hg, n, m = s.shape
        acc = s.dtype
        p = torch.exp(s - lse[:, :, :, lo:hi, None].to(acc))
        do = dout[:, :, :, lo:hi].to(acc).reshape(b, g, hg * n, -1)
        dv_t = torch.matmul(p.view(b, g, hg * n, m).transpose(-1, -2), do)
        dp = torch.matmul(do, v.to(acc).transpose(-1, -2)).view(b, g, hg, n, m)
        ds = (p * (dp - delta[:, :, :, lo:hi, None].to(acc))).view(b, g, hg * n, m)
        dqs.append(torch.matmul(ds, k.to(acc)).view(b, g, hg, n, -1) * scale)
        dk_t = torch.matmul(ds.transpose(-1, -2), q[:, :, :, lo:hi].to(acc).reshape(b, g, hg * n, -1)) * scale
        dk, dv = (dk_t, dv_t) if dk is None or dv is None else (dk + dk_t, dv + dv_t)
    assert dk is not None and dv is not None
    return torch.cat(dqs, 3), dk, dv


FUSED_BLOCKS = True
"""Blocks of unpacked sequences through the fused kernels where :func:`fused_blocks` allows (False: every block
exact; tests compare the two)."""

FlashAux = tuple[Any, ...]
"""What CUDA's flash forward returns after its output and log-sum-exp, handed to its backward (empty elsewhere)."""


def fused_blocks(q: torch.Tensor, docs: object = None) -> bool:
    """Whether blocks of ``q`` ``[b, G, hg, n, d]`` run through a fused kernel: unpacked, and flash attention's
    inputs on CUDA (bf16/fp16, head dim a multiple of 8 up to 256) or any floating dtype on CPUs."""
    if not FUSED_BLOCKS or docs is not None or q.shape[-1] > 256:
        return False
    if q.device.type == "cuda":
        return q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] % 8 == 0
    return q.device.type == "cpu"


def _heads(t: torch.Tensor, hg: int) -> torch.Tensor:
    """K or V ``[b, G, m, d]`` repeated for the ``hg`` query heads of each group: ``[b, G * hg, m, d]``."""
    b, g, m, d = t.shape
    return t if hg == 1 else t[:, :, None].expand(b, g, hg, m, d).reshape(b, g * hg, m, d)


def fused_block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor, FlashAux]:  # fmt: skip
    """:func:`block_forward` through the fused kernel: (out, log-sum-exp) in the accumulation dtype, and what the
    kernel's backward needs of the call."""
    b, g, hg, n, d = q.shape
    qh, kh, vh = q.reshape(b, g * hg, n, d), _heads(k, hg), _heads(v, hg)
    if q.device.type == "cuda":
        out, lse, *rest = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, causal, False,
                                                                              scale=scale)  # fmt: skip
        aux: FlashAux = tuple(rest[:6])  # cum_seq_q, cum_seq_k, max_q, max_k, philox seed, philox offset
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh, 0.0, causal, scale=scale)
        aux = ()
    acc = _acc(q.dtype)
    return out.reshape(b, g, hg, n, d).to(acc), lse[..., :n].reshape(b, g, hg, n).to(acc), aux


def fused_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, causal: bool, scale: float, aux: FlashAux
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`block_backward` through the fused kernel's backward: ``out`` and ``lse`` are the merged (final) output
    ``[b, G, hg, n, d]`` (``q``'s dtype) and log-sum-exp of these queries; (dq ``[b, G, hg, n, d]``, dk, dv
    ``[b, G, m, d]``) in the accumulation dtype."""
    b, g, hg, n, d = q.shape
    m = k.shape[2]
    qh, kh, vh = q.reshape(b, g * hg, n, d), _heads(k, hg), _heads(v, hg)
    doh, oh = dout.reshape(b, g * hg, n, d), out.reshape(b, g * hg, n, d)
    lh = lse.reshape(b, g * hg, n).contiguous()
    if q.device.type == "cuda":  # lse is float32 (the accumulation dtype of 16-bit inputs), as the kernel's
        cum_q, cum_k, max_q, max_k, seed, offset = aux
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            doh, qh, kh, vh, oh, lh, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
        )
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            doh, qh, kh, vh, oh, lh, 0.0, causal, scale=scale
        )
    acc = _acc(q.dtype)
    dk, dv = (t.to(acc).view(b, g, hg, m, d).sum(2) for t in (dk, dv))
    return dq.to(acc).view(b, g, hg, n, d), dk, dv


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, o: torch.Tensor, lo: torch.Tensor) -> None:
    """Merge a block's (o, lo) into the rows ``rows`` of the running (out, lse), in place (online softmax)."""
    prev_o, prev_l = out[:, :, :, rows], lse[:, :, :, rows]
    new = torch.logaddexp(prev_l, lo)
    out[:, :, :, rows] = prev_o * torch.exp(prev_l - new)[..., None] + o * torch.exp(lo - new)[..., None]
    lse[:, :, :, rows] = new


def _block_docs(docs: RingDocs, j: int, rows: slice, keys: slice) -> Docs:
    """The document ids of a block's queries (this rank's ``rows``) and keys (rank ``j``'s ``keys``)."""
    if docs is None:
        return None
    local, every = docs
    return local[:, rows], every[j][:, keys]


def _attend_source(q: torch.Tensor, kv: torch.Tensor, r: int, j: int, scale: float,
                   acc: tuple[torch.Tensor, torch.Tensor] | None, docs: RingDocs = None,
                   flash_aux: list[Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Fold the blocks of rank ``j``'s K/V ``kv`` (``[2, b, G, n, d]``) into the running (out, lse) ``acc``; the
    first fused kernel call's :data:`FlashAux` goes into ``flash_aux``."""
    c = q.shape[3] // 2
    fused = fused_blocks(q, docs)
    for rows, keys, causal in _blocks(r, j, c):
        qb, kb, vb = q[:, :, :, rows], kv[0][:, :, keys], kv[1][:, :, keys]
        if fused:
            o, lo, aux = fused_block_forward(qb, kb, vb, causal, scale)
            if flash_aux is not None and not flash_aux:
                flash_aux.extend(aux)
        else:
            o, lo = block_forward(qb, kb, vb, causal, scale, _block_docs(docs, j, rows, keys))
        if acc is None:  # the diagonal block comes first and covers every query
            acc = (o, lo)
        else:
            _merge(acc[0], acc[1], rows, o, lo)
    assert acc is not None
    return acc


def _forward_p2p(q: torch.Tensor, kv: torch.Tensor, cp: Group, scale: float, docs: RingDocs = None,
                 flash_aux: list[Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    acc, cur = None, kv
    for i in range(cp.size):
        last = i == cp.size - 1
        if not last:
            nxt, reqs = ring_exchange(cur, cp)  # the next K/V travel while this block is computed
        acc = _attend_source(q, cur, cp.rank, (cp.rank - i) % cp.size, scale, acc, docs, flash_aux)
        if not last:
            wait_all(reqs)
            cur = nxt
    assert acc is not None
    return acc


def _gather_start(kv: torch.Tensor, cp: Group) -> tuple[torch.Tensor, Any]:
    gathered, handle = _comm.all_gather_start(kv, cp)  # [cp * 2, b, G, n, d]
    return gathered, handle


def _forward_allgather(q: torch.Tensor, kv: torch.Tensor, cp: Group, scale: float, docs: RingDocs = None,
                       flash_aux: list[Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    gathered, handle = _gather_start(kv, cp)
    acc = _attend_source(q, kv, cp.rank, cp.rank, scale, None, docs, flash_aux)  # while the others arrive
    if handle is not None:
        handle.wait()
    every = gathered.view(cp.size, *kv.shape)
    for i in range(1, cp.size):
        j = (cp.rank - i) % cp.size
        acc = _attend_source(q, every[j], cp.rank, j, scale, acc, docs)
    return acc


def _grads_source(saved: tuple[Any, ...], kv: torch.Tensor, r: int, j: int, scale: float, dq: torch.Tensor,
                  docs: RingDocs = None) -> torch.Tensor:  # fmt: skip
    """Add the blocks against rank ``j``'s K/V to ``dq`` (in place) and return their dK/dV ``[2, b, G, n, d]``.
    ``saved``: q, dO, rowsum(dO * O) (None for fused blocks), the merged lse and O, then the :data:`FlashAux`."""
    q, dout, delta, lse, out, *aux = saved
    c = q.shape[3] // 2
    dkv = torch.zeros(kv.shape, dtype=dq.dtype, device=dq.device)
    fused = fused_blocks(q, docs)
    for rows, keys, causal in _blocks(r, j, c):
        qb, kb, vb, dob, lb = (
            q[:, :, :, rows],
            kv[0][:, :, keys],
            kv[1][:, :, keys],
            dout[:, :, :, rows],
            lse[:, :, :, rows],
        )
        if fused:
            dqb, dkb, dvb = fused_block_backward(dob, qb, kb, vb, out[:, :, :, rows], lb, causal, scale, tuple(aux))
        else:
            assert delta is not None
            dqb, dkb, dvb = block_backward(dob, delta[:, :, :, rows], qb, kb, vb, lb, causal, scale,
                                           _block_docs(docs, j, rows, keys))  # fmt: skip
        dq[:, :, :, rows] += dqb
        dkv[0][:, :, keys] += dkb
        dkv[1][:, :, keys] += dvb
    return dkv


def _backward_p2p(saved: tuple[Any, ...], kv: torch.Tensor, cp: Group, scale: float, dq: torch.Tensor,
                  docs: RingDocs = None) -> torch.Tensor:  # fmt: skip
    """The ring again: K/V rotate, each block's dK/dV travel one step behind them to the next rank, which adds its
    own; after the last step the dK/dV of every rank's K/V reach their owner."""
    cur, pending = kv, None
    dkv_reqs: list[Any] = []
    for i in range(cp.size):
        last = i == cp.size - 1
        if not last:
            nxt, kv_reqs = ring_exchange(cur, cp)
        dkv = _grads_source(saved, cur, cp.rank, (cp.rank - i) % cp.size, scale, dq, docs)
        if pending is not None:
            wait_all(dkv_reqs)
            dkv += pending
        pending, dkv_reqs = ring_exchange(dkv, cp)  # overlaps the next step's blocks
        if not last:
            wait_all(kv_reqs)
            cur = nxt
    wait_all(dkv_reqs)
    assert pending is not None
    return pending


def _backward_allgather(saved: tuple[Any, ...], kv: torch.Tensor, cp: Group, scale: float,
                        dq: torch.Tensor, docs: RingDocs = None) -> torch.Tensor:  # fmt: skip
    gathered, handle = _gather_start(kv, cp)
    every_dkv = torch.zeros((cp.size, *kv.shape), dtype=dq.dtype, device=dq.device)
    every_dkv[cp.rank] = _grads_source(saved, kv, cp.rank, cp.rank, scale, dq, docs)
    if handle is not None:
        handle.wait()
    every = gathered.view(cp.size, *kv.shape)
    for j in range(cp.size):
        if j != cp.rank:
            every_dkv[j] = _grads_source(saved, every[j], cp.rank, j, scale, dq, docs)
    return _comm.reduce_scatter(every_dkv.view(cp.size * kv.shape[0], *kv.shape[1:]), cp)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: Group, comm: str, scale: float,
                docs: RingDocs) -> torch.Tensor:  # fmt: skip
        q = q.contiguous()
        kv = torch.stack([k, v])  # one buffer per exchange: [2, b, G, n, d]
        run = _forward_p2p if comm == "p2p" else _forward_allgather
        flash_aux: list[Any] = []
        out, lse = run(q, kv, cp, scale, docs, flash_aux)
        out = as_dtype(out, q.dtype)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.cp, ctx.comm, ctx.scale, ctx.docs, ctx.flash_aux = cp, comm, scale, docs, flash_aux
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        q, kv, out, lse = ctx.saved_tensors
        acc = lse.dtype
        dout = dout.contiguous()
        # rowsum(dO * O) for exact blocks; the fused kernels compute it from O themselves
        delta = None if fused_blocks(q, ctx.docs) else (dout.to(acc) * out.to(acc)).sum(-1)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        run = _backward_p2p if ctx.comm == "p2p" else _backward_allgather
        dkv = run((q, dout, delta, lse, out, *ctx.flash_aux), kv, ctx.cp, ctx.scale, dq, ctx.docs)
        return dq.to(q.dtype), dkv[0].to(kv.dtype), dkv[1].to(kv.dtype), None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp: Group,
    comm: str = "p2p",
    scale: float | None = None,
    document_mask: DocumentMask | None = None,
) -> torch.Tensor:
    """Causal attention of this cp rank's queries ``[s, b, heads, d]`` over the whole sequence's keys and values
    (this rank's ``[s, b, groups, d]``; ``s`` = its two chunks), ``[s, b, heads * d]`` out. ``comm``: ``p2p`` (ring)
    or ``allgather``. ``document_mask`` (packed sequences, from :func:`ring_document_mask`): attention stays inside
    each token's document across the ring."""
    if comm not in CP_COMMS:
        raise ValueError(f"comm={comm!r} must be one of {CP_COMMS}")
    s, b, heads, d = q.shape
    groups = k.shape[2]
    if heads % groups or s % 2:
        raise ValueError(f"heads={heads} must be a multiple of groups={groups} and s={s} even (two chunks)")
    qq = q.view(s, b, groups, heads // groups, d).permute(1, 2, 3, 0, 4)  # [b, G, hg, s, d]
    kk, vv = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)  # [b, G, s, d]
    docs: RingDocs = None
    if document_mask is not None:
        if document_mask.ring_ids is None or document_mask.ring_ids.shape != (cp.size, b, s):
            raise ValueError(
                "ring attention over packed sequences needs the document ids of every cp rank's chunks "
                f"([{cp.size}, {b}, {s}]): build the mask with ring_document_mask"
            )
        docs = (document_mask.document_ids, document_mask.ring_ids)
    out = _RingAttention.apply(qq, kk, vv, cp, comm, 1.0 / math.sqrt(d) if scale is None else scale, docs)
    return out.permute(3, 0, 1, 2, 4).reshape(s, b, heads * d)


def ring_document_mask(document_ids: torch.Tensor, cp: Group) -> DocumentMask:
    """The document mask of this cp rank's chunks ``[b, s]`` (its tokens' document ids, split as the tokens are) for
    :func:`ring_attention`: with the ids of every cp rank's chunks, gathered once per micro-batch (a ``[cp, b, s]``
    integer all-gather) for the K/V that visit."""
    ids = document_ids.long().contiguous()
    every = _comm.all_gather(ids[None], cp) if cp.size > 1 else ids[None]
    return DocumentMask(ids, ring_ids=every.view(cp.size, *ids.shape))


class RingAttention(nn.Module):
    """The core attention of a context-parallel model: :func:`ring_attention` over ``cp`` with ``comm``. Same call as
    :class:`~mcore_models.transformer.attention.SDPACoreAttention`; :func:`context_parallel_spec` puts it in a
    :class:`~mcore_models.spec.LayerSpec` with its group bound."""

    def __init__(self, config: TransformerConfig, ctx: ModelContext, *, cp: Group, comm: str = "p2p") -> None:
        super().__init__()
        if config.attention_dropout > 0:
            raise ValueError(f"attention_dropout={config.attention_dropout}: ring attention has no dropout; set 0")
        if comm not in CP_COMMS:
            raise ValueError(f"cp_comm={comm!r} must be one of {CP_COMMS}")
        self.ctx, self.cp, self.comm = ctx, cp, comm

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_mask: DocumentMask | None = None
    ) -> torch.Tensor:
        return ring_attention(q, k, v, self.cp, self.comm, document_mask=document_mask)


def context_parallel_spec(spec: LayerSpec, cp: Group, comm: str = "p2p") -> LayerSpec:
    """``spec`` whose core attention is :class:`RingAttention` over ``cp`` (``spec`` itself when ``cp`` has one
    rank). Refuses a spec with a core attention of its own, which would attend within each rank's chunks only."""
    if cp.size == 1:
        return spec
    if spec.core_attention is not SDPACoreAttention:
        raise ValueError(
            f"context parallelism (cp={cp.size}) needs ring attention, but the layer spec's core attention is "
            f"{getattr(spec.core_attention, '__name__', spec.core_attention)!r}; use the default core attention"
        )
    return dataclasses.replace(spec, core_attention=functools.partial(RingAttention, cp=cp, comm=comm))
