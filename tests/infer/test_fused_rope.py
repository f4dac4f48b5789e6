"""RoPE applied inside the paged-attention and KV-write kernels (``DecodePlan.rope_in_attention``) equals rotating q and k
first (``apply_rotary``) and running the plain path. Kernel checks run on GPUs, or on the CPU under
``TRITON_INTERPRET=1`` (float32)."""

from __future__ import annotations

import os

import pytest
import torch

from mcore_infer._triton_attention import paged_attention_triton, store_kv_triton, triton_available
from mcore_infer.attention import Segment, plain_paged_attention
from mcore_models.transformer.rope import RotaryEmbedding, apply_rotary
from tests.infer._kernels import KERNEL_DEVICES as DEVICES


@pytest.mark.skipif(not DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 with Triton")
@pytest.mark.parametrize("device", DEVICES or ["cpu"])
@pytest.mark.parametrize("rot", [64, 32, 0])  # full and partial rotation of a 64-dim head; none (grouped q view)
def test_rope_in_the_kernels_equals_rotating_first(device: str, rot: int) -> None:
    torch.manual_seed(0)
    groups, hpg, d, block, nblocks = 2, 4, 64, 16, 12
    dtype = torch.float32
    rope = RotaryEmbedding(max(rot, 2), 10000.0, None, device)
    # one request: a 20-token prefill, then a decode token at position 20 (two steps, like the engine)
    tables = [[3, 7]]
    bt = torch.tensor([[3, 7, 0]], device=device)
    kc = torch.zeros(nblocks, block, groups, d, device=device, dtype=dtype)
    vc = torch.zeros_like(kc)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    for positions in (list(range(20)), [20]):
        t = len(positions)
        pos = torch.tensor(positions, device=device)
        cos, sin = rope(pos, dtype)  # [t, 1, 1, rot]
        rotary = (cos, sin) if rot else None
        qkv = torch.randn(t, groups, hpg + 2, d, device=device, dtype=dtype)  # the QKV projection's layout
        q, k, v = qkv[:, :, :hpg], qkv[:, :, hpg], qkv[:, :, hpg + 1]
        slots = torch.tensor([tables[0][p // block] * block + p % block for p in positions], device=device)
        store_kv_triton(k, v, kc, vc, slots, rotary=rotary)
        k_rot = apply_rotary(k[:, None], cos, sin)[:, 0] if rot else k
        kc_ref.view(-1, groups, d)[slots] = k_rot
        vc_ref.view(-1, groups, d)[slots] = v
        assert torch.allclose(kc, kc_ref, atol=1e-5) and torch.equal(vc, vc_ref)
        tseq = torch.zeros(t, dtype=torch.int64, device=device)
        tctx = pos + 1
        out = paged_attention_triton(q, kc, vc, bt, tseq, tctx, d**-0.5, rotary=rotary)
        q_flat = q.reshape(t, 1, groups * hpg, d)
        q_rot = apply_rotary(q_flat, cos, sin)[:, 0] if rot else q_flat[:, 0]
        ref = plain_paged_attention(q_rot, kc_ref, vc_ref, [Segment(0, t, 0, positions[-1] + 1)], tables)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
    reason="the Triton kernels on the CPU need TRITON_INTERPRET=1 and Triton",
)
def test_engine_with_fused_kernels_in_the_interpreter_matches_recompute() -> None:
    from mcore_infer import LLM, EngineConfig, SamplingParams
    from tests.infer._tiny import prompts_of_lengths, reference_greedy, tiny_model

    model = tiny_model()
    prompts = prompts_of_lengths(5, 19, 3)
    expected = [reference_greedy(model, p, 4) for p in prompts]
    cfg = EngineConfig(block_size=16, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=16,
                       attention_backend="triton", decode_kernels="attention")  # fmt: skip
    llm = LLM(model=model, config=cfg)
    ctx_seen = []
    fused_writes = []
    real = llm.runner.decode.forward

    def spy(*a: object, **k: object) -> object:
        ctx_seen.append(getattr(k.get("inference_context"), "fuses_rotary", None))
        fused_writes.append(getattr(k.get("inference_context"), "fuse_kv_write", None))
        return real(*a, **k)

    llm.runner.decode.forward = spy  # type: ignore[method-assign]
    res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [r.outputs[0].token_ids for r in res] == expected
    assert ctx_seen and all(ctx_seen)
    assert any(fused_writes) and not all(fused_writes)  # decode steps fused the KV write, prefill steps did not


@pytest.mark.skipif(not DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 with Triton")
@pytest.mark.parametrize("device", DEVICES or ["cpu"])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("rot", [64, 0])
def test_kv_write_inside_attention_equals_writing_first(device: str, splits: int, rot: int) -> None:
    """``new_kv``: decode tokens take their own key/value from the inputs and the attention kernel writes them to the
    cache; the output and the cache equal a KV write followed by attention (a padded row with context 0 too)."""
    torch.manual_seed(1)
    groups, hpg, d, block, nblocks = 2, 4, 64, 16, 16
    dtype = torch.float32
    rope = RotaryEmbedding(max(rot, 2), 10000.0, None, device)
    kc = torch.randn(nblocks, block, groups, d, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    tables = [[1, 5, 9], [2], [3, 4]]
    positions = [40, 0, 17]  # decode tokens of three requests (cache holds their earlier keys), then a padded row
    bt = torch.zeros(3, 4, dtype=torch.int64, device=device)
    for i, row in enumerate(tables):
        bt[i, : len(row)] = torch.tensor(row)
    slots = [tables[i][p // block] * block + p % block for i, p in enumerate(positions)] + [0]
    slots_t = torch.tensor(slots, device=device)
    tseq = torch.tensor([0, 1, 2, 0], device=device)
    tctx = torch.tensor([p + 1 for p in positions] + [0], device=device)
    cos, sin = rope(torch.tensor(positions + [0], device=device), dtype)
    rotary = (cos, sin) if rot else None
    qkv = torch.randn(4, groups, hpg + 2, d, device=device, dtype=dtype)
    q, k, v = qkv[:, :, :hpg], qkv[:, :, hpg], qkv[:, :, hpg + 1]
    kc2, vc2 = kc.clone(), vc.clone()
    store_kv_triton(k, v, kc, vc, slots_t, rotary=rotary)
    want = paged_attention_triton(q, kc, vc, bt, tseq, tctx, d**-0.5, splits=splits, rotary=rotary)
    got = paged_attention_triton(q, kc2, vc2, bt, tseq, tctx, d**-0.5, splits=splits, rotary=rotary,
                                 new_kv=(k, v, slots_t))  # fmt: skip
    torch.testing.assert_close(got[:3], want[:3], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    torch.testing.assert_close(kc2, kc, atol=1e-6, rtol=1e-6)
    assert torch.equal(vc2, vc)
