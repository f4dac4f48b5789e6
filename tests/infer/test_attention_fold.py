"""The paged-attention kernel's split combine folded into the kernel (``fold``: the last split of each token and
group to finish combines them) equals the two-kernel path and the plain gather + SDPA reference, call after call
(its counters return to zero). Runs on GPUs, or on the CPU under ``TRITON_INTERPRET=1`` (float32)."""

from __future__ import annotations

import os

import pytest
import torch

from mcore_infer import _triton_attention
from mcore_infer._triton_attention import paged_attention_triton, triton_available
from mcore_infer.attention import Segment, plain_paged_attention
from mcore_infer.kernels._counters import zeroed_counters
from mcore_models.transformer.rope import RotaryEmbedding
from tests.infer._kernels import KERNEL_DEVICES as DEVICES


def _case(device: str, dtype: torch.dtype) -> tuple:
    torch.manual_seed(3)
    groups, hpg, d, block, nblocks = 2, 4, 64, 16, 24
    kc = torch.randn(nblocks, block, groups, d, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    tables = [[1, 5, 9, 11, 13], [2], [3, 4, 20]]
    # a decode at context 70 (5 blocks), one at context 3, a 4-token chunk ending at context 40, a padded row
    segs = [Segment(0, 1, 0, 70), Segment(1, 2, 1, 3), Segment(2, 6, 2, 40)]
    tseq = [0, 1, 2, 2, 2, 2, 0]
    tctx = [70, 3, 37, 38, 39, 40, 0]
    bt = torch.zeros(3, 6, dtype=torch.int64, device=device)
    for i, row in enumerate(tables):
        bt[i, : len(row)] = torch.tensor(row)
    q = torch.randn(len(tseq), groups * hpg, d, device=device, dtype=dtype)
    meta = (bt, torch.tensor(tseq, device=device), torch.tensor(tctx, device=device))
    return q, kc, vc, meta, segs, tables


@pytest.mark.skipif(not DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 with Triton")
@pytest.mark.parametrize("device", DEVICES or ["cpu"])
@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("rot", [64, 0])
def test_folded_combine_equals_the_combine_kernel_and_the_reference(device: str, splits: int, rot: int) -> None:
    q, kc, vc, (bt, tseq, tctx), segs, tables = _case(device, torch.float32)
    rotary = RotaryEmbedding(rot, 10000.0, None, device)(tctx - 1, torch.float32) if rot else None
    two = paged_attention_triton(q, kc, vc, bt, tseq, tctx, 0.125, splits=splits, rotary=rotary)
    for _ in range(3):  # the counters are back at zero after each call
        folded = paged_attention_triton(q, kc, vc, bt, tseq, tctx, 0.125, splits=splits, rotary=rotary, fold=True)
        torch.testing.assert_close(folded, two, atol=1e-5, rtol=1e-5)
        assert torch.equal(folded[-1], torch.zeros_like(folded[-1]))  # context 0: zeros, not NaN
    counters = zeroed_counters(torch.device(device), 1, "attention")
    assert counters is not None and int(counters.abs().sum()) == 0
    if rot == 0:
        ref = plain_paged_attention(q[:-1], kc, vc, segs, tables)
        torch.testing.assert_close(folded[:-1], ref, atol=1e-4, rtol=1e-4)


class _NoLaunch:
    def __getitem__(self, grid: object) -> None:
        raise AssertionError("the combine kernel was launched")


@pytest.mark.skipif(not DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 with Triton")
@pytest.mark.parametrize("device", DEVICES or ["cpu"])
def test_fold_launches_no_combine_kernel(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``fold`` one kernel computes the result (equal to one split's); the combine kernel is never launched."""
    q, kc, vc, (bt, tseq, tctx), _, _ = _case(device, torch.float32)
    one = paged_attention_triton(q, kc, vc, bt, tseq, tctx, 0.125, splits=1)
    attend, _, store = _triton_attention._kernel()
    monkeypatch.setattr(_triton_attention, "_KERNEL", (attend, _NoLaunch(), store))
    folded = paged_attention_triton(q, kc, vc, bt, tseq, tctx, 0.125, splits=4, fold=True)
    torch.testing.assert_close(folded, one, atol=1e-5, rtol=1e-5)
    with pytest.raises(AssertionError, match="combine kernel was launched"):
        paged_attention_triton(q, kc, vc, bt, tseq, tctx, 0.125, splits=4)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
    reason="the Triton kernels on the CPU need TRITON_INTERPRET=1 and Triton",
)
def test_engine_with_the_combine_in_attention_matches_recompute(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DecodePlan.combine_in_attention``: an engine on the Triton backend gives the recompute loop's greedy tokens
    and never launches the combine kernel."""
    from mcore_infer import LLM, DecodePlan, EngineConfig, SamplingParams
    from tests.infer._tiny import prompts_of_lengths, reference_greedy, tiny_model

    model = tiny_model()
    prompts = prompts_of_lengths(5, 19, 3)
    expected = [reference_greedy(model, p, 4) for p in prompts]
    plan = DecodePlan(rope_in_attention=True, kv_write_in_attention=True, combine_in_attention=True)
    cfg = EngineConfig(block_size=16, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=16,
                       attention_backend="triton", decode_kernels=plan)  # fmt: skip
    llm = LLM(model=model, config=cfg)
    attend, _, store = _triton_attention._kernel()
    monkeypatch.setattr(_triton_attention, "_KERNEL", (attend, _NoLaunch(), store))
    splits = []
    real = _triton_attention.num_splits
    monkeypatch.setattr(_triton_attention, "num_splits", lambda *a, **k: splits.append(real(*a, **k)) or splits[-1])
    res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [r.outputs[0].token_ids for r in res] == expected
    assert max(splits) > 1  # the decode steps split their blocks (and combined them inside the kernel)
