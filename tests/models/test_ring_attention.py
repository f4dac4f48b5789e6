"""Ring attention (context parallelism) against one-process causal attention in float64: cp 2 and 4, with grouped
K/V, both K/V exchanges (ring of sends, all-gather), output and every gradient; and the causal load balancing
(rank r holds chunks r and 2cp-1-r)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_parallel import ParallelConfig, ParallelState
from mcore_parallel.context_parallel import cp_chunk_ids, cp_index, cp_split, resolve_cp_comm
from mcore_parallel.testing import run_distributed

S, B, HEADS, D = 32, 2, 4, 8


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over ``[s, b, heads, d]`` / ``[s, b, groups, d]`` (K/V repeated per group), [s, b, h*d];
    ``mask`` (``[b, 1, s, s]`` bool): that mask instead of the causal one."""
    rep = q.shape[2] // k.shape[2]
    qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)))
    out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=mask is None)
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


def _check(cp: int, groups: int, comm: str, packed: bool = False) -> float:
    """Ring attention at ``cp`` against one process in float64 (output and every gradient); ``packed``: rows of
    several documents (:func:`_packed_ids`) and per-document attention."""
    from mcore_models.transformer.packed import document_mask
    from mcore_models.transformer.ring_attention import ring_attention, ring_document_mask

    state = ParallelState.initialize(ParallelConfig(cp=cp))
    g = torch.Generator().manual_seed(7)
    q = torch.randn(S, B, HEADS, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(S, B, groups, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(S, B, groups, D, generator=g, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(S, B, HEADS * D, generator=g, dtype=torch.float64)
    ids = _packed_ids(g) if packed else None
    if ids is not None:
        assert int(ids.max()) >= 3  # several documents per row
    want = _reference(q, k, v, None if ids is None else document_mask(ids, "dense").dense)
    want.backward(dout)
    local = [cp_split(t.detach(), state.cp, dim=0).requires_grad_() for t in (q, k, v)]
    mask = None if ids is None else ring_document_mask(cp_split(ids, state.cp, dim=1), state.cp)
    got = ring_attention(*local, state.cp, comm, document_mask=mask)
    got.backward(cp_split(dout, state.cp, dim=0))
    worst = 0.0
    for a, b in [(got, want), *((lt.grad, t.grad) for lt, t in zip(local, (q, k, v), strict=True))]:
        b = cp_split(b.detach(), state.cp, dim=0)
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
        worst = max(worst, float((a - b).abs().max()))
    return worst


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("comm", ["p2p", "allgather"])
@pytest.mark.parametrize("groups", [HEADS, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_ring_attention_equals_causal_attention(cp: int, comm: str, groups: int) -> None:
    worst = run_distributed(_check, cp, cp, groups, comm)
    assert max(worst) < 1e-10


def _bf16(cp: int) -> None:
    from mcore_models.transformer.ring_attention import ring_attention

    state = ParallelState.initialize(ParallelConfig(cp=cp))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(S, B, n, D, generator=g) for n in (HEADS, 2, 2))
    want = _reference(q, k, v)
    local = [cp_split(t, state.cp, dim=0).bfloat16().requires_grad_() for t in (q, k, v)]
    got = ring_attention(*local, state.cp, "p2p")
    got.float().sum().backward()
    assert got.dtype == torch.bfloat16 and all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in local)
    torch.testing.assert_close(got.float(), cp_split(want, state.cp, dim=0), rtol=2e-2, atol=2e-2)


def test_ring_attention_in_bfloat16_accumulates_in_float32() -> None:
    run_distributed(_bf16, 2, 2)


def test_load_balancing_assigns_chunks_r_and_2cp_minus_1_minus_r() -> None:
    assert [cp_chunk_ids(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert cp_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_index(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    seq = torch.arange(16)[None].expand(3, 16)
    for r in range(4):
        state = ParallelState.initialize(ParallelConfig())
        cp = type(state.cp)("cp", tuple(range(4)), r, None)
        assert cp_split(seq, cp, dim=1).tolist() == [cp_index(16, 4, r).tolist()] * 3
    # every rank's causal work (query-key pairs at or before the query) is the same
    work = [sum(int(p) + 1 for p in cp_index(64, 4, r)) for r in range(4)]
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="divisible by 2 \\* cp"):
        cp_index(12, 4, 0)


def test_cp_comm_auto_rule() -> None:
    assert resolve_cp_comm("auto", 4096, 2) == "allgather"
    assert resolve_cp_comm("auto", 8192, 2) == "p2p"
    assert resolve_cp_comm("p2p", 64, 2) == "p2p"
    assert resolve_cp_comm("allgather", 1 << 20, 8) == "allgather"
    with pytest.raises(ValueError, match="auto, p2p or allgather"):
        resolve_cp_comm("ring", 64, 2)


def test_context_parallel_spec_puts_ring_attention_in_the_layer_spec() -> None:
    from mcore_models import LayerSpec
    from mcore_models.transformer.ring_attention import RingAttention, context_parallel_spec

    cp = ParallelState.initialize(ParallelConfig()).cp
    spec = LayerSpec()
    assert context_parallel_spec(spec, cp) is spec  # one rank: unchanged
    cp2 = type(cp)("cp", (0, 1), 0, None)
    ring = context_parallel_spec(spec, cp2, "allgather").core_attention
    assert ring.func is RingAttention and ring.keywords == {"cp": cp2, "comm": "allgather"}  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="needs ring attention"):
        context_parallel_spec(LayerSpec(core_attention=RingAttention), cp2)


def _tiled(cp: int) -> float:
    from mcore_models.transformer import ring_attention

    ring_attention.SCORE_TILE_ELEMENTS = 3 * B * HEADS * S  # a few query rows per tile, uneven last tile
    try:
        return _check(cp, 2, "p2p")
    finally:
        ring_attention.SCORE_TILE_ELEMENTS = 1 << 28


def test_blocks_computed_in_row_tiles_equal_causal_attention() -> None:
    assert max(run_distributed(_tiled, 2, 2)) < 1e-10


def _packed_ids(g: torch.Generator) -> torch.Tensor:
    """Document ids ``[B, S]`` of rows packed with documents of 1 to 13 tokens (boundaries anywhere, also inside a
    cp chunk and at chunk edges)."""
    rows = []
    for _ in range(B):
        lengths: list[int] = []
        while sum(lengths) < S:
            lengths.append(int(torch.randint(1, 14, (1,), generator=g)))
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:S]
        rows.append(ids)
    return torch.stack(rows)


@pytest.mark.parametrize("cp,comm,groups", [(2, "p2p", 2), (2, "allgather", HEADS), (4, "p2p", 1), (4, "allgather", 2)])
def test_ring_attention_over_packed_sequences_equals_document_attention(cp: int, comm: str, groups: int) -> None:
    """Packed rows (documents of 1-13 tokens) split over cp ranks: attention stays inside each document across the
    ring, output and every gradient equal to one-process per-document causal attention in float64."""
    worst = run_distributed(_check, cp, cp, groups, comm, True)
    assert max(worst) < 1e-10
