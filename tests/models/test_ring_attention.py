"""Ring attention (context parallelism) against one-process causal attention in float64: cp 2 and 4, with grouped
K/V, both K/V exchanges (ring of sends, all-gather), blocks through the fused kernels and exact, output and every
gradient; the fused blocks against the exact ones (CPU, and CUDA's flash kernel on a GPU); and the causal load
balancing (rank r holds chunks r and 2cp-1-r)."""

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


def _check(cp: int, groups: int, comm: str, packed: bool = False, fused: bool = True) -> float:
    """Ring attention at ``cp`` against one process in float64 (output and every gradient); ``packed``: rows of
    several documents (:func:`_packed_ids`) and per-document attention; ``fused=False``: every block exact (the
    worker's default restored after)."""
    from mcore_models.transformer import ring_attention as module

    module.FUSED_BLOCKS = fused
    try:
        return _compare(cp, groups, comm, packed)
    finally:
        module.FUSED_BLOCKS = True


def _compare(cp: int, groups: int, comm: str, packed: bool) -> float:
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


@pytest.mark.parametrize("cp,comm,groups", [(2, "p2p", 2), (4, "allgather", 1), (4, "p2p", HEADS)])
def test_ring_attention_with_exact_blocks_equals_causal_attention(cp: int, comm: str, groups: int) -> None:
    worst = run_distributed(_check, cp, cp, groups, comm, False, False)
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
        return _check(cp, 2, "p2p", fused=False)
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


def _block_pair(device: str, dtype: torch.dtype, causal: bool, n: int, m: int, groups: int) -> list[torch.Tensor]:
    """The fused block's (out, lse, dq, dk, dv) minus the exact block's, for queries ``[b, G, hg, n, d]`` against
    K/V ``[b, G, m, d]``, the backward given a made-up merged output and log-sum-exp (as the ring's are: larger
    than the block's own, from other blocks' keys)."""
    from mcore_models.transformer.ring_attention import (
        block_backward,
        block_forward,
        fused_block_backward,
        fused_block_forward,
        fused_blocks,
    )

    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, groups, HEADS // groups, n, D, generator=g).to(device, dtype)
    k, v = (torch.randn(B, groups, m, D, generator=g).to(device, dtype) for _ in range(2))
    assert fused_blocks(q)
    o_f, l_f, aux = fused_block_forward(q, k, v, causal, 0.3)
    o_e, l_e = block_forward(q, k, v, causal, 0.3)
    lse = l_e + torch.rand(l_e.shape, generator=g).to(device, l_e.dtype)  # the merged log-sum-exp
    out = (o_e * 0.7).to(dtype)  # and the merged output
    dout = torch.randn(q.shape, generator=g).to(device, dtype)
    delta = (dout.to(l_e.dtype) * out.to(l_e.dtype)).sum(-1)
    fused = fused_block_backward(dout, q, k, v, out, lse, causal, 0.3, aux)
    exact = block_backward(dout, delta, q, k, v, lse, causal, 0.3)
    return [(a - b).abs().max() for a, b in zip((o_f, l_f, *fused), (o_e, l_e, *exact), strict=True)]


@pytest.mark.parametrize("causal,n,m", [(True, 16, 16), (False, 16, 8), (False, 8, 16)], ids=["diag", "left", "right"])
@pytest.mark.parametrize("groups", [HEADS, 2, 1], ids=["mha", "gqa2", "mqa"])
def test_fused_blocks_equal_exact_blocks(causal: bool, n: int, m: int, groups: int) -> None:
    """The three block shapes of a ring step (the causal diagonal, all queries against the first K/V chunk, the
    second query chunk against all K/V) through the CPU's fused kernel: the exact blocks' values and gradients."""
    assert max(float(e) for e in _block_pair("cpu", torch.float64, causal, n, m, groups)) < 1e-12
    assert max(float(e) for e in _block_pair("cpu", torch.float32, causal, n, m, groups)) < 1e-5


def test_fused_blocks_only_where_a_kernel_fits() -> None:
    from mcore_models.transformer import ring_attention as module

    q = torch.zeros(1, 1, 1, 4, 8)
    assert module.fused_blocks(q) and not module.fused_blocks(q, docs=(q, q))
    assert not module.fused_blocks(torch.zeros(1, 1, 1, 4, 512))  # head dim over the kernels' 256
    module.FUSED_BLOCKS = False
    try:
        assert not module.fused_blocks(q)
    finally:
        module.FUSED_BLOCKS = True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal,n,m", [(True, 256, 256), (False, 256, 128), (False, 128, 256)])
@pytest.mark.parametrize("groups", [HEADS, 1], ids=["mha", "mqa"])
def test_flash_blocks_equal_exact_blocks_on_gpu(causal: bool, n: int, m: int, groups: int) -> None:
    """CUDA's flash kernel and its backward (given the merged output and log-sum-exp) as the ring's blocks: the
    exact float32 blocks' values and gradients within bf16 rounding."""
    errors = _block_pair("cuda", torch.bfloat16, causal, n, m, groups)
    assert max(float(e) for e in errors) < 3e-2, errors


_DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
    ),
]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_one_rank_ring_through_the_fused_blocks(device: str, compiled: bool) -> None:
    """A cp group of one rank (the all-gather exchange, no process group) runs the ring's autograd function over its
    fused diagonal block: on the CPU in float64 the reference's output and gradients, on a GPU flash attention in
    bf16 within bf16 rounding; eager and under ``torch.compile`` (the flash call's by-products kept for the
    backward)."""
    from mcore_models.transformer.ring_attention import ring_attention
    from mcore_parallel import Group

    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(2)
    full = [torch.randn(64, B, n, 16, generator=g).to(dtype).double().requires_grad_() for n in (HEADS, 2, 2)]
    dout = torch.randn(64, B, HEADS * 16, generator=g).to(dtype).double()
    want = _reference(*full)
    want.backward(dout)
    ins = [t.detach().to(device, dtype).requires_grad_() for t in full]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ring_attention(q, k, v, Group.single("cp"), "allgather")

    if compiled:
        torch._dynamo.reset()
        attend = torch.compile(attend)
    got = attend(*ins)
    got.backward(dout.to(device, dtype))
    tol = 1e-10 if dtype == torch.float64 else 2e-2
    for a, b in [(got, want), *((t.grad, f.grad) for t, f in zip(ins, full, strict=True))]:
        assert a is not None and b is not None
        assert float((a.double().cpu() - b).abs().max() / b.abs().max()) < tol
