"""Serving Mamba-2 and hybrid models: each request's conv and SSM states live in a slot beside the paged KV cache.

Greedy generation through the engine (continuous batching, chunked prefill, decode steps mixing requests,
preemption, lookahead) equals the plain full-recompute loop over the training forward; the slots come back when
requests finish, are aborted or preempted; tp 2 equals tp 1; the OpenAI server serves a hybrid model. CPU, float32,
random weights with a larger init so greedy outputs vary."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, get_args

import pytest
import torch

from mcore_infer import LLM, EngineConfig, SamplingParams
from mcore_infer.decode import DecodeKernels
from mcore_infer.decode_layers import FusedAttentionLayer, FusedMambaLayer, FusedMLPLayer, PlainDecodeLayer
from mcore_infer.mamba_cache import MambaCache, MambaStepView
from mcore_infer.runner import graph_blockers
from mcore_models import GPTModel
from mcore_models.checkpoint import save_weights
from mcore_models.moe import MoEConfig
from mcore_models.presets import preset
from mcore_models.ssm.inference import MAX_PADDING, mixer_inference_forward, plan_prefill
from mcore_models.ssm.layer import MambaLayer
from mcore_parallel import Group, ParallelConfig, ParallelState
from mcore_parallel.testing import run_distributed
from tests.infer._tiny import prompts_of_lengths, reference_greedy, tiny_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PATTERNS = {"hybrid": "M*-M-", "mamba": "MMM"}
# five requests through four slots and a 32-token budget: a 40-token prompt is prefilled in two chunks beside
# running decodes, a one-token prompt starts with a decode-shaped step, queued requests join as others finish
PROMPT_LENGTHS = (5, 40, 17, 1, 33)


def mamba_model(kind: str, tp: Group | None = None, **kw: Any) -> GPTModel:
    """hybrid-tiny (``M*-M-``: two Mamba layers with two groups, attention, two MLPs) or a pure-Mamba ``MMM``, on the
    byte vocabulary."""
    pattern = PATTERNS[kind]
    cfg = preset("hybrid-tiny", vocab_size=259, init_method_std=0.2, hybrid_pattern=pattern, num_layers=len(pattern),
                 seed=7, **kw)  # fmt: skip
    return GPTModel(cfg, tp=tp).eval()


@pytest.fixture(scope="module", params=list(PATTERNS))
def model(request: pytest.FixtureRequest) -> GPTModel:
    return mamba_model(request.param)


def _slots_all_free(llm: LLM) -> bool:
    slots = llm.runner.state_slots
    assert slots is not None
    return slots.num_free == slots.capacity and llm.runner.blocks.num_free == llm.runner.blocks.capacity


@pytest.mark.parametrize("kernels", get_args(DecodeKernels))
def test_engine_greedy_equals_full_recompute(model: GPTModel, kernels: str) -> None:
    prompts = prompts_of_lengths(*PROMPT_LENGTHS, seed=11)
    expected = [reference_greedy(model, p, 8) for p in prompts]
    assert len({tuple(e) for e in expected}) == len(expected)  # the outputs depend on the prompt
    llm = tiny_llm(model, decode_kernels=kernels)
    # with any fusion (every plan but none defers the residual add) each Mamba layer is a FusedMambaLayer and each
    # attention or MLP layer that half of a FusedDecodeLayer
    fused = {"M": FusedMambaLayer, "*": FusedAttentionLayer, "-": FusedMLPLayer}
    kinds = model.config.hybrid_pattern
    wrappers = [type(w) for w in llm.runner.decode.layers.values()]
    assert wrappers == [PlainDecodeLayer if kernels == "none" else fused[c] for c in kinds]
    res = llm.generate(prompts, GREEDY)
    assert [r.outputs[0].token_ids for r in res] == expected
    assert llm.engine.num_lookahead_steps > 0  # steady decoding launched steps ahead, reading the same slots
    assert _slots_all_free(llm)
    # KV blocks only for the attention layers; the states for the Mamba layers, one slot per max_num_seqs
    assert len(llm.runner.cache.keys) == model.config.hybrid_pattern.count("*")
    mamba = llm.runner.mamba
    assert mamba is not None and sorted(mamba.ssm) == [i for i, c in enumerate(model.config.hybrid_pattern) if c == "M"]
    assert mamba.ssm[0].shape == (5, 8, 16, 16) and mamba.ssm[0].dtype == torch.float32  # [slots, H, P, N]
    assert mamba.conv[0].shape == (5, 128 + 2 * 2 * 16, 3)  # [slots, d + 2GN, d_conv - 1]
    assert [t.shape[:2] for t in mamba.stacked] == [(len(mamba.ssm), 5)] * 2  # one tensor per kind: a reset is two


@pytest.mark.parametrize("kind", list(PATTERNS))
def test_compiled_layers_give_the_same_tokens(kind: str) -> None:
    """EngineConfig.compile on the hybrid model: a decode step's recurrence is traced with the layer's wrapper (only the
    look-up of the layer's states is not), a mixed step's conv and scan stay out; tokens unchanged, and the Mamba
    layers share their compiled entries (decode or mixed, one token or many), none specialising on its layer number
    or on the step's token ranges."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    prompts = prompts_of_lengths(*PROMPT_LENGTHS, seed=11)
    expected = [reference_greedy(mamba_model(kind), p, 8) for p in prompts]
    torch._dynamo.reset()
    llm = tiny_llm(mamba_model(kind), compile=True)
    assert [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)] == expected
    # decode or mixed step, times the first layer (no pending residual) or a later one: never one per layer (MMM
    # has three)
    assert 1 <= len(_debug_get_cache_entry_list(FusedMambaLayer.forward.__code__)) <= 4


