"""GPU paths (run through the device tool; skipped without CUDA + Triton): the paged Triton kernel against the
plain gather + SDPA path, CUDA-graph decode against eager steps, and the GPU engine against the recompute loop."""

from __future__ import annotations

import pytest
import torch

from mcore_infer import LLM, EngineConfig, SamplingParams
from mcore_infer._triton_attention import paged_attention_triton, triton_available
from mcore_infer.attention import Segment, plain_paged_attention
from mcore_infer.runner import StepBatch
from tests.infer._tiny import prompts_of_lengths, reference_greedy, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton"),
]


@pytest.mark.parametrize("dtype,block", [(torch.bfloat16, 16), (torch.bfloat16, 32), (torch.float32, 16)])
def test_triton_paged_attention_matches_plain(dtype: torch.dtype, block: int) -> None:
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
    q = torch.randn(t0, heads, d, device="cuda", dtype=dtype)
    bt = torch.zeros(len(tables), 17, dtype=torch.int64, device="cuda")
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    ref = plain_paged_attention(q.float(), kc.float(), vc.float(), segs, tables)
    out = paged_attention_triton(
        q, kc, vc, bt, torch.tensor(tseq, device="cuda"), torch.tensor(tctx, device="cuda"), d**-0.5
    )
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(out.float(), ref, atol=tol, rtol=tol), (out.float() - ref).abs().max()


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
    saved, r.graphs = r.graphs, {}
    eager = r.execute(dec)
    r.graphs = saved
    assert torch.allclose(graphed, eager, atol=1e-5), (graphed - eager).abs().max()


def test_gpu_engine_greedy_matches_recompute() -> None:
    model = tiny_model().cuda()
    llm = LLM(model=model, config=EngineConfig(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32))
    assert llm.runner.backend == "triton" and llm.runner.graphs
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
