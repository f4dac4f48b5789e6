"""The paged attention's L2 prefetch of the next kernel's weight (``EngineConfig.l2_prefetch``,
:mod:`mcore_infer.kernels.l2_prefetch`): the row of programs it adds to the grid changes no output, leaves the
folded combine's counters at zero and takes effect in small steps only; an engine with it passes each attention layer's
output-projection weight and gives the recompute loop's tokens. Under ``TRITON_INTERPRET=1`` the added programs
return without prefetching (the interpreter runs no PTX); ``tests/infer/test_gpu.py`` runs the prefetch itself."""

from __future__ import annotations

import os

import pytest
import torch

from mcore_infer import AttentionLaunch
from mcore_infer._triton_attention import paged_attention_triton, triton_available
from mcore_infer.attention import Segment, plain_paged_attention
from mcore_infer.kernels._counters import zeroed_counters
from mcore_infer.kernels.l2_prefetch import prefetch_args
from tests.infer._kernels import KERNEL_DEVICES as DEVICES

_NEEDS = pytest.mark.skipif(not DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 with Triton")


def test_prefetch_args() -> None:
    """Each region gives the kernel its tensor, its bytes (at most the tensor's) and a row; none, a misaligned view
    or no bytes give none; three regions are refused."""
    w, w2, unused = torch.zeros(64, 32, dtype=torch.bfloat16), torch.zeros(8, 8), torch.zeros(4)
    two = prefetch_args([(w, 10**9), (w2, 100)], unused)
    assert two["PF"] is w and two["pf_bytes"] == 64 * 32 * 2 and two["PF2"] is w2 and two["pf2_bytes"] == 100
    assert two["PF_ROWS"] == 2 and two["PF_ASM"] == (os.environ.get("TRITON_INTERPRET") != "1")
    one = prefetch_args([(w.view(-1)[1:], 64), (w2, 0), (w2, 16)], unused)
    assert one["PF"] is w2 and one["pf_bytes"] == 16 and one["PF2"] is unused and one["PF_ROWS"] == 1
    off = prefetch_args(None, unused)
    assert off["PF"] is off["PF2"] is unused and off["PF_ROWS"] == 0 and not off["PF_ASM"]
    with pytest.raises(ValueError, match="two at most"):
        prefetch_args([(w, 16)] * 3, unused)


@_NEEDS
@pytest.mark.parametrize("device", DEVICES or ["cpu"])
@pytest.mark.parametrize("launch", [None, AttentionLaunch(8, 16, 1, 8, 8), AttentionLaunch(2, 8, 0)], ids=str)
@pytest.mark.parametrize("fold", [False, True])
def test_the_prefetch_row_changes_no_output(device: str, launch: AttentionLaunch | None, fold: bool) -> None:
    """Decode rows of 7 blocks and of 3 tokens with the kernel writing their own keys and values, split 4 ways:
    the outputs and the cache equal those without the prefetch, with one region and with two (the counters return
    to zero)."""
    torch.manual_seed(7)
    groups, d, block = 2, 64, 16
    kc = torch.randn(24, block, groups, d, device=device)
    vc = torch.randn_like(kc)
    tables = [[1, 5, 9, 11, 13, 7, 8], [2]]
    bt = torch.zeros(2, 8, dtype=torch.int64, device=device)
    for i, row in enumerate(tables):
        bt[i, : len(row)] = torch.tensor(row)
    positions = [102, 2]
    slots = torch.tensor([tables[i][p // block] * block + p % block for i, p in enumerate(positions)], device=device)
    tseq, tctx = torch.tensor([0, 1], device=device), torch.tensor([p + 1 for p in positions], device=device)
    qkv = torch.randn(2, groups, 6, d, device=device)
    weight = torch.randn(256, 512, device=device, dtype=torch.bfloat16)
    up = torch.randn(512, 256, device=device, dtype=torch.bfloat16)
    outs, caches = [], []
    for prefetch in (None, [(weight, weight.numel() * 2)], [(weight, 4096), (up, 10**6)]):
        k2, v2 = kc.clone(), vc.clone()
        new_kv = (qkv[:, :, 4], qkv[:, :, 5], slots)
        outs.append(paged_attention_triton(qkv[:, :, :4], k2, v2, bt, tseq, tctx, 0.125, splits=4, new_kv=new_kv,
                                           fold=fold, launch=launch, prefetch=prefetch))  # fmt: skip
        caches.append((k2, v2))
    for out, (k2, v2) in zip(outs[1:], caches[1:], strict=True):
        assert torch.equal(out, outs[0]) and torch.equal(k2, caches[0][0]) and torch.equal(v2, caches[0][1])
    ref = plain_paged_attention(qkv[:1, :, :4].reshape(1, 8, d), caches[0][0], caches[0][1],
                                [Segment(0, 1, 0, 103)], tables)  # fmt: skip
    torch.testing.assert_close(outs[1][:1], ref, atol=1e-4, rtol=1e-4)
    counters = zeroed_counters(torch.device(device), 1, "attention")
    assert counters is not None and int(counters.abs().sum()) == 0


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
    reason="the Triton kernels on the CPU need TRITON_INTERPRET=1 and Triton",
)
def test_engine_passes_each_layers_output_projection(monkeypatch: pytest.MonkeyPatch) -> None:
    """``EngineConfig(l2_prefetch=True, l2_prefetch_up_mb=...)``: small steps' attention calls get their layer's
    whole ``linear_proj`` weight and the first bytes of its ``linear_fc1`` weight, a prefill of more than 4 tokens
    none; the greedy tokens equal the recompute loop's."""
    from mcore_infer import LLM, EngineConfig, SamplingParams, attention
    from tests.infer._tiny import prompts_of_lengths, reference_greedy, tiny_model

    model = tiny_model()
    prompts = prompts_of_lengths(5, 37, 2)
    expected = [reference_greedy(model, p, 4) for p in prompts]
    cfg = EngineConfig(block_size=8, num_blocks=48, max_num_seqs=4, max_num_batched_tokens=64,
                       attention_backend="triton", l2_prefetch=True, l2_prefetch_up_mb=1 / 1024)  # fmt: skip
    seen: list[tuple[int, torch.Tensor | None]] = []
    real = attention.paged_attention_triton
    monkeypatch.setattr(attention, "paged_attention_triton",
                        lambda q, *a, **k: seen.append((q.shape[0], k["prefetch"])) or real(q, *a, **k))  # fmt: skip
    llm = LLM(model=model, config=cfg)
    layers = {int(k): v for k, v in model.decoder.layers.items()}
    want = {n: [(x.self_attention.linear_proj.weight, x.self_attention.linear_proj.weight.numel() * 4),
                (x.mlp.linear_fc1.weight, 1024)] for n, x in layers.items()}  # fmt: skip
    got = llm.runner.prefetch
    assert got is not None and got.keys() == want.keys()
    for n, regions in want.items():
        assert [(id(t), b) for t, b in got[n]] == [(id(t), b) for t, b in regions]  # (float32 weights: 4 bytes)
    res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [r.outputs[0].token_ids for r in res] == expected
    small = [regions for t, regions in seen if t <= 4]
    assert small and {id(r[0][0]) for r in small} == {id(r[0][0]) for r in want.values()}  # every layer's, in turn
    wanted = [[(id(t), b) for t, b in r] for r in want.values()]
    assert all([(id(t), b) for t, b in r] in wanted for r in small)
    assert all(r is None for t, r in seen if t > 4) and any(t > 4 for t, _ in seen)