GATE_FIRST = dict(d_conv=2, conv_bias=False, dt_limit=(0.01, 0.5), norm_before_gate=True, n_groups=1)
VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    # a two-tap conv without bias, a clamped time step, the norm before the gate, one group of B and C
    "conv2-limit-gate": ("M*M-", GATE_FIRST, {}),
    "conv1-groups4": ("MM", dict(d_conv=1, n_groups=4), {}),  # no conv state at all
    "moe": ("M*E", {}, dict(moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32))),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_mixer_variants_serve_like_full_recompute(variant: str) -> None:
    pattern, mamba, extra = VARIANTS[variant]
    cfg = preset("hybrid-tiny", vocab_size=259, init_method_std=0.2, hybrid_pattern=pattern, num_layers=len(pattern),
                 seed=3, mamba=mamba, **extra)  # fmt: skip
    model = GPTModel(cfg).eval()
    prompts = prompts_of_lengths(5, 40, 17, 1, 33, seed=2)
    expected = [reference_greedy(model, p, 8) for p in prompts]
    assert [r.outputs[0].token_ids for r in tiny_llm(model).generate(prompts, GREEDY)] == expected


def test_chunked_prefill_prompt_logprobs_match_the_model(model: GPTModel) -> None:
    """A 70-token prompt prefilled in chunks of 16 (each chunk continuing from the states the last one left): its
    prompt log-probabilities are the training forward's."""
    prompt = prompts_of_lengths(70, seed=5)[0]
    llm = tiny_llm(model, max_num_batched_tokens=16)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, logprobs=1, echo=True))[0].outputs[0]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt]), gather_logits=True)[0].float(), -1)
    want = torch.tensor([float(logp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)])
    assert torch.allclose(torch.tensor(out.prompt_logprobs[1:]), want, atol=1e-4)


