"""The paged-attention kernel's launch settings (:class:`~mcore_infer._attention_host.AttentionLaunch`): several
cache blocks per loop step (their ids gathered in one load, tiles reaching past a split's blocks masked), the split
cap, and a folded combine that skips splits with no block. Each equals the plain gather + SDPA reference for decode
tokens and prefill chunks, with the token's own key/value written by the kernel (decode) and without; the counters
return to zero. Runs on GPUs, or on the CPU under ``TRITON_INTERPRET=1`` (float32)."""

from __future__ import annotations

import os

import pytest
import torch

from mcore_infer import AttentionLaunch, DecodePlan
from mcore_infer._attention_host import SMALL_STEP_LAUNCH, default_launch, num_splits
from mcore_infer._triton_attention import paged_attention_triton, triton_available
from mcore_infer.attention import Segment, plain_paged_attention
from mcore_infer.kernels._counters import zeroed_counters
from tests.infer._kernels import KERNEL_DEVICES as DEVICES

_NEEDS = pytest.mark.skipif(not DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 with Triton")
_LAUNCHES = [AttentionLaunch(2, 16, 0), AttentionLaunch(4, 16, 1), AttentionLaunch(2, 8, 1), AttentionLaunch(1, 16, 1),
             AttentionLaunch(8, 1, 0, 8), AttentionLaunch(2, 16, 1, 4, 4), AttentionLaunch(1, 16, 0, 4, 3),
             AttentionLaunch(8, 16, 1, 8, 8)]  # fmt: skip
"""(the last three: splits of at least 4, 3 and 8 blocks, so the 7-block context goes to 2, 3 and 1 of them)"""


def _cache(device: str) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], torch.Tensor]:
    torch.manual_seed(5)
    groups, d, block, nblocks = 2, 64, 16, 24
    kc = torch.randn(nblocks, block, groups, d, device=device)
    vc = torch.randn_like(kc)
    tables = [[1, 5, 9, 11, 13, 7, 8], [2], [3, 4, 20]]
    bt = torch.zeros(3, 8, dtype=torch.int64, device=device)
    for i, row in enumerate(tables):
        bt[i, : len(row)] = torch.tensor(row)
    return kc, vc, tables, bt


@_NEEDS
@pytest.mark.parametrize("device", DEVICES or ["cpu"])
@pytest.mark.parametrize("launch", _LAUNCHES, ids=str)
@pytest.mark.parametrize("splits", [1, 4, 8])
@pytest.mark.parametrize("fold", [False, True])
def test_prefill_and_decode_rows_equal_the_reference(device: str, launch: AttentionLaunch, splits: int,
                                                     fold: bool) -> None:  # fmt: skip
    """Decode rows at contexts 103 (7 blocks: with 4 blocks a step, a last tile past the context's last block) and
    3, a 4-token prefill chunk ending at 40, and a padded row of context 0 (zeros, not NaN)."""
    kc, vc, tables, bt = _cache(device)
    segs = [Segment(0, 1, 0, 103), Segment(1, 2, 1, 3), Segment(2, 6, 2, 40)]
    tseq = torch.tensor([0, 1, 2, 2, 2, 2, 0], device=device)
    tctx = torch.tensor([103, 3, 37, 38, 39, 40, 0], device=device)
    q = torch.randn(7, 8, 64, device=device)
    ref = plain_paged_attention(q[:-1], kc, vc, segs, tables)
    for _ in range(2):  # the counters are back at zero after each call
        out = paged_attention_triton(q, kc, vc, bt, tseq, tctx, 0.125, splits=splits, fold=fold, launch=launch)
        torch.testing.assert_close(out[:-1], ref, atol=1e-4, rtol=1e-4)
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    counters = zeroed_counters(torch.device(device), 1, "attention")
    assert counters is not None and int(counters.abs().sum()) == 0


