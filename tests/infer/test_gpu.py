"""GPU paths (run through the device tool; skipped without CUDA + Triton): the paged Triton kernel against the
plain gather + SDPA path, CUDA-graph decode against eager steps, and the GPU engine against the recompute loop."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mcore_infer import DECODE_PRESETS, LLM, AttentionLaunch, DecodeLaunches, DecodePlan, EngineConfig, SamplingParams
from mcore_infer._triton_attention import num_splits, paged_attention_triton, store_kv_triton, triton_available
from mcore_infer.attention import Segment, plain_paged_attention
from mcore_infer.kernels import GemvLaunch, NormLinearLaunch
from mcore_infer.runner import StepBatch
from tests.infer._tiny import prompts_of_lengths, reference_greedy, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton"),
]


@pytest.mark.parametrize("splits", [None, 1, 2, 16])
@pytest.mark.parametrize("dtype,block", [(torch.bfloat16, 16), (torch.bfloat16, 32), (torch.float32, 16)])
def test_triton_paged_attention_matches_plain(dtype: torch.dtype, block: int, splits: int | None) -> None:
    """Every split count (flash-decoding partial states + combine) gives the plain result; a padded CUDA-graph row
    (context 0) gives zeros, not NaN."""
    torch.manual_seed(0)
    groups, heads, d, nblocks = 8, 32, 64, 64
    kc = torch.randn(nblocks, block, groups, d, device="cuda", dtype=dtype)
    vc = torch.randn(nblocks, block, groups, d, device="cuda", dtype=dtype)
    perm = torch.randperm(nblocks - 1).add(1).tolist()
    tables = [perm[0:10], perm[10:13], perm[13:30], perm[30:31]]
    # a decode at ctx 300 / 150 tokens, a 7-token chunk ending at ctx 40, a 20-token prefill from 0, one at ctx 1
    ctx_ends = [min(300, 10 * block), 40, 20, 1]
    lens = [1, 7, 20, 1]
    segs, tseq, tctx, t0 = [], [], [], 0
    for row, (end, n) in enumerate(zip(ctx_ends, lens)):
        segs.append(Segment(t0, t0 + n, row, end))
        tseq += [row] * n
        tctx += list(range(end - n + 1, end + 1))
        t0 += n
    tseq.append(0)  # a padded row of a CUDA-graph batch: context 0
    tctx.append(0)
    q = torch.randn(t0 + 1, heads, d, device="cuda", dtype=dtype)
    bt = torch.zeros(len(tables), 17, dtype=torch.int64, device="cuda")
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    ref = plain_paged_attention(q[:t0].float(), kc.float(), vc.float(), segs, tables)
    out = paged_attention_triton(
        q, kc, vc, bt, torch.tensor(tseq, device="cuda"), torch.tensor(tctx, device="cuda"), d**-0.5, splits=splits
    )
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(out[:t0].float(), ref, atol=tol, rtol=tol), (out[:t0].float() - ref).abs().max()
    assert torch.equal(out[t0], torch.zeros_like(out[t0]))


def test_num_splits_fills_the_gpu_for_small_batches() -> None:
    assert num_splits(1, 8, 32, sms=132) == 16  # batch 1: 8 programs alone would leave 124 SMs idle
    assert num_splits(8, 8, 32, sms=132) == 8
    assert num_splits(64, 8, 32, sms=132) == 1  # enough programs already
    assert num_splits(1, 8, 4, sms=132) == 4  # never more splits than a row has blocks
    assert num_splits(1, 8, 1, sms=132) == 1


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_store_kv_matches_index_copy(cache_dtype: torch.dtype) -> None:
    """The one-kernel key/value write equals two index_copy_ calls, from the strided views attention passes."""
    torch.manual_seed(0)
    groups, d = 8, 64
    kc = torch.randn(32, 16, groups, d, device="cuda", dtype=cache_dtype)
    vc = torch.randn_like(kc)
    qkv = torch.randn(5, groups, 6, d, device="cuda", dtype=torch.bfloat16)  # [t, groups, q_per_group + 2, d]
    k, v = qkv[:, :, 4], qkv[:, :, 5]
    slots = torch.tensor([3, 17, 40, 41, 500], device="cuda")
    ref_k, ref_v = kc.clone(), vc.clone()
    ref_k.view(-1, groups, d).index_copy_(0, slots, k.to(cache_dtype))
    ref_v.view(-1, groups, d).index_copy_(0, slots, v.to(cache_dtype))
    store_kv_triton(k, v, kc, vc, slots)
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


def test_cuda_graph_decode_matches_eager() -> None:
    model = tiny_model().cuda()
    cfg = dict(block_size=16, num_blocks=64, max_num_seqs=8, attention_backend="triton")
    llm = LLM(model=model, config=EngineConfig(**cfg, cuda_graphs=True))
    assert llm.runner.graphs  # captured
    r = llm.runner
    tables = [r.blocks.allocate(3) for _ in range(5)]
    pre = StepBatch()
    for i, t in enumerate(tables):
        pre.add(list(range(1, 20 + i)), 0, t, 16, "last")
    r.execute(pre)  # prefill (eager)
    dec = StepBatch()
    for i, t in enumerate(tables):
        dec.add([7 + i], 19 + i, t, 16, "last")
    assert dec.decode_only
    graphed = r.execute(dec).clone()
    saved, r.graphs, steps, r.step_graphs = r.graphs, {}, r.step_graphs, {}
    eager = r.execute(dec)
    r.graphs, r.step_graphs = saved, steps
    assert torch.allclose(graphed, eager, atol=1e-5), (graphed - eager).abs().max()


@pytest.mark.parametrize("compiled", [False, True])
def test_step_graphs_match_eager(compiled: bool) -> None:
    """Steps that are not decode-only (prefill chunks of several requests, with and without decode tokens, and a
    chunk continuing a cached prefix) replay the step graph of the next token count up: the same logits as the
    eager step, in float32; the KV written by a graphed prefill serves the next steps as the eager one does."""
    cfg = EngineConfig(block_size=16, num_blocks=96, max_num_seqs=8, attention_backend="triton", compile=compiled,
                       step_graph_tokens=(32, 128))  # fmt: skip
    results = []
    for graphs in (True, False):
        llm = LLM(model=tiny_model().cuda(), config=replace(cfg, cuda_graphs=graphs))
        r = llm.runner
        assert bool(r.step_graphs) == graphs and sorted(r.step_graphs) == ([32, 128] if graphs else [])
        tables = [r.blocks.allocate(5) for _ in range(4)]
        pre = StepBatch()  # 3 + 21 + 40 = 64 tokens: the 128-token graph
        for i, n in enumerate((3, 21, 40)):
            pre.add(list(range(1 + i, 1 + i + n)), 0, tables[i], 16, "last")
        mixed = StepBatch()  # two decode tokens, a chunk after a cached prefix, a fresh prompt: 2 + 9 + 17 = 28
        mixed.add([5], 3, tables[0], 16, "last")
        mixed.add([6], 21, tables[1], 16, "last")
        mixed.add(list(range(50, 59)), 40, tables[2], 16, "last")
        mixed.add(list(range(70, 87)), 0, tables[3], 16, "last")
        dec = StepBatch()
        for i, pos in enumerate((4, 22, 49, 17)):
            dec.add([9 + i], pos, tables[i], 16, "last")
        results.append([r.execute(b).float().clone() for b in (pre, mixed, dec)])
    for graphed, eager in zip(*results):
        assert graphed.shape == eager.shape
        assert torch.allclose(graphed, eager, atol=2e-4, rtol=1e-4), (graphed - eager).abs().max()


def test_gpu_engine_greedy_matches_recompute() -> None:
    model = tiny_model().cuda()
    llm = LLM(model=model, config=EngineConfig(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32))
    assert llm.runner.backend == "triton" and llm.runner.graphs and sorted(llm.runner.step_graphs) == [32]
    prompts = prompts_of_lengths(5, 40, 17, 70, 3, 33)
    res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for p, g in zip(prompts, res):
        assert g.outputs[0].token_ids == reference_greedy(model, p, 10)


def test_compiled_engine_with_cuda_graphs_matches_recompute() -> None:
    """EngineConfig.compile on the GPU: compiled layers inside the captured decode graphs, greedy tokens unchanged."""
    prompts = prompts_of_lengths(5, 40, 17, 70, 3, 33)
    eager = tiny_model().cuda()
    expected = [reference_greedy(eager, p, 10) for p in prompts]
    cfg = EngineConfig(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, compile=True)
    llm = LLM(model=tiny_model().cuda(), config=cfg)
    assert llm.runner.backend == "triton" and llm.runner.graphs
    res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert [r.outputs[0].token_ids for r in res] == expected


def test_lookahead_with_cuda_graphs_matches_recompute() -> None:
    """EngineConfig.lookahead on the GPU: replayed graphs fed by the previous step's tokens on the device."""
    model = tiny_model().cuda()
    prompts = prompts_of_lengths(5, 40, 17, 70, 3, 33)
    cfg = EngineConfig(block_size=16, num_blocks=64, max_num_seqs=6, max_num_batched_tokens=256, lookahead=True)
    llm = LLM(model=model, config=cfg)
    assert llm.runner.graphs
    res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    for p, g in zip(prompts, res):
        assert g.outputs[0].token_ids == reference_greedy(model, p, 10)
    assert llm.engine.num_lookahead_steps > 0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_side_stream_copies_match_recompute(compiled: bool) -> None:
    """EngineConfig.side_stream_copies: two decode input sets used in turn, lookahead inputs uploaded on a side
    stream, greedy tokens drawn straight into the next step's ids and copied out on another stream. Requests that
    end at different lengths (the lookahead keeps a subset) and, in a second batch, rows with logprobs (the draw
    writes a tensor of its own) give the recompute loop's tokens."""
    prompts = prompts_of_lengths(5, 40, 17, 70, 3, 33)
    eager = tiny_model().cuda()
    lengths = [10, 4, 12, 7, 10, 1]
    expected = [reference_greedy(eager, p, n) for p, n in zip(prompts, lengths)]
    cfg = EngineConfig(block_size=16, num_blocks=96, max_num_seqs=6, max_num_batched_tokens=256, compile=compiled,
                       side_stream_copies=True)  # fmt: skip
    llm = LLM(model=tiny_model().cuda(), config=cfg)
    sets = llm.runner.decode_sets
    assert sets is not None and len(sets.sets) == 2 and sets.upload_stream is not None
    for _ in range(2):  # twice: the second batch starts on whichever set the first left next
        res = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths])
        assert [r.outputs[0].token_ids for r in res] == expected
    assert llm.engine.num_lookahead_steps > 0
    res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2))
    assert [r.outputs[0].token_ids for r in res] == [reference_greedy(eager, p, 10) for p in prompts]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_argmax_in_graph_matches_recompute(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``DecodePlan.argmax_in_graph``: each decode graph draws its rows' greedy tokens into the next set's ids, and a
    batch of plain greedy rows takes them (the sampler's own argmax kernel runs for none of its decode steps). Rows
    that end at different lengths, rows with logprobs and sampled rows beside greedy ones draw as before."""
    from mcore_infer import sampling

    prompts = prompts_of_lengths(5, 40, 17, 70, 3, 33)
    eager = tiny_model().cuda()
    lengths = [10, 4, 12, 7, 10, 1]
    expected = [reference_greedy(eager, p, n) for p, n in zip(prompts, lengths)]
    plan = replace(DECODE_PRESETS["row"], gated_norm_gemv=False, argmax_in_graph=True)
    cfg = EngineConfig(block_size=16, num_blocks=96, max_num_seqs=6, max_num_batched_tokens=256, compile=compiled,
                       side_stream_copies=True, decode_kernels=plan)  # fmt: skip
    llm = LLM(model=tiny_model().cuda(), config=cfg)
    sets = llm.runner.decode_sets
    assert sets is not None and sets.draws
    argmaxes: list[int] = []
    real = sampling.row_argmax
    monkeypatch.setattr(sampling, "row_argmax", lambda x, **k: argmaxes.append(x.shape[0]) or real(x, **k))
    for _ in range(2):
        res = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths])
        assert [r.outputs[0].token_ids for r in res] == expected
    assert llm.engine.num_lookahead_steps > 0
    assert len(argmaxes) < llm.engine.num_steps // 2  # the prefill steps' draws, not the graphs' decode steps
    res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2))
    assert [r.outputs[0].token_ids for r in res] == [reference_greedy(eager, p, 10) for p in prompts]
    mixed = [SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=6, ignore_eos=True, seed=i) for i in range(6)]
    first = [r.outputs[0].token_ids for r in llm.generate(prompts, mixed)]
    again = [r.outputs[0].token_ids for r in llm.generate(prompts, mixed)]
    assert first == again and all(first[i] == reference_greedy(eager, prompts[i], 6) for i in (1, 3, 5))


@pytest.mark.parametrize("up_mb", [0.0, 0.01], ids=["proj", "proj+up"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_l2_prefetch_matches_recompute(compiled: bool, up_mb: float) -> None:
    """EngineConfig.l2_prefetch: each small step's attention kernel also prefetches its layer's output-projection
    weight (and the up projection's first bytes) into L2 (``cp.async.bulk.prefetch.L2`` on Hopper, in CUDA graphs):
    the recompute loop's tokens."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the bulk L2 prefetch needs compute capability 9.0")
    prompts = prompts_of_lengths(5, 40, 17, 70, 3, 33)
    eager = tiny_model().cuda()
    expected = [reference_greedy(eager, p, 10) for p in prompts]
    cfg = EngineConfig(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, compile=compiled,
                       l2_prefetch=True, l2_prefetch_up_mb=up_mb)  # fmt: skip
    llm = LLM(model=tiny_model().cuda(), config=cfg)
    assert llm.runner.prefetch is not None and len(llm.runner.prefetch) == len(eager.decoder.layers)
    res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert [r.outputs[0].token_ids for r in res] == expected


@pytest.mark.parametrize("residual", [False, True], ids=["", "deferred_residual"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_rope_engine_matches_recompute(compiled: bool, residual: bool) -> None:
    """``rope_in_attention``: RoPE inside the KV-write and attention kernels (q/k/v read in place from the QKV
    output), in CUDA graphs, with and without compiled layers, deferred residual adds and the KV write inside the
    attention kernel: greedy tokens unchanged."""
    prompts = prompts_of_lengths(5, 40, 17, 70, 3, 33)
    eager = tiny_model().cuda()
    expected = [reference_greedy(eager, p, 10) for p in prompts]
    plan = DecodePlan(rope_in_attention=True, kv_write_in_attention=residual, defer_residual=residual)
    cfg = EngineConfig(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, compile=compiled,
                       decode_kernels=plan)  # fmt: skip
    llm = LLM(model=tiny_model().cuda(), config=cfg)
    assert llm.runner.backend == "triton" and llm.runner.graphs and llm.runner.plan == plan
    res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert [r.outputs[0].token_ids for r in res] == expected


ATTENTION = DECODE_PRESETS["attention"]
LAUNCHES = DecodeLaunches(swiglu_down=GemvLaunch(4, 16), proj_partials=GemvLaunch(2, 8, 512, 2),
                          row_gemv=GemvLaunch(1, 16, 256, 4), norm_linear=NormLinearLaunch(2, 32, 4, 3))  # fmt: skip
GEMV_PLANS = {
    **{k: replace(ATTENTION, **{k: True}) for k in ("norm_linear", "swiglu_down", "proj_partials", "row_gemv")},
    "row": DECODE_PRESETS["row"],
    "row-launches": replace(DECODE_PRESETS["row"], launches=LAUNCHES),
    "row-no-pdl": replace(DECODE_PRESETS["row"], pdl=False),
    "row-no-fc1": replace(DECODE_PRESETS["row"], row_fc1=False),
    "row-no-combine-in-attention": replace(DECODE_PRESETS["row"], combine_in_attention=False),
    "row-no-norm-gemv": replace(DECODE_PRESETS["row"], norm_gemv=False),
    "row-gemvs-only": replace(DECODE_PRESETS["row"], row_fc1=False, combine_in_attention=False, norm_gemv=False),
    "row-fused-mlp": replace(DECODE_PRESETS["row"], swiglu_down=False, row_fc1=False, fused_mlp=True),
    "fused-mlp-no-defer": DecodePlan(fused_mlp=True),
    "row-norm-gemv-fused-mlp": replace(
        DECODE_PRESETS["row"], swiglu_down=False, row_fc1=False, fused_mlp=True, norm_gemv=True
    ),
    "norm_linear-launch": replace(DECODE_PRESETS["norm_linear"], launches=LAUNCHES),
    **{
        f"row-attention-{a}": replace(
            DECODE_PRESETS["row"], launches=DecodeLaunches(attention=AttentionLaunch.parse(a))
        )
        for a in ("8,16,1,8,8", "4,16,1,4,4", "4,64,1,4")
    },  # (the graphs take the plan's attention launch)
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("fusion", list(GEMV_PLANS))
def test_gemv_fusions_match_recompute(fusion: str, compiled: bool) -> None:
    """The decode plans with the Triton GEMV kernels (norms inside the projections, SwiGLU inside the split-K down
    projection, the output projection's partial sums, the QKV row GEMV; at the heuristic launches and at launches
    the plan passes), in CUDA graphs, with every other decode fusion: greedy tokens unchanged."""
    prompts = prompts_of_lengths(5, 40, 17, 70, 3, 33)
    eager = tiny_model().cuda()
    expected = [reference_greedy(eager, p, 10) for p in prompts]
    cfg = EngineConfig(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, compile=compiled,
                       decode_kernels=GEMV_PLANS[fusion])  # fmt: skip
    llm = LLM(model=tiny_model().cuda(), config=cfg)
    resolved = replace(GEMV_PLANS[fusion], gated_norm_gemv=False)  # (the row preset's; the model has no Mamba layer)
    assert llm.runner.backend == "triton" and llm.runner.graphs and llm.runner.plan == resolved
    res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert [r.outputs[0].token_ids for r in res] == expected


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_auto_plan_on_the_gpu(compiled: bool) -> None:
    """``decode_kernels="auto"`` (the default) on CUDA with the Triton backend: the row kernels with compiled
    layers, the attention-side fusions alone without."""
    cfg = EngineConfig(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, compile=compiled)
    llm = LLM(model=tiny_model().cuda(), config=cfg)
    assert llm.runner.plan == replace(DECODE_PRESETS["row" if compiled else "attention"], gated_norm_gemv=False)
