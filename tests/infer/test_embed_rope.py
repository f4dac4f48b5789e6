"""The decode step's first kernel (:func:`mcore_infer.kernels.embed_rope.embed_rope`) gives the embedding rows and
the rotary rows bit for bit as the three gathers do, and a decode plan with ``embed_rope`` runs it in every small step
with the plain loop's greedy tokens. The kernel runs on GPUs, or on the CPU under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mcore_infer import DECODE_PRESETS, SamplingParams
from mcore_infer.kernels import embed_rope as embed_rope_module
from mcore_infer.kernels.embed_rope import embed_rope, embed_rope_reference
from mcore_infer.rope_table import RotaryTable
from mcore_models.transformer.rope import RotaryEmbedding
from tests.infer._kernels import KERNEL_DEVICES as DEVICES
from tests.infer._tiny import prompts_of_lengths, reference_greedy, tiny_llm, tiny_model

EMBED_ROPE = replace(DECODE_PRESETS["row"], embed_rope=True)


@pytest.mark.skipif(not DEVICES, reason="needs CUDA and Triton, or TRITON_INTERPRET=1 with Triton")
@pytest.mark.parametrize("device", DEVICES or ["cpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize(("hidden", "rot"), [(64, 16), (96, 24), (2048, 64)])
def test_the_kernel_gives_the_gathers_bit_for_bit(
    device: str, dtype: torch.dtype, hidden: int, rot: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Non-power-of-two widths (96 features, 24 rotary dims) included; the ids and positions of 1 to 4 tokens at
    the tables' first and last rows."""
    g = torch.Generator().manual_seed(hidden + rot)
    weight = torch.randn(300, hidden, generator=g).to(dtype).to(device)
    table = RotaryTable(RotaryEmbedding(rot, 10000.0, None, "cpu"), 500, dtype)
    cos, sin = table.cos.to(device), table.sin.to(device)
    calls: list[int] = []
    real = embed_rope_module._kernel
    monkeypatch.setattr(embed_rope_module, "_kernel", lambda: calls.append(1) or real())
    for ids, pos in (([0], [0]), ([299, 5], [499, 1]), ([7, 7, 123], [3, 250, 4]), ([1, 2, 3, 298], [9, 8, 7, 6])):
        i, p = torch.tensor(ids, device=device), torch.tensor(pos, device=device)
        (h, (c, s)), (want_h, (want_c, want_s)) = (
            embed_rope(i, p, weight, cos, sin),
            embed_rope_reference(i, p, weight, cos, sin),
        )
        for got, want in ((h, want_h), (c, want_c), (s, want_s)):
            assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got.cpu(), want.cpu())
        assert h.shape == (len(ids), 1, hidden) and c.shape == (len(ids), 1, 1, rot)
    assert len(calls) == 4  # the kernel ran each time (not the gathers)


def test_the_gathers_equal_the_model_and_the_table() -> None:
    """The reference is what a decode step computes without the kernel: the model's embedding and the table's rows."""
    model = tiny_model()
    table = RotaryTable(model.rotary, 256, torch.float32)
    ids, pos = torch.tensor([[5, 200, 3]]), torch.tensor([[0, 17, 255]])
    h, (c, s) = model.embed(ids, pos, rotary=table)
    got_h, (got_c, got_s) = embed_rope_reference(ids[0], pos[0], model.embedding.word_embeddings.weight, table.cos,
                                                 table.sin)  # fmt: skip
    assert torch.equal(h, got_h) and torch.equal(c, got_c) and torch.equal(s, got_s)


def test_bad_shapes_are_named() -> None:
    w, t = torch.zeros(10, 8), torch.zeros(20, 4)
    with pytest.raises(ValueError, match="ids"):
        embed_rope(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long), w, t, t)
    with pytest.raises(ValueError, match="dtype"):
        embed_rope(torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), w, t.half(), t.half())


def test_a_plan_with_embed_rope_runs_it_in_small_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step of at most 4 tokens takes its embedding and rotary rows from :func:`embed_rope` (prefill chunks of
    more tokens from the model's gathers), and the greedy tokens are the recompute loop's."""
    from mcore_infer import decode

    prompts = prompts_of_lengths(5, 40, 3)
    expected = [reference_greedy(tiny_model(num_layers=2), p, 8) for p in prompts]
    rows: list[int] = []
    real = decode.embed_rope
    monkeypatch.setattr(decode, "embed_rope", lambda ids, *a: rows.append(ids.numel()) or real(ids, *a))
    llm = tiny_llm(tiny_model(num_layers=2), decode_kernels=EMBED_ROPE)
    assert llm.engine.runner.plan.embed_rope
    res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [r.outputs[0].token_ids for r in res] == expected
    assert len(rows) >= 7 and max(rows) <= 4  # (the three requests decode together: 3 rows a step)


def test_a_model_without_a_rope_table_runs_the_gathers() -> None:
    """Learned position embeddings (no RoPE) or no rotary table: ``embed_rope`` does not concern the model and stays
    off under any plan (the layers' fusions still apply)."""
    from mcore_infer import prepare_for_decode

    model = tiny_model(position_embedding="learned_absolute")
    assert not tiny_llm(model, decode_kernels=EMBED_ROPE).engine.runner.plan.embed_rope
    assert not prepare_for_decode(tiny_model(), EMBED_ROPE).plan.embed_rope  # (no max_positions: no table)
    assert prepare_for_decode(tiny_model(), EMBED_ROPE, max_positions=64).plan.embed_rope