def test_preemption_with_few_blocks_and_slots(model: GPTModel) -> None:
    """Nine usable blocks of 8 tokens for four ~40-token requests, two slots: requests are preempted (their slots
    freed, their states recomputed from the prompt when they come back) and queue for slots, with unchanged tokens."""
    prompts = prompts_of_lengths(20, 22, 18, 25, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    llm = tiny_llm(model, block_size=8, num_blocks=10, max_num_batched_tokens=64, max_num_seqs=2)
    res = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [r.outputs[0].token_ids for r in res] == [reference_greedy(model, p, 14) for p in prompts]
    assert _slots_all_free(llm)


def test_abort_frees_the_slot(model: GPTModel) -> None:
    llm = tiny_llm(model)
    eng = llm.engine
    long = SamplingParams(max_tokens=100, ignore_eos=True)
    rid = eng.add_request(prompts_of_lengths(50)[0], long)
    for _ in range(4):
        eng.step()
    slots = llm.runner.state_slots
    assert slots is not None and slots.num_free == slots.capacity - 1
    eng.abort(rid)
    assert [o.finish_reason for o in eng.step()] == ["abort"]
    assert _slots_all_free(llm) and not eng.has_work()
    # the freed slot serves the next request from a clean state
    p = prompts_of_lengths(9, seed=3)[0]
    assert llm.generate([p], GREEDY)[0].outputs[0].token_ids == reference_greedy(model, p, 8)


@pytest.mark.parametrize("lookahead", [False, True])
def test_an_aborted_requests_slot_serves_a_waiting_request(model: GPTModel, lookahead: bool) -> None:
    """Three slots: a fourth request waits until one running request is aborted (with lookahead, while a step ahead
    of it may be in flight), then takes its slot and starts from a zeroed state."""
    prompts = prompts_of_lengths(9, 30, 4, 21, seed=1)
    llm = tiny_llm(model, max_num_batched_tokens=16, max_num_seqs=3, lookahead=lookahead)
    eng = llm.engine
    rids = [eng.add_request(prompts[0], GREEDY), eng.add_request(prompts[1], GREEDY)]
    doomed = eng.add_request(prompts[3], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    done, slots = {}, {}
    for step in range(300):
        if step == 4:
            rids.append(eng.add_request(prompts[2], GREEDY))
        if step == 8:
            slots["doomed"] = eng._seqs[doomed].state_slot
            eng.abort(doomed)
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if len(rids) == 3 and rids[2] in eng._seqs and eng._seqs[rids[2]].state_slot:
            slots.setdefault("late", eng._seqs[rids[2]].state_slot)
        if not eng.has_work():
            break
    assert done[doomed].finish_reason == "abort"
    assert slots["late"] == slots["doomed"] != 0  # it waited for, and got, the aborted request's slot
    for rid, p in zip(rids, prompts):
        assert done[rid].token_ids == reference_greedy(model, p, 8)
    assert _slots_all_free(llm)
    if lookahead:
        assert eng.num_lookahead_steps > 0


def test_seeded_sampling_is_the_same_alone_and_batched(model: GPTModel) -> None:
    prompts = prompts_of_lengths(12, 30, 7, seed=8)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=17, max_tokens=10, ignore_eos=True)
    alone = tiny_llm(model).generate([prompts[0]], seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batched = tiny_llm(model, max_num_batched_tokens=16).generate(prompts, [seeded, others, others])
    assert batched[0].outputs[0].token_ids == alone
    again = tiny_llm(model).generate([prompts[0]], seeded)[0].outputs[0].token_ids
    assert again == alone


def test_the_mixer_in_chunks_and_steps_equals_its_training_forward() -> None:
    """float64: two requests through one mixer, A in uneven chunks (a chunk of 9 is not a multiple of the scan's
    chunk of 8; a 2-token chunk is shorter than the conv window), B one token a step, both in the same mixed steps,
    then decode steps of both; each output equals the mixer's training forward over the whole sequence."""
    layer: Any = mamba_model("mamba").decoder.layers["1"]
    mixer = layer.mixer.double()
    g = torch.Generator().manual_seed(0)
    xa, xb = torch.randn(2, 24, 1, 64, generator=g, dtype=torch.float64)
    with torch.no_grad():
        want_a, want_b = mixer(xa), mixer(xb)
    cache = MambaCache.allocate({1: mixer}, 3, torch.device("cpu"))
    assert cache.ssm[1].dtype == torch.float64

    class Context:
        layer_number, mamba = 1, None

    ctx, got_a, got_b = Context(), [], []
    chunks = [(0, 9), (9, 11), (11, 12), (12, 20)]
    with torch.no_grad():
        for i, (s, e) in enumerate(chunks):  # mixed steps: [A's chunk, B's token i]
            n = e - s
            segments = [(0, n, 1), (n, n + 1, 2)]
            ctx.mamba = MambaStepView(cache, torch.tensor([1, 2]), segments)  # type: ignore[assignment]
            out = mixer(torch.cat([xa[s:e], xb[i : i + 1]]), inference_context=ctx)
            got_a.append(out[:n])
            got_b.append(out[n:])
        for t in range(20, 24):  # decode steps: token t of A, token t - 16 of B
            ctx.mamba = MambaStepView(cache, torch.tensor([1, 2]))  # type: ignore[assignment]
            out = mixer(torch.cat([xa[t : t + 1], xb[t - 16 : t - 15]]), inference_context=ctx)
            got_a.append(out[:1])
            got_b.append(out[1:])
    assert torch.allclose(torch.cat(got_a), want_a, atol=1e-12, rtol=1e-10)
    assert torch.allclose(torch.cat(got_b), want_b[:8], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dt_min", [0.0, 1e-3], ids=["padded-groups", "dt-limit-one-by-one"])
def test_several_prefills_in_one_step_equal_the_training_forward(dt_min: float) -> None:
    """float64: four requests prefill chunks of 17, 9, 3 and 2 tokens in the same mixed steps (two padded groups:
    17 + 9 and 3 + 2) beside a fifth request's single token, starting from states left by an earlier chunk, then a
    decode step; every output equals the mixer's training forward. With a dt_limit above 0 the chunks run one by
    one (a padded step would decay the state)."""
    layer: Any = mamba_model("mamba").decoder.layers["1"]
    mixer = layer.mixer.double()
    mixer.mamba = dataclasses.replace(mixer.mamba, dt_limit=(dt_min, math.inf))
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(5, 40, 1, 64, generator=g, dtype=torch.float64)
    with torch.no_grad():
        want = [mixer(x) for x in xs]
    cache = MambaCache.allocate({1: mixer}, 6, torch.device("cpu"))

    class Context:
        layer_number, mamba = 1, None

    ctx = Context()
    sizes = [17, 9, 3, 2]
    got: list[list[torch.Tensor]] = [[] for _ in range(5)]
    pos = [0] * 5
    with torch.no_grad():
        for _ in range(2):  # two mixed steps: the second starts from the states the first left
            parts, segments, start = [], [], 0
            for r, n in enumerate([*sizes, 1]):
                parts.append(xs[r, pos[r] : pos[r] + n])
                segments.append((start, start + n, r + 1))
                start += n
            ctx.mamba = MambaStepView(cache, torch.arange(1, 6), segments)  # type: ignore[assignment]
            if dt_min == 0:
                assert [(grp.count, grp.length) for grp in ctx.mamba.prefill_groups()] == [(2, 17), (2, 3)]  # type: ignore[attr-defined]
            out = mixer(torch.cat(parts), inference_context=ctx)
            for r, (s, e, _) in enumerate(segments):
                got[r].append(out[s:e])
                pos[r] += e - s
        ctx.mamba = MambaStepView(cache, torch.arange(1, 6))  # type: ignore[assignment]
        out = mixer(torch.stack([xs[r, pos[r]] for r in range(5)]), inference_context=ctx)
        for r in range(5):
            got[r].append(out[r : r + 1])
    for r in range(5):
        mine = torch.cat(got[r])
        assert torch.allclose(mine, want[r][: mine.shape[0]], atol=1e-12, rtol=1e-10), f"request {r}"


def test_a_16_bit_state_is_the_float32_state_rounded_after_each_step() -> None:
    """``mamba_ssm_dtype=bfloat16`` (PyTorch path): two requests' prefill chunks then decode steps with their states
    kept in bf16 give exactly the outputs of float32 states rounded to bf16 after every step (the math is float32 on
    both; only the stored state is rounded)."""
    layer: Any = mamba_model("mamba").decoder.layers["1"]
    mixer = layer.mixer
    xs = torch.randn(2, 12, 1, 64, generator=torch.Generator().manual_seed(2))
    half = MambaCache.allocate({1: mixer}, 3, torch.device("cpu"), torch.bfloat16)
    full = MambaCache.allocate({1: mixer}, 3, torch.device("cpu"))
    assert half.ssm[1].dtype == torch.bfloat16 and full.ssm[1].dtype == torch.float32
    assert half.conv[1].dtype == full.conv[1].dtype == mixer.conv1d.weight.dtype

    class Context:
        layer_number, mamba = 1, None

    outs: dict[str, list[torch.Tensor]] = {"half": [], "full": []}
    with torch.no_grad():
        for t in range(6, 12):
            prefill = t == 6
            for name, cache in (("half", half), ("full", full)):
                ctx = Context()
                segments = [(0, 6, 1), (6, 12, 2)] if prefill else None
                ctx.mamba = MambaStepView(cache, torch.tensor([1, 2]), segments)  # type: ignore[assignment]
                x = torch.cat([xs[0, :6], xs[1, :6]]) if prefill else xs[:, t]
                outs[name].append(mixer(x, inference_context=ctx))
            full.ssm[1].copy_(full.ssm[1].to(torch.bfloat16).float())  # the reference rounds its state here
            assert torch.equal(half.ssm[1].float(), full.ssm[1])
    for a, b in zip(outs["half"], outs["full"], strict=True):
        assert torch.equal(a, b)
    assert MambaCache.bytes_for({1: mixer}, 3, torch.bfloat16) < MambaCache.bytes_for({1: mixer}, 3)


def test_an_engine_with_bf16_states_serves(model: GPTModel) -> None:
    llm = tiny_llm(model, mamba_ssm_dtype="bfloat16")
    assert llm.runner.mamba is not None and all(t.dtype == torch.bfloat16 for t in llm.runner.mamba.ssm.values())
    prompts = prompts_of_lengths(*PROMPT_LENGTHS[:3], seed=5)
    done = llm.generate(prompts, GREEDY)
    assert all(len(d.outputs[0].token_ids) == 8 for d in done)
    assert _slots_all_free(llm)
    with pytest.raises(ValueError, match="mamba_ssm_dtype='int8': use float32, bfloat16, float16"):
        EngineConfig(mamba_ssm_dtype="int8")


def test_prefill_groups_keep_padding_bounded() -> None:
    segments = [(0, 1500, 1), *((1500 + 50 * i, 1550 + 50 * i, 2 + i) for i in range(10)), (2000, 2001, 12)]
    groups = plan_prefill(segments, "cpu")
    assert [(grp.count, grp.length) for grp in groups] == [(1, 1500), (10, 50)]
    assert groups[0].chunks == ((0, 1500, 1),) and groups[1].chunks[0] == (1500, 1550, 2)  # (runs unpadded)
    for grp in groups:
        assert grp.count * grp.length <= MAX_PADDING * len(grp.rows)
        assert grp.rows.tolist() == sorted(set(grp.rows.tolist()))  # each token once, in step order per chunk
    assert sorted(r for grp in groups for r in grp.rows.tolist()) == list(range(2000))  # the single token is not


def test_a_context_without_states_is_refused() -> None:
    model = mamba_model("mamba")
    layer = model.decoder.layers["0"]
    assert isinstance(layer, MambaLayer)

    class NoStates:
        layer_number = 0
        logits_index = None

    with pytest.raises(NotImplementedError, match="no Mamba states"):
        mixer_inference_forward(layer.mixer, torch.zeros(3, 1, 64), NoStates())


def test_mamba_models_have_no_graph_blocker() -> None:
    assert graph_blockers(mamba_model("hybrid")) == []


# ------------------------------------------------------------------------------------------------- tp, server
TP_ENGINE = dict(block_size=16, num_blocks=32, max_num_batched_tokens=16, max_num_seqs=2)


def _serve_tp(tp: int, kind: str, prompts: list[list[int]]) -> list[list[int]] | None:
    state = ParallelState.initialize(ParallelConfig(tp=tp))
    llm = LLM(model=mamba_model(kind, tp=state.tp), config=EngineConfig(**TP_ENGINE))
    mixer: Any = llm.runner.model.decoder.layers["0"].mixer
    assert mixer.heads_local == 8 // tp and mixer.groups_local == 2 // tp
    assert llm.runner.mamba is not None and llm.runner.mamba.ssm[0].shape[1] == 8 // tp
    if not llm.is_driver:
        llm.follow()
        return None
    out = [g.outputs[0].token_ids for g in llm.generate(prompts, GREEDY)]
    llm.shutdown()
    return out


def test_tp2_equals_tp1() -> None:
    """Each rank holds the states of its heads and groups; the followers replay the first rank's steps, slots and
    fresh-slot resets included."""
    prompts = prompts_of_lengths(7, 30, 12, seed=3)
    (single,) = run_distributed(_serve_tp, 1, 1, "hybrid", prompts)
    assert single == [reference_greedy(mamba_model("hybrid"), p, 8) for p in prompts]
    assert run_distributed(_serve_tp, 2, 2, "hybrid", prompts) == [single, None]


def test_a_hybrid_checkpoint_loads_and_serves(tmp_path: Path) -> None:
    model = mamba_model("hybrid")
    with torch.no_grad():  # off the seeded initial values: only a model that loaded them matches
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    path = save_weights(model, ParallelState.initialize(), tmp_path)
    prompts = prompts_of_lengths(9, 26, seed=1)
    llm = LLM(path, config=EngineConfig(**TP_ENGINE))
    assert llm.runner.model.config.hybrid_pattern == "M*-M-" and llm.runner.mamba is not None
    res = llm.generate(prompts, GREEDY)
    assert [r.outputs[0].token_ids for r in res] == [reference_greedy(model, p, 8) for p in prompts]


def test_the_openai_server_answers_with_the_engines_text() -> None:
    from fastapi.testclient import TestClient

    from mcore_infer.async_engine import AsyncEngine
    from mcore_infer.server import build_app

    model = mamba_model("hybrid")
    llm = tiny_llm(model)
    want = llm.tokenizer.decode(reference_greedy(model, llm.tokenizer.encode("Mamba"), 8))
    app = build_app(AsyncEngine(llm.engine), llm.tokenizer, "hybrid-tiny", shutdown_timeout=2.0)
    body = {"model": "hybrid-tiny", "prompt": "Mamba", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with TestClient(app) as http:
        r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == want and choice["finish_reason"] == "length"


# --------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", list(PATTERNS))
def test_cuda_graph_decode_gives_the_eager_tokens(kind: str, compiled: bool) -> None:
    """Decode steps captured as CUDA graphs (the states gathered and scattered by the slot buffer, padded rows on the
    scratch slot) give the tokens of the same engine without graphs, in float32 and (eager layers) bfloat16, prefill
    chunks through the Triton scan; in float32 (the Triton scan's dots in IEEE precision) they equal full recompute on
    the GPU. Compiled bf16 layers are left out: under a graph the decode step runs the kernels of its padded batch
    size, whose bf16 rounding differs from the unpadded step's (one H200: a greedy flip in one of the prompts)."""
    prompts = prompts_of_lengths(*PROMPT_LENGTHS, seed=11)
    cfg = dict(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, compile=compiled)

    def tokens(model: GPTModel, graphs: bool) -> list[list[int]]:
        llm = LLM(model=model, config=EngineConfig(**cfg, cuda_graphs=graphs))
        assert bool(llm.runner.graphs) == graphs
        return [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]

    fp32 = mamba_model(kind).cuda()
    with_graphs = tokens(fp32, True)
    assert with_graphs == tokens(fp32, False)
    assert with_graphs == [reference_greedy(fp32, p, 8) for p in prompts]
    if not compiled:  # compiled, a graph runs its padded batch size's kernels: bf16 rounding then differs (measured)
        bf16 = mamba_model(kind, params_dtype="bfloat16").cuda()
        assert tokens(bf16, True) == tokens(bf16, False)
