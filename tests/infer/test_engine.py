"""The engine's greedy output equals a plain full-recompute loop, whatever the batching, chunking and cache do."""

from __future__ import annotations

import pytest
import torch

from mcore_infer import ContextLengthError, InvalidRequestError, SamplingParams
from mcore_infer.attention import Segment, plain_paged_attention
from tests.infer._tiny import prompts_of_lengths, reference_greedy, tiny_llm, tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
_llm = tiny_llm


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize("kernels", ["auto", "none"])
def test_batched_greedy_matches_full_recompute(model, kernels: str) -> None:
    # 6 prompts, max 4 running, 32-token budget: long prompts are prefilled in chunks next to running decodes,
    # and queued requests join the batch as others finish; with the default decode fusions and without them
    prompts = prompts_of_lengths(5, 40, 17, 70, 3, 33)
    llm = _llm(model, decode_kernels=kernels)
    assert llm.runner.plan.defer_residual is (kernels == "auto")
    res = llm.generate(prompts, GREEDY)
    for p, r in zip(prompts, res):
        assert r.outputs[0].token_ids == reference_greedy(model, p, 10)
        assert r.outputs[0].finish_reason == "length"
    assert llm.runner.blocks.num_free == llm.runner.blocks.capacity  # every block came back


def test_requests_joining_mid_run(model) -> None:
    prompts = prompts_of_lengths(9, 30, 4, 21, seed=1)
    llm = _llm(model, max_num_batched_tokens=16)
    eng = llm.engine
    done = {}
    rids = [eng.add_request(prompts[0], GREEDY), eng.add_request(prompts[1], GREEDY)]
    for step in range(200):
        if step == 3:
            rids.append(eng.add_request(prompts[2], GREEDY))
        if step == 6:
            assert eng.num_running >= 1  # still decoding the first ones
            rids.append(eng.add_request(prompts[3], GREEDY))
        for out in eng.step():
            done[out.request_id] = out.token_ids
        if len(done) == 4:
            break
    for rid, p in zip(rids, prompts):
        assert done[rid] == reference_greedy(model, p, 10)


def test_preemption_under_a_small_cache_keeps_outputs(model) -> None:
    # 9 blocks of 8 tokens (8 usable): four requests of ~40 tokens cannot all fit; some are preempted and redone
    prompts = prompts_of_lengths(20, 22, 18, 25, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    llm = _llm(model, block_size=8, num_blocks=11, max_num_batched_tokens=64)
    res = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for p, r in zip(prompts, res):
        assert r.outputs[0].token_ids == reference_greedy(model, p, 14)
    assert llm.runner.blocks.num_free == llm.runner.blocks.capacity


def test_requests_that_can_never_fit_are_rejected(model) -> None:
    llm = _llm(model, block_size=8, num_blocks=5)  # 4 usable blocks: 32 tokens
    with pytest.raises(ContextLengthError) as e:
        llm.generate([[1] * 30], SamplingParams(max_tokens=10))
    assert e.value.param == "max_tokens"
    with pytest.raises(ContextLengthError):
        llm.generate([[1] * 300], SamplingParams(max_tokens=1))  # over max_position_embeddings=256
    with pytest.raises(InvalidRequestError) as e2:
        llm.generate(["hi"], SamplingParams(top_p=0.0))
    assert e2.value.param == "top_p"


def test_abort_frees_blocks(model) -> None:
    llm = _llm(model)
    eng = llm.engine
    rid = eng.add_request(prompts_of_lengths(50)[0], SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(4):
        eng.step()
    assert llm.runner.blocks.num_free < llm.runner.blocks.capacity
    eng.abort(rid)
    outs = eng.step()
    assert [o.finish_reason for o in outs] == ["abort"]
    assert llm.runner.blocks.num_free == llm.runner.blocks.capacity and not eng.has_work()


def test_streaming_deltas_add_up_and_stop_strings(model) -> None:
    llm = _llm(model)
    prompt = "hello there"
    full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    pieces, ids = [], []
    for out in llm.generate_stream(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)):
        pieces.append(out.new_text)
        ids += out.new_token_ids
    assert ids == full.token_ids and "".join(pieces) == full.text == out.text
    # a stop string taken from the middle of the greedy text: output ends right before it
    text = full.text
    stop = text[4:6]
    cut = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]))
    o = cut[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop and o.text == text[: text.index(stop)]
    # stop token ids and eos
    tok = full.token_ids[3]
    o2 = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[tok]))[0].outputs[0]
    assert o2.token_ids == full.token_ids[: full.token_ids.index(tok) + 1] and o2.stop_reason == tok


