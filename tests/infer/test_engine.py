"""The engine's greedy output equals a plain full-recompute loop, whatever the batching, chunking and cache do."""

from __future__ import annotations

import pytest
import torch

from mcore_infer import LLM, ContextLengthError, EngineConfig, InvalidRequestError, SamplingParams
from mcore_infer.attention import Segment, plain_paged_attention
from tests.infer._tiny import prompts_of_lengths, reference_greedy, tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _llm(model, **kw) -> LLM:
    cfg = dict(block_size=16, num_blocks=64, max_num_batched_tokens=32, max_num_seqs=4)
    cfg.update(kw)
    return LLM(model=model, config=EngineConfig(**cfg))


@pytest.mark.parametrize("fused", [True, False], ids=["default-fusions", "unfused"])
def test_batched_greedy_matches_full_recompute(model, fused: bool) -> None:
    # 6 prompts, max 4 running, 32-token budget: long prompts are prefilled in chunks next to running decodes,
    # and queued requests join the batch as others finish; with the default decode fusions and without them
    prompts = prompts_of_lengths(5, 40, 17, 70, 3, 33)
    llm = _llm(model, fuse_residual=fused, fuse_rope=fused, fuse_kv_write=fused)
    assert llm.runner.model.defer_residual_adds is fused
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

    from mcore_models.transformer.layer import TransformerLayer

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
    assert len(_debug_get_cache_entry_list(TransformerLayer.forward.__code__)) <= 4


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_deferred_residual_adds_give_the_same_tokens(compiled: bool) -> None:
    """EngineConfig.fuse_residual: each layer's last residual add moves into the next layer (fused with its norm
    when compiled); greedy tokens unchanged, and the layers really returned their residual unsummed."""
    from mcore_models.transformer.layer import TransformerLayer

    prompts = prompts_of_lengths(5, 40, 17, 70, 3, 33)
    eager = tiny_model(num_layers=4)
    expected = [reference_greedy(eager, p, 10) for p in prompts]
    torch._dynamo.reset()
    deferred = []
    real = TransformerLayer.forward

    def spy(self, *a, **k):  # type: ignore[no-untyped-def]
        deferred.append(k.get("defer_residual", False))
        return real(self, *a, **k)

    TransformerLayer.forward = spy  # type: ignore[method-assign]
    try:
        llm = _llm(tiny_model(num_layers=4), compile=compiled, fuse_residual=True)
        res = llm.generate(prompts, GREEDY)
    finally:
        TransformerLayer.forward = real  # type: ignore[method-assign]
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


FUSED_PROMPTS = prompts_of_lengths(5, 40, 17, 70, 3, 33)


@pytest.fixture(scope="module")
def fused_expected() -> list[list[int]]:
    """The plain recompute loop's greedy tokens for FUSED_PROMPTS (computed before any test installs its spies)."""
    return [reference_greedy(tiny_model(num_layers=3), p, 10) for p in FUSED_PROMPTS]