@_NEEDS
@pytest.mark.parametrize("device", DEVICES or ["cpu"])
@pytest.mark.parametrize("launch", _LAUNCHES, ids=str)
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_with_the_kv_write_equals_the_default_launch(device: str, launch: AttentionLaunch, splits: int) -> None:
    """Decode tokens whose own key/value the kernel writes (``new_kv``; with splits each program's first tile is
    loaded before the wait): the output and the cache equal the default launch's."""
    kc, vc, tables, bt = _cache(device)
    positions = [102, 0, 17]
    slots = [tables[i][p // 16] * 16 + p % 16 for i, p in enumerate(positions)]
    tseq, tctx = torch.tensor([0, 1, 2], device=device), torch.tensor([p + 1 for p in positions], device=device)
    qkv = torch.randn(3, 2, 6, 64, device=device)
    new_kv = (qkv[:, :, 4], qkv[:, :, 5], torch.tensor(slots, device=device))
    kc2, vc2 = kc.clone(), vc.clone()
    want = paged_attention_triton(qkv[:, :, :4], kc, vc, bt, tseq, tctx, 0.125, splits=splits, new_kv=new_kv,
                                  fold=True)  # fmt: skip
    got = paged_attention_triton(qkv[:, :, :4], kc2, vc2, bt, tseq, tctx, 0.125, splits=splits, new_kv=new_kv,
                                 fold=True, launch=launch)  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)


def test_num_splits_takes_the_cap() -> None:
    assert num_splits(1, 8, 4096) == 16  # batch 1 of 8 groups: the default cap
    assert num_splits(1, 8, 4096, cap=64) == 64
    assert num_splits(1, 8, 4096, cap=4) == 4
    assert num_splits(1, 8, 6, cap=64) == 8  # never more than a table row's blocks (as a power of two)
    assert num_splits(32, 8, 4096, cap=64) == 1  # enough programs without splitting


def test_launch_parse_and_errors() -> None:
    assert AttentionLaunch.parse("4,16,1") == AttentionLaunch(4, 16, 1)
    assert AttentionLaunch.parse("2") == AttentionLaunch(2, 16, 0, 4)
    assert AttentionLaunch.parse("8,64,1,8") == AttentionLaunch(8, 64, 1, 8)
    assert str(AttentionLaunch(4, 32, 1)) == "4,32,1,4,1"
    assert AttentionLaunch.parse("8,16,1,8,8") == AttentionLaunch(8, 16, 1, 8, 8)
    with pytest.raises(ValueError, match="MIN_BLOCKS=0 must be from 1 to 4096"):
        AttentionLaunch.parse("8,16,1,8,0")
    for text, what in (("3", "STEP=3"), ("4,128", "MAX_SPLITS=128"), ("4,16,2", "SKIP_EMPTY=2"), ("a", "integers"),
                       ("1,2,0,3", "WARPS=3"), ("1,2,0,4,5,1", "6 values")):  # fmt: skip
        with pytest.raises(ValueError, match=what):
            AttentionLaunch.parse(text)
    plan = DecodePlan.from_dict({"preset": "row", "launches": {"attention": "4,32,1"}})
    assert plan.launches.attention == AttentionLaunch(4, 32, 1)
    assert DecodePlan.from_dict(plan.to_dict()) == plan
    with pytest.raises(ValueError, match="DecodeLaunches.attention"):
        DecodePlan.from_dict({"preset": "row", "launches": {"attention": [0, 16, 0]}})


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
    reason="the Triton kernels on the CPU need TRITON_INTERPRET=1 and Triton",
)
def test_engine_takes_the_plans_attention_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DecodeLaunches.attention`` reaches every paged-attention call of an engine, whose greedy tokens equal the
    recompute loop's."""
    from mcore_infer import LLM, DecodeLaunches, EngineConfig, SamplingParams, attention
    from tests.infer._tiny import prompts_of_lengths, reference_greedy, tiny_model

    model = tiny_model()
    prompts = prompts_of_lengths(5, 37, 2)
    expected = [reference_greedy(model, p, 4) for p in prompts]
    launch = AttentionLaunch(2, 8, 1)
    plan = DecodePlan(rope_in_attention=True, kv_write_in_attention=True, combine_in_attention=True,
                      launches=DecodeLaunches(attention=launch))  # fmt: skip
    cfg = EngineConfig(block_size=8, num_blocks=48, max_num_seqs=4, max_num_batched_tokens=16,
                       attention_backend="triton", decode_kernels=plan)  # fmt: skip
    seen = []
    real = attention.paged_attention_triton
    monkeypatch.setattr(attention, "paged_attention_triton", lambda *a, **k: seen.append(k["launch"]) or real(*a, **k))
    res = LLM(model=model, config=cfg).generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [r.outputs[0].token_ids for r in res] == expected
    assert seen and set(seen) == {launch}