def test_echo_prompt_logprobs_match_the_model(model) -> None:
    llm = _llm(model)
    prompt = prompts_of_lengths(40, seed=5)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, logprobs=3, echo=True))[0].outputs[0]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt]), gather_logits=True)[0].float(), -1)
    want = [None] + [float(logp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    assert out.prompt_logprobs[0] is None
    assert torch.allclose(torch.tensor(out.prompt_logprobs[1:]), torch.tensor(want[1:]), atol=1e-4)
    assert out.logprobs[0] == pytest.approx(float(logp[-1].max()), abs=1e-4)
    assert len(out.top_logprobs[0]) == 3 and out.top_logprobs[0][0][0] == out.token_ids[0]


def test_plain_paged_attention_matches_causal_sdpa() -> None:
    torch.manual_seed(0)
    bs, groups, heads, d, n = 4, 2, 4, 8, 11
    k = torch.randn(n, groups, d)
    v = torch.randn(n, groups, d)
    q = torch.randn(n, heads, d)
    table = [5, 2, 7]
    kc = torch.zeros(9, bs, groups, d)
    vc = torch.zeros(9, bs, groups, d)
    for p in range(n):
        kc[table[p // bs], p % bs] = k[p]
        vc[table[p // bs], p % bs] = v[p]
    # the last 3 tokens as a chunk over 8 cached ones
    out = plain_paged_attention(q[8:], kc, vc, [Segment(0, 3, 0, 11)], [table])
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    assert torch.allclose(out, ref[8:], atol=1e-5)


def test_full_queue_is_refused_as_overloaded(model) -> None:
    from mcore_infer import OverloadedError

    llm = _llm(model)
    llm.engine.max_queue = 2
    llm.engine.add_request([1, 2, 3], GREEDY)
    llm.engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(OverloadedError):
        llm.engine.add_request([1, 2, 3], GREEDY)
    while llm.engine.has_work():
        llm.engine.step()


def test_compiled_layers_give_the_same_tokens() -> None:
    """EngineConfig.compile: layers compiled with a dynamic token count; greedy tokens unchanged, and the paged
    attention call stays out of the compiled graphs (one graph break per layer call, no recompiles per step)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from mcore_infer.decode_layers import FusedDecodeLayer

    prompts = prompts_of_lengths(5, 40, 17, 70, 3, 33)
    eager = tiny_model(num_layers=4)  # the same weights (seeded init), never compiled
    expected = [reference_greedy(eager, p, 10) for p in prompts]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    llm = _llm(tiny_model(num_layers=4), compile=True)
    res = llm.generate(prompts, GREEDY)
    assert [r.outputs[0].token_ids for r in res] == expected
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] >= 2  # the code before and after attention was compiled
    assert counters["stats"]["unique_graphs"] <= 10  # dynamic token count: not one compile per step shape
    assert any("torch.compiler.disable" in k for k in counters["graph_break"])
    # the four layers share their compiled entries (one token / many tokens; with the deferred residual adds of the
    # defaults, the first layer, which has no residual yet, has its own), none specialises on its layer number: with
    # one entry per layer, torch's limit of 8 entries per code object sends a 16-layer model back to eager
    assert len(_debug_get_cache_entry_list(FusedDecodeLayer.forward.__code__)) <= 4


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_deferred_residual_adds_give_the_same_tokens(compiled: bool) -> None:
    """The deferred residual add (auto's ``defer_residual``): each layer's last residual add moves into the next
    layer (fused with its norm when compiled); greedy tokens unchanged, and every layer really returned its residual
    unsummed (seen at trace time when compiled)."""
    from mcore_infer.decode_layers import FusedDecodeLayer

    prompts = prompts_of_lengths(5, 40, 17, 70, 3, 33)
    eager = tiny_model(num_layers=4)
    expected = [reference_greedy(eager, p, 10) for p in prompts]
    torch._dynamo.reset()
    deferred = []
    real = FusedDecodeLayer.forward

    def spy(self, *a, **k):  # type: ignore[no-untyped-def]
        out = real(self, *a, **k)
        deferred.append(out[1] is not None)
        return out

    FusedDecodeLayer.forward = spy  # type: ignore[method-assign]
    try:
        llm = _llm(tiny_model(num_layers=4), compile=compiled)
        assert llm.runner.plan.defer_residual
        res = llm.generate(prompts, GREEDY)
    finally:
        FusedDecodeLayer.forward = real  # type: ignore[method-assign]
    assert [r.outputs[0].token_ids for r in res] == expected
    assert deferred and all(deferred)


def test_lookahead_steps_give_identical_outputs(model) -> None:
    """EngineConfig.lookahead launches each steady decode step from the previous step's tokens on the device before
    the host reads them; every output (greedy, seeded sampling with penalties and logprobs, stop strings, stop
    tokens, lengths that end mid-batch, streaming) is identical to stepping without it."""
    prompts = prompts_of_lengths(5, 40, 17, 70, 3, 33, seed=4)
    greedy_ref = [reference_greedy(model, p, 10) for p in prompts]
    params = [
        GREEDY,
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[greedy_ref[2][4]]),
        SamplingParams(temperature=1.2, top_k=20, seed=3, max_tokens=15, ignore_eos=True, repetition_penalty=1.3,
                       logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=5, max_tokens=9, ignore_eos=True, presence_penalty=0.5),
    ]  # fmt: skip
    runs = {}
    for lookahead in (False, True):
        llm = _llm(model, max_num_seqs=6, lookahead=lookahead)
        res = llm.generate(prompts, params)
        runs[lookahead] = [(r.outputs[0].token_ids, r.outputs[0].finish_reason, r.outputs[0].logprobs) for r in res]
        assert llm.runner.blocks.num_free == llm.runner.blocks.capacity  # every block came back
        if lookahead:
            assert llm.engine.num_lookahead_steps > 0
    assert runs[True] == runs[False]
    assert runs[True][0][0] == greedy_ref[0]
    # streaming through the lookahead path: the deltas add up to the whole completion
    llm = _llm(model, lookahead=True)
    full = llm.generate("hello there", GREEDY)[0].outputs[0]
    ids = [t for out in llm.generate_stream("hello there", GREEDY) for t in out.new_token_ids]
    assert ids == full.token_ids


@pytest.mark.parametrize("lookahead", [False, True])
def test_requests_joining_and_aborting_with_lookahead(model, lookahead: bool) -> None:
    """Requests that arrive or are aborted while a lookahead step is in flight are handled exactly as without it."""
    prompts = prompts_of_lengths(9, 30, 4, 21, seed=1)
    llm = _llm(model, max_num_batched_tokens=16, lookahead=lookahead)
    eng = llm.engine
    done = {}
    rids = [eng.add_request(prompts[0], GREEDY), eng.add_request(prompts[1], GREEDY)]
    doomed = eng.add_request(prompts[3], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for step in range(300):
        if step == 5:
            rids.append(eng.add_request(prompts[2], GREEDY))
        if step == 8:
            eng.abort(doomed)
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if not eng.has_work():
            break
    assert done[doomed].finish_reason == "abort"
    for rid, p in zip(rids, prompts):
        assert done[rid].token_ids == reference_greedy(model, p, 10)
    assert llm.runner.blocks.num_free == llm.runner.blocks.capacity
    if lookahead:
        assert eng.num_lookahead_steps > 0


def test_step_graph_sizes_cover_the_step_budget() -> None:
    """Step graphs double from 32 tokens up to the first count that holds a whole step (at most 2048); a step
    budget below the running batch is the batch's; ``()`` captures none and a count below 1 is refused."""
    from mcore_infer import EngineConfig

    assert EngineConfig().step_graph_sizes() == [32, 64, 128, 256, 512, 1024, 2048]
    assert EngineConfig(max_num_batched_tokens=32, max_num_seqs=4).step_graph_sizes() == [32]
    assert EngineConfig(max_num_batched_tokens=100, max_num_seqs=8).step_graph_sizes() == [32, 64, 128]
    assert EngineConfig(max_num_batched_tokens=16, max_num_seqs=200).step_graph_sizes()[-1] == 256
    assert EngineConfig(step_graph_tokens=(64, 16, 64)).step_graph_sizes() == [16, 64]
    assert EngineConfig(step_graph_tokens=()).step_graph_sizes() == []
    with pytest.raises(ValueError, match="step_graph_tokens"):
        EngineConfig(step_graph_tokens=(0, 32))
