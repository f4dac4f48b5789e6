"""Each sampling parameter does what it says on constructed logits; seeded sampling is reproducible."""

from __future__ import annotations

import math
import time

import pytest
import torch

from mcore_infer import LLM, EngineConfig, SamplingParams
from mcore_infer.sampling import Sampler, SampleRow
from tests.infer._tiny import tiny_model

V = 8


def draw(logits: list[float], n: int = 400, **kw) -> list[int]:
    s = Sampler(seed=0)
    p = SamplingParams(**kw)
    rows = [SampleRow(p, [], [])] * n
    return s(torch.tensor([logits] * n), rows).tokens


def test_greedy_picks_argmax() -> None:
    assert set(draw([0.0, 3.0, 1.0, 2.9, 0, 0, 0, 0], temperature=0.0)) == {1}


def test_temperature_sharpens_and_flattens() -> None:
    logits = [1.0, 0.0, 0, 0, 0, 0, 0, 0]
    cold = draw(logits, temperature=0.05)
    hot = draw(logits, temperature=5.0)
    assert cold.count(0) == len(cold)
    assert hot.count(0) < 0.3 * len(hot) and len(set(hot)) == V


def test_top_k_keeps_k_best() -> None:
    logits = [5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0]
    assert set(draw(logits, temperature=10.0, top_k=3)) == {0, 1, 2}


def test_top_p_keeps_the_nucleus() -> None:
    # probabilities 0.5, 0.25, 0.125, ...: top_p 0.7 keeps the first two (0.5 < 0.7 <= 0.75)
    logits = [math.log(0.5), math.log(0.25), math.log(0.125)] + [math.log(0.025)] * 5
    assert set(draw(logits, temperature=1.0, top_p=0.7)) == {0, 1}
    assert set(draw(logits, temperature=1.0, top_p=0.5)) == {0}


def test_min_p_drops_unlikely_tokens() -> None:
    logits = [math.log(0.4), math.log(0.3), math.log(0.1)] + [math.log(0.04)] * 5
    # min_p 0.2: threshold 0.08 keeps tokens 0, 1, 2
    assert set(draw(logits, temperature=1.0, min_p=0.2)) == {0, 1, 2}


def test_top_k_top_p_min_p_combine() -> None:
    logits = [math.log(p) for p in (0.3, 0.25, 0.2, 0.1, 0.05, 0.04, 0.03, 0.03)]
    got = set(draw(logits, temperature=1.0, top_k=4, top_p=0.9, min_p=0.5))
    # top_k: 0..3; renormalised 0.35,0.29,0.24,0.12 -> top_p 0.9 keeps 0..3; min_p 0.5 * 0.35 drops token 3
    assert got == {0, 1, 2}


def test_penalties() -> None:
    s = Sampler()
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.0, 0, 0, 0, 0]])
    # repetition: token 0 seen in the prompt -> 2.0 / 2 = 1.0 < 1.9
    row = SampleRow(SamplingParams(temperature=0.0, repetition_penalty=2.0), [0], [])
    assert s(logits, [row]).tokens == [1]
    # presence: token 0 generated once -> 2.0 - 0.5 = 1.5 < 1.9
    row = SampleRow(SamplingParams(temperature=0.0, presence_penalty=0.5), [], [0])
    assert s(logits, [row]).tokens == [1]
    # frequency: scales with the count (0.05 * 1 keeps token 0 ahead; 0.05 * 3 does not)
    row = SampleRow(SamplingParams(temperature=0.0, frequency_penalty=0.05), [], [0])
    assert s(logits, [row]).tokens == [0]
    row = SampleRow(SamplingParams(temperature=0.0, frequency_penalty=0.05), [], [0, 0, 0])
    assert s(logits, [row]).tokens == [1]
    # negative logits are multiplied by the repetition penalty (pushed further down)
    x = torch.tensor([[-1.0, -1.5, -9, -9, -9, -9, -9, -9]])
    row = SampleRow(SamplingParams(temperature=0.0, repetition_penalty=2.0), [0], [])
    assert s(x, [row]).tokens == [1]


def test_logprobs_of_chosen_and_top_n() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, 0, 0, 0, 0]])
    res = Sampler()(logits, [SampleRow(SamplingParams(temperature=0.0, logprobs=2), [], [])])
    lp = torch.log_softmax(logits[0], -1)
    assert res.tokens == [0] and res.logprobs[0] == pytest.approx(float(lp[0]))
    assert [t for t, _ in res.top[0]] == [0, 2]
    assert res.top[0][1][1] == pytest.approx(float(lp[2]))