def _nan_scratch(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The kernel's split scratch (partial maxima, sums, outputs) filled with NaN, each maxima tensor appended to the
    list returned, so a test sees which splits stored a partial state."""
    from mcore_infer import _triton_attention

    scratch: list[torch.Tensor] = []

    def nan_scratch(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, heads, d = out.shape
        pm = torch.full((t, heads, splits), float("nan"), device=out.device)
        scratch.append(pm)
        return pm, torch.full_like(pm, float("nan")), torch.full((t, heads, splits, d), float("nan"), device=out.device)

    monkeypatch.setattr(_triton_attention, "_split_scratch", nan_scratch)
    return scratch


@_NEEDS
@pytest.mark.parametrize("device", DEVICES or ["cpu"])
@pytest.mark.parametrize("min_blocks,active", [(1, 7), (2, 4), (4, 2), (8, 1)])
def test_min_blocks_sends_a_short_context_to_fewer_splits(device: str, min_blocks: int, active: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A 7-block decode context over 8 splits, empty splits skipped: splits of at least ``min_blocks`` blocks leave
    ``active`` of them with blocks, and only those store a partial state (one alone writes the output itself); the
    output equals the reference either way."""
    kc, vc, tables, bt = _cache(device)
    scratch = _nan_scratch(monkeypatch)
    q = torch.randn(1, 8, 64, device=device)
    tseq, tctx = torch.tensor([0], device=device), torch.tensor([103], device=device)
    launch = AttentionLaunch(1, 16, 1, 4, min_blocks)
    out = paged_attention_triton(q, kc, vc, bt, tseq, tctx, 0.125, splits=8, fold=True, launch=launch)
    ref = plain_paged_attention(q, kc, vc, [Segment(0, 1, 0, 103)], tables)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    written = (~scratch[0][0, 0].isnan()).nonzero().flatten().tolist()
    assert written == ([] if active == 1 else list(range(active)))


@_NEEDS
@pytest.mark.parametrize("device", DEVICES or ["cpu"])
def test_small_steps_take_the_small_step_launch_by_default(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a launch from the plan, a step of at most four tokens runs :data:`SMALL_STEP_LAUNCH` (splits of at
    least 8 blocks: a 7-block context goes to one split, which writes the output itself) and a larger step
    ``AttentionLaunch()`` (every split stores its partial state, empty ones too); both equal the reference."""
    assert [default_launch(t) for t in (1, 4, 5, 64)] == [SMALL_STEP_LAUNCH] * 2 + [AttentionLaunch()] * 2
    assert AttentionLaunch.parse("8,16,1,8,8") == SMALL_STEP_LAUNCH
    kc, vc, tables, bt = _cache(device)
    scratch = _nan_scratch(monkeypatch)
    for tokens in (4, 5):
        q = torch.randn(tokens, 8, 64, device=device)
        tseq = torch.zeros(tokens, dtype=torch.int64, device=device)
        tctx = torch.full((tokens,), 103, device=device)
        out = paged_attention_triton(q, kc, vc, bt, tseq, tctx, 0.125, splits=8, fold=True)
        ref = plain_paged_attention(q, kc, vc, [Segment(i, i + 1, 0, 103) for i in range(tokens)], tables)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    small, large = ((~pm[:, 0].isnan()).any(0).nonzero().flatten().tolist() for pm in scratch)
    assert small == [] and large == list(range(8))