def _spy_rows(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Record the token count (rows of the first argument) of every call to ``module.name``."""
    rows: list[int] = []
    real = getattr(module, name)

    def spy(x, *a):  # type: ignore[no-untyped-def]
        rows.append(x.numel() // x.shape[-1])
        return real(x, *a)

    monkeypatch.setattr(module, name, spy)
    return rows


def _spy_deferred_adds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record, for every ``add_deferred`` of the layers, how many dims its output had over the residual (1: the
    output was split-K partial sums)."""
    from mcore_models.transformer import layer as layer_module

    added: list[int] = []
    real = layer_module.add_deferred

    def spy(x, residual):  # type: ignore[no-untyped-def]
        added.append(x.dim() - residual.dim())
        return real(x, residual)

    monkeypatch.setattr(layer_module, "add_deferred", spy)
    return added


def _assert_same_greedy_tokens(expected: list[list[int]], **cfg: object) -> None:
    torch._dynamo.reset()
    res = _llm(tiny_model(num_layers=3), **cfg).generate(FUSED_PROMPTS, GREEDY)
    assert [r.outputs[0].token_ids for r in res] == expected


@pytest.mark.parametrize(
    ("compiled", "residual"), [(False, False), (True, True)], ids=["eager", "compiled-fuse_residual"]
)
def test_norms_fused_into_the_projections_give_the_same_tokens(
    compiled: bool, residual: bool, fused_expected: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """EngineConfig.fuse_norm_linear: steps of at most 16 tokens run each norm inside the projection after it (with
    the residual add and SwiGLU), prefill chunks above 16 tokens do not; greedy tokens unchanged. On the CPU the op
    computes with PyTorch ops (the Triton kernel is checked in tests/models/test_norm_linear.py): this checks the
    layer wiring (residual stream, attention from the fused QKV, SwiGLU, the fused output layer)."""
    from mcore_models.transformer import norm_linear as nl

    rows = _spy_rows(monkeypatch, nl, "norm_linear_reference")
    _assert_same_greedy_tokens(fused_expected, compile=compiled, fuse_residual=residual, fuse_norm_linear=True)
    # 2 norms per layer + the final norm, on every step of at most 16 tokens: decode steps (1-4 rows) ran fused
    assert rows and max(rows) <= 16 and 1 in rows and len(rows) % 7 == 0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_swiglu_inside_the_down_projection_gives_the_same_tokens(
    compiled: bool, fused_expected: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """EngineConfig.fuse_swiglu_down: steps of at most 4 tokens run each MLP's SwiGLU inside its down projection,
    longer prefill chunks do not; greedy tokens unchanged. On the CPU the op computes with PyTorch ops (the Triton
    kernel is checked in tests/models/test_small_gemv.py): this checks the wiring."""
    from mcore_models.transformer import small_gemv as sg

    rows = _spy_rows(monkeypatch, sg, "swiglu_down_reference")
    added = _spy_deferred_adds(monkeypatch)
    _assert_same_greedy_tokens(fused_expected, compile=compiled, fuse_swiglu_down=True)
    assert rows and max(rows) <= 4 and 1 in rows and len(rows) % 3 == 0  # one per layer, decode steps fused
    # with fuse_residual (the default) the next layer adds the down projection's partial sums itself (seen at
    # trace time when compiled)
    assert 1 in added and 0 in added  # decode steps: partials; long prefill chunks: the plain output


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_output_projection_partials_give_the_same_tokens(
    compiled: bool, fused_expected: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """EngineConfig.fuse_proj_partials: steps of at most 4 tokens leave each attention output projection as
    split-K partial sums that the layer's residual add sums; greedy tokens unchanged (the Triton kernel itself is
    checked in tests/models/test_small_gemv.py; on the CPU the op computes with PyTorch ops)."""
    added = _spy_deferred_adds(monkeypatch)
    _assert_same_greedy_tokens(fused_expected, compile=compiled, fuse_proj_partials=True, fuse_residual=False)
    assert 1 in added  # without fuse_residual, only the projection's partial sums reach add_deferred


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_row_gemv_projections_give_the_same_tokens(
    compiled: bool, fused_expected: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """EngineConfig.row_gemv (with the projection and SwiGLU partials too): steps of at most 4 tokens run the QKV
    projection through the row_linear op, longer steps through cuBLAS; greedy tokens unchanged."""
    from mcore_models.transformer import attention as attention_module

    rows = _spy_rows(monkeypatch, attention_module, "row_linear")
    _assert_same_greedy_tokens(fused_expected, compile=compiled, row_gemv=True, fuse_swiglu_down=True,
                               fuse_proj_partials=True)  # fmt: skip
    assert rows and max(rows) <= 4 and 1 in rows and len(rows) % 3 == 0  # the QKV projection of each of 3 layers


def test_fuse_proj_partials_is_checked() -> None:
    with pytest.raises(ValueError, match="fuse_proj_partials.*add_bias_linear"):
        _llm(tiny_model(add_bias_linear=True), fuse_proj_partials=True)
    with pytest.raises(ValueError, match="fuse_proj_partials and fuse_norm_linear are exclusive"):
        EngineConfig(fuse_proj_partials=True, fuse_norm_linear=True)
    with pytest.raises(ValueError, match="row_gemv and fuse_norm_linear are exclusive"):
        EngineConfig(row_gemv=True, fuse_norm_linear=True)
    with pytest.raises(ValueError, match="row_gemv.*add_bias_linear"):
        _llm(tiny_model(add_bias_linear=True), row_gemv=True)


def test_row_kernels_default_to_auto() -> None:
    """The one-row kernels default to None (auto): on for a compiled runner on CUDA with the Triton backend when the
    model allows each one, off elsewhere and off (never an error) where the model does not allow it; an explicit
    False stays off and an explicit True raises for a model that cannot take it (tested above)."""
    from mcore_infer.config import ROW_KERNELS
    from mcore_infer.runner import apply_row_kernels

    def flags(m):
        layers = list(m.decoder.layers.values())
        got = {
            "fuse_swiglu_down": {layer.mlp.fuse_swiglu_down for layer in layers},
            "fuse_proj_partials": {layer.self_attention.proj_partials for layer in layers},
            "row_gemv": {layer.self_attention.row_gemv for layer in layers},
        }
        assert all(len(v) == 1 for v in got.values())
        return {k: v.pop() for k, v in got.items()}

    assert all(getattr(EngineConfig(), k) is None for k in ROW_KERNELS)
    all_on = dict.fromkeys(ROW_KERNELS, True)
    all_off = dict.fromkeys(ROW_KERNELS, False)
    m = tiny_model(num_layers=2)
    assert apply_row_kernels(m, EngineConfig(compile=True), "cuda", "triton") == all_on == flags(m)
    for cfg, dev, backend in [
        (EngineConfig(compile=True), "cpu", "plain"),
        (EngineConfig(compile=True), "cuda", "plain"),
        (EngineConfig(compile=False), "cuda", "triton"),
        (EngineConfig(compile=True, fuse_norm_linear=True), "cuda", "triton"),
    ]:
        m = tiny_model(num_layers=2)
        apply_row_kernels(m, EngineConfig(compile=True), "cuda", "triton")  # on first: auto must switch them off
        assert apply_row_kernels(m, cfg, dev, backend) == all_off == flags(m), (cfg, dev, backend)
    m = tiny_model(num_layers=2, activation="gelu")
    assert apply_row_kernels(m, EngineConfig(compile=True), "cuda", "triton") == {**all_on, "fuse_swiglu_down": False}
    m = tiny_model(num_layers=2, add_bias_linear=True)
    assert apply_row_kernels(m, EngineConfig(compile=True), "cuda", "triton") == all_off == flags(m)
    m = tiny_model(num_layers=2)
    cfg = EngineConfig(compile=True, row_gemv=False)
    assert apply_row_kernels(m, cfg, "cuda", "triton") == {**all_on, "row_gemv": False} == flags(m)


def test_fuse_swiglu_down_is_checked() -> None:
    with pytest.raises(ValueError, match="fuse_swiglu_down.*activation='gelu'"):
        _llm(tiny_model(activation="gelu"), fuse_swiglu_down=True)
    with pytest.raises(ValueError, match="fuse_swiglu_down and fuse_norm_linear are exclusive"):
        EngineConfig(fuse_swiglu_down=True, fuse_norm_linear=True)


def test_fuse_norm_linear_refuses_a_layernorm_model() -> None:
    model = tiny_model(normalization="layernorm")
    with pytest.raises(ValueError, match="fuse_norm_linear.*normalization='layernorm'"):
        _llm(model, fuse_norm_linear=True)