def test_per_request_seed_is_independent_of_the_batch() -> None:
    logits = torch.randn(1, 50)
    p = SamplingParams(temperature=1.0, seed=7)
    s = Sampler(seed=1)
    alone = s(logits, [SampleRow(p, [], [], s.request_generator(7))]).tokens
    other = SampleRow(SamplingParams(temperature=1.0), [], [])
    mixed = s(torch.cat([torch.randn(1, 50), logits]), [other, SampleRow(p, [], [], s.request_generator(7))]).tokens
    assert alone[0] == mixed[1]


def test_seeded_generation_is_reproducible() -> None:
    llm = LLM(model=tiny_model(), config=EngineConfig(num_blocks=64))
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=42, ignore_eos=True)
    a = llm.generate(["abc", "hello"], p)
    b = llm.generate(["hello", "zz", "abc"], p)
    assert a[0].outputs[0].token_ids == b[2].outputs[0].token_ids
    assert a[1].outputs[0].token_ids == b[0].outputs[0].token_ids
    c = llm.generate(["abc"], SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=43, ignore_eos=True))
    assert c[0].outputs[0].token_ids != a[0].outputs[0].token_ids
    # n > 1 completions differ from each other (seed + i)
    n3 = llm.generate(["abc"], p, n=3)[0].outputs
    assert n3[0].token_ids == a[0].outputs[0].token_ids and n3[1].token_ids != n3[0].token_ids


def test_bad_parameters_name_the_field() -> None:
    for field, value in [("temperature", -1.0), ("top_k", -2), ("min_p", 2.0), ("max_tokens", 0), ("logprobs", 50)]:
        with pytest.raises(ValueError) as e:
            SamplingParams(**{field: value}).validate()
        assert e.value.param == field  # type: ignore[attr-defined]


def test_mixed_greedy_and_sampled_rows_in_one_batch() -> None:
    """Greedy rows take the argmax and sampled rows draw exactly as they would alone (same seeded generator)."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    s = Sampler(seed=1)
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5)
    rows = [SampleRow(greedy, [], []), SampleRow(hot, [], [], s.request_generator(5)), SampleRow(greedy, [], []),
            SampleRow(hot, [], [], s.request_generator(6))]  # fmt: skip
    out = s(logits, rows).tokens
    assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
    alone = s(logits[1:2], [SampleRow(hot, [], [], s.request_generator(5))]).tokens
    assert out[1] == alone[0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_drawn_result_is_the_draw_not_later_stream_work(device: str) -> None:
    """The engine launches its lookahead step between ``draw`` and ``result``: the host copy of the tokens (and
    log-probabilities) is taken at the draw, so later work on the stream neither changes the result nor delays it."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    logits = torch.randn(3, 40000, device=device)
    want = logits.argmax(-1).tolist()
    lp = SamplingParams(temperature=0.0, logprobs=2)
    rows = [SampleRow(SamplingParams(temperature=0.0), [], []), SampleRow(lp, [], []), SampleRow(lp, [], [])]
    want_lp = torch.log_softmax(logits.float(), -1)
    for fast in (True, False):
        x = logits.clone()
        drawn = Sampler(device).draw(x, rows[:1] * 3 if fast else rows)
        if device == "cuda":
            torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU work queued after the draw (the lookahead step)
        drawn.tokens.fill_(7)  # and the device tokens overwritten in stream order after it
        x.add_(100.0)
        t0 = time.perf_counter()
        res = drawn.result()
        waited = time.perf_counter() - t0
        assert res.tokens == want
        if not fast:
            assert res.logprobs[1] == pytest.approx(float(want_lp[1, want[1]]), abs=1e-5)
            top = want_lp[2].topk(2)
            assert [t for t, _ in res.top[2]] == top.indices.tolist()
            assert res.top[2][0][1] == pytest.approx(float(top.values[0]), abs=1e-5)
        if device == "cuda":
            assert waited < 0.25, f"result() waited {waited:.3f} s: it queued behind the later stream work"
            torch.cuda.synchronize()


def test_a_greedy_batch_takes_the_tokens_a_graph_drew() -> None:
    """``ready`` (a decode graph's argmax of the rows, ``argmax_in_graph``): a batch of only plain greedy rows takes
    it as its tokens without drawing; any other batch draws from the logits and leaves it alone."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    ready = torch.tensor([1, 0])
    greedy = SamplingParams(temperature=0.0)
    drawn = Sampler().draw(logits, [SampleRow(greedy, [], [])] * 2, ready=ready)
    assert drawn.tokens is ready and drawn.result().tokens == [1, 0]
    stale = torch.tensor([2, 2])  # what the rows are not: a batch that must draw shows it did
    with_logprobs = SampleRow(SamplingParams(temperature=0.0, logprobs=1), [], [])
    assert Sampler().draw(logits, [with_logprobs] * 2, ready=stale).result().tokens == [1, 0]
    banned = SampleRow(greedy, [], [], banned=[1])
    assert Sampler().draw(logits, [banned, SampleRow(greedy, [], [])], ready=stale).result().tokens == [2, 0]
