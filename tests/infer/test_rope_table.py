"""The serving engine's precomputed rotary tables (:class:`mcore_infer.rope_table.RotaryTable`) give exactly the
values the model's RoPE computes per step, in one gather, and the engine's steps use them."""

from __future__ import annotations

import pytest
import torch

from mcore_infer import SamplingParams
from mcore_infer._triton_attention import _rotary_rows
from mcore_infer.rope_table import RotaryTable
from mcore_models.config import RopeScaling
from mcore_models.transformer.rope import RotaryEmbedding
from tests.infer._tiny import prompts_of_lengths, reference_greedy, tiny_llm, tiny_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, RopeScaling(8.0, 1.0, 4.0, 8192)], ids=["plain", "llama3"])
def test_table_rows_are_the_computed_values_bit_for_bit(dtype: torch.dtype, scaling: RopeScaling | None) -> None:
    rope = RotaryEmbedding(64, 500000.0, scaling, "cpu")
    table = RotaryTable(rope, 9000, dtype)
    for pos in (torch.tensor([0]), torch.tensor([8999]), torch.arange(100, 131), torch.tensor([[5, 77], [6, 4095]])):
        got, want = table(pos, dtype), rope(pos, dtype)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == dtype and torch.equal(g, w)
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16  # another dtype: computed by the RoPE
    assert all(torch.equal(g, w) for g, w in zip(table(torch.arange(7), other), rope(torch.arange(7), other)))


def test_table_rows_reach_the_attention_kernel_uncopied() -> None:
    """cos and sin come contiguous, as the RoPE returns them (compiled layers see the same layouts), and the kernels
    read them in place."""
    table = RotaryTable(RotaryEmbedding(32, 10000.0, None, "cpu"), 64, torch.float32)
    cos, sin = table(torch.tensor([3, 9, 9]), torch.float32)
    assert cos.shape == (3, 1, 1, 32) and cos.is_contiguous() and sin.is_contiguous()
    c, s, stride, rot = _rotary_rows((cos, sin), 3, 64, cos)
    assert rot == 32 and stride == 32 and c.data_ptr() == cos.data_ptr() and s.data_ptr() == sin.data_ptr()


def test_the_engine_gathers_its_rotary_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serving steps take cos and sin from the table (the model's RoPE is not called) and give the recompute
    loop's greedy tokens."""
    model = tiny_model(num_layers=2)
    prompts = prompts_of_lengths(5, 19, 3)
    expected = [reference_greedy(model, p, 6) for p in prompts]
    llm = tiny_llm(model)
    table = llm.runner.decode.rotary_table
    assert isinstance(table, RotaryTable) and table.positions == llm.runner.max_model_len
    calls: list[int] = []
    real = RotaryEmbedding.forward

    def spy(self, *a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(RotaryEmbedding, "forward", spy)
    res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [r.outputs[0].token_ids for r in res] == expected
    assert not calls
