"""Sampling cannot fail numerically: extreme but valid parameters give a valid token, leave the other rows of the
batch exactly as they were, and random parameters over their whole valid ranges never raise."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mcore_infer import SamplingParams
from mcore_infer.errors import InvalidRequestError
from mcore_infer.sampling import Sampler, SampleRow
from tests.infer._tiny import prompts_of_lengths, tiny_llm, tiny_model

V = 50
EXTREME = [
    SamplingParams(temperature=1e-45, max_tokens=6, ignore_eos=True),
    SamplingParams(top_p=5e-324, max_tokens=6, ignore_eos=True, seed=1),
    SamplingParams(repetition_penalty=1e-300, temperature=1.0, max_tokens=6, ignore_eos=True, seed=2),
    SamplingParams(repetition_penalty=1e300, temperature=1e-5, max_tokens=6, ignore_eos=True, logprobs=2),
]
NORMAL = [
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=7, max_tokens=6, ignore_eos=True, logprobs=1),
    SamplingParams(temperature=1.1, repetition_penalty=1.3, presence_penalty=0.5, seed=3, max_tokens=6,
                   ignore_eos=True),
]  # fmt: skip


def _rows(params: list[SamplingParams], sampler: Sampler) -> list[SampleRow]:
    gens = [sampler.request_generator(p.seed) if p.seed is not None else None for p in params]
    return [SampleRow(p, [1, 2, 3, 4], [5, 6], g) for p, g in zip(params, gens)]


@pytest.mark.parametrize("scale", [1.0, 1e30])
@pytest.mark.parametrize("extreme", EXTREME, ids=["temperature", "top_p", "rep_small", "rep_large"])
def test_extreme_values_give_a_valid_token_and_leave_other_rows_alone(extreme: SamplingParams, scale: float) -> None:
    logits = torch.randn(len(NORMAL) + 1, V, generator=torch.Generator().manual_seed(0)) * scale
    alone = Sampler(seed=0)(logits[: len(NORMAL)], _rows(NORMAL, Sampler()))
    s = Sampler(seed=0)
    mixed = s(logits, _rows([*NORMAL, extreme], s))
    assert mixed.tokens[: len(NORMAL)] == alone.tokens
    assert mixed.logprobs[: len(NORMAL)] == alone.logprobs
    assert 0 <= mixed.tokens[-1] < V
    assert all(lp is None or not math.isnan(lp) for lp in mixed.logprobs)


def test_rows_without_a_valid_distribution_take_the_argmax() -> None:
    s = Sampler(seed=0)
    p = SamplingParams(temperature=1.0, logprobs=1)
    logits = torch.tensor(
        [[float("-inf")] * 4, [float("nan")] * 4, [1.0, float("inf"), 0.0, 2.0], [0.0, 0.0, 3.0, 0.0]]
    )
    out = s(logits, [SampleRow(p, [], [])] * 4)
    assert all(0 <= t < 4 for t in out.tokens) and out.tokens[2] == 1
    # every token banned (min_tokens with all of them stop tokens): still a token, from the raw logits
    banned = SampleRow(SamplingParams(temperature=0.0), [], [], banned=[0, 1, 2, 3])
    assert s(torch.tensor([[0.0, 5.0, 1.0, 2.0]]), [banned]).tokens == [1]


def test_engine_outputs_of_normal_requests_do_not_change_next_to_extreme_ones() -> None:
    model = tiny_model()
    prompts = prompts_of_lengths(7, 12, 5, seed=3)
    alone = tiny_llm(model, max_num_seqs=8).generate(prompts, NORMAL)
    llm = tiny_llm(model, max_num_seqs=8)
    extra = prompts_of_lengths(*([6] * len(EXTREME)), seed=4)
    mixed = llm.generate(prompts + extra, NORMAL + EXTREME)
    for a, m in zip(alone, mixed):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
        # the model's logits move in the last bits with the batch's shape (the sampler adds nothing)
        assert m.outputs[0].logprobs == (
            None if a.outputs[0].logprobs is None else pytest.approx(a.outputs[0].logprobs)
        )
    for m in mixed[len(NORMAL) :]:
        o = m.outputs[0]
        assert o.finish_reason == "length" and len(o.token_ids) == 6 and all(0 <= t < 259 for t in o.token_ids)
    assert llm.runner.blocks.num_free == llm.runner.blocks.capacity


finite_pos = st.floats(min_value=5e-324, max_value=1.7e308, allow_nan=False, allow_infinity=False)
params_strategy = st.builds(
    SamplingParams,
    temperature=st.one_of(st.floats(0.0, 2.0), st.sampled_from([0.0, 5e-324, 1e-45, 1e-6, 1e-5])),
    top_p=st.one_of(st.floats(5e-324, 1.0, exclude_min=False), st.sampled_from([5e-324, 1e-300, 1.0])),
    top_k=st.one_of(st.just(0), st.just(-1), st.integers(1, 2 * V)),
    min_p=st.floats(0.0, 1.0),
    repetition_penalty=st.one_of(finite_pos, st.sampled_from([5e-324, 1e-300, 1.0, 1e300])),
    presence_penalty=st.floats(-2.0, 2.0),
    frequency_penalty=st.floats(-2.0, 2.0),
    seed=st.one_of(st.none(), st.integers(0, 2**31)),
    logprobs=st.one_of(st.none(), st.integers(0, 5)),
)


@settings(max_examples=50, deadline=None)
@given(
    params=st.lists(params_strategy, min_size=1, max_size=4),
    scale=st.sampled_from([1.0, 30.0, 1e30, 3e38]),
    seed=st.integers(0, 1000),
    masked=st.booleans(),
)
def test_random_parameters_never_raise(params: list[SamplingParams], scale: float, seed: int, masked: bool) -> None:
    for p in params:
        p.validate(V)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(params), V, generator=g) * scale
    if masked:
        logits[:, : V // 2] = float("-inf")
    s = Sampler(seed=seed)
    history = torch.randint(0, V, (8,), generator=g).tolist()
    gens = [s.request_generator(p.seed) if p.seed is not None else None for p in params]
    rows = [SampleRow(p, history[:4], history[4:], gen) for p, gen in zip(params, gens)]
    out = s(logits, rows)
    assert len(out.tokens) == len(params) and all(0 <= t < V for t in out.tokens)
    for p, lp, top in zip(params, out.logprobs, out.top):
        assert (lp is None) == (p.logprobs is None)
        assert lp is None or not math.isnan(lp)
        assert top is None or len(top) == p.logprobs


@pytest.mark.parametrize("field", ["max_tokens", "min_tokens", "top_k", "seed"])
def test_integers_beyond_int64_are_refused_by_validate(field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: 2**63}).validate()
