"""The decode plan: presets and their validation, what ``auto`` resolves to per device, the decode module's logits
against the plain model, and that serving never changes the caller's model. Kernel presets run the Triton kernels
on the CPU under ``TRITON_INTERPRET=1`` (their PyTorch fallbacks otherwise)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
from torch import nn

from mcore_infer import DECODE_PRESETS, DecodeLaunches, DecodePlan, EngineConfig, SamplingParams, prepare_for_decode
from mcore_infer.decode import DecodeKernels, parse_decode_kernels
from mcore_infer.decode_layers import FusedDecodeLayer, PlainDecodeLayer
from mcore_infer.kernels import GemvLaunch, MlpLaunch, NormLinearLaunch
from mcore_infer.kv_cache import blocks_for
from mcore_infer.runner import StepBatch
from mcore_models import GPTModel, LayerSpec
from mcore_models.transformer.layer import TransformerLayer
from tests._layers import ParallelBlock
from tests.infer._kernels import INTERPRETED
from tests.infer._tiny import prompts_of_lengths, reference_greedy, tiny_config, tiny_llm, tiny_model

ROW = DECODE_PRESETS["row"]
ATTENTION = DECODE_PRESETS["attention"]
FAST = dict(
    device_type="cuda", backend="triton", compiled=True, max_positions=256
)  # where auto turns the row kernels on
GPT_ROW = replace(ROW, gated_norm_gemv=False)  # auto on a GPU for a model with no Mamba layer to take it


def test_preset_names_and_plan_validation() -> None:
    assert set(get_args(DecodeKernels)) == {"auto", *DECODE_PRESETS}
    assert DECODE_PRESETS["none"] == DecodePlan()
    assert DecodePlan(rope_in_attention=True, kv_write_in_attention=True, defer_residual=True) == ATTENTION
    assert replace(ATTENTION, swiglu_down=True, proj_partials=True, row_gemv=True, pdl=True, norm_gemv=True,
                          combine_in_attention=True, row_fc1=True, gated_norm_gemv=True, embed_rope=True,
                          argmax_in_graph=True) == ROW  # fmt: skip
    with pytest.raises(ValueError, match=r"pdl needs a row kernel \(swiglu_down, proj_partials, row_gemv, row_fc1, "):
        replace(ATTENTION, pdl=True)
    assert replace(ATTENTION, row_fc1=True, pdl=True).pdl  # the up projection alone is a row kernel
    with pytest.raises(ValueError, match="fused_mlp runs the whole MLP, row_fc1 only its up projection"):
        replace(ROW, swiglu_down=False, fused_mlp=True)
    for kernel in ("swiglu_down", "proj_partials", "row_gemv", "fused_mlp", "row_fc1"):
        with pytest.raises(ValueError, match=rf"norm_linear is exclusive with {kernel}"):
            DecodePlan(norm_linear=True, **{kernel: True})
    with pytest.raises(ValueError, match="fused_mlp runs the whole MLP, swiglu_down only its down projection"):
        replace(ROW, fused_mlp=True)
    assert replace(ROW, swiglu_down=False, row_fc1=False, fused_mlp=True).pdl
    with pytest.raises(ValueError, match="norm_gemv runs inside the QKV row GEMV: turn row_gemv on"):
        replace(ATTENTION, norm_gemv=True)
    with pytest.raises(ValueError, match=r"launches.row_gemv=2,8,256,4 needs SPLITS=1"):
        replace(ROW, norm_gemv=True, launches=DecodeLaunches(row_gemv=GemvLaunch(2, 8)))
    with pytest.raises(ValueError, match=r"DecodeLaunches.fused_mlp=.*BLOCK_F"):
        DecodeLaunches(fused_mlp=MlpLaunch(48, 128, 64, 8))
    with pytest.raises(ValueError, match=r"DecodeLaunches.swiglu_down=.*SPLITS must be >= 1"):
        DecodeLaunches(swiglu_down=GemvLaunch(0, 8))
    with pytest.raises(ValueError, match=r"DecodeLaunches.norm_linear=.*MODE must be one of"):
        DecodeLaunches(norm_linear=NormLinearLaunch(7, 32, 2, 3))


def test_parse_decode_kernels(tmp_path: Path) -> None:
    """A preset name, a plan's JSON inline or in a file; errors name the value or the file and what is wrong."""
    assert parse_decode_kernels("row") == "row"
    plan = replace(ROW, swiglu_down=False, row_fc1=False, fused_mlp=True)
    assert parse_decode_kernels('{"preset": "row", "swiglu_down": false, "row_fc1": false, "fused_mlp": true}') == plan
    (tmp_path / "plan.json").write_text(json.dumps(plan.to_dict()))
    assert parse_decode_kernels(str(tmp_path / "plan.json")) == plan
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"decode plan file .*list.json: a decode plan is a JSON object, got list"):
        parse_decode_kernels(str(tmp_path / "list.json"))
    with pytest.raises(ValueError, match=r"--decode-kernels 'nowhere.json': not a preset"):
        parse_decode_kernels("nowhere.json")
    with pytest.raises(ValueError, match=r"'\{\"launches\": \{\"qkv\": \[1, 8\]\}\}': .*unknown kernels"):
        parse_decode_kernels('{"launches": {"qkv": [1, 8]}}')


def test_plans_round_trip_through_json_data() -> None:
    plan = replace(ROW, launches=DecodeLaunches(swiglu_down=GemvLaunch(4, 16), row_gemv=GemvLaunch(1, 8, 1024, 4)))
    assert DecodePlan.from_dict(plan.to_dict()) == plan
    gated = replace(ROW, gated_norm_gemv=True, launches=DecodeLaunches(gated_norm_gemv=GemvLaunch(2, 8, 512, 4)))
    assert DecodePlan.from_dict(gated.to_dict()) == gated
    assert parse_decode_kernels('{"preset": "row", "gated_norm_gemv": true, "launches": {"gated_norm_gemv": '
                                '"2,8,512,4"}}') == gated  # fmt: skip
    data = {"preset": "attention", "swiglu_down": True, "launches": {"swiglu_down": "8,16,256,4"}}
    assert DecodePlan.from_dict(data) == replace(
        ATTENTION, swiglu_down=True, launches=DecodeLaunches(swiglu_down=GemvLaunch(8, 16, 256, 4))
    )
    data = {
        "preset": "row",
        "swiglu_down": False,
        "row_fc1": False,
        "fused_mlp": True,
        "launches": {"fused_mlp": "32,64,64,4"},
    }
    mlp = replace(
        ROW,
        swiglu_down=False,
        row_fc1=False,
        fused_mlp=True,
        launches=DecodeLaunches(fused_mlp=MlpLaunch(32, 64, 64, 4)),
    )
    assert DecodePlan.from_dict(data) == mlp and DecodePlan.from_dict(mlp.to_dict()) == mlp
    fc1 = replace(ROW, row_fc1=True, combine_in_attention=True, launches=DecodeLaunches(row_fc1=GemvLaunch(1, 16)))
    assert DecodePlan.from_dict({"preset": "row", "row_fc1": True, "combine_in_attention": True,
                                 "launches": {"row_fc1": [1, 16]}}) == fc1  # fmt: skip
    assert DecodePlan.from_dict(fc1.to_dict()) == fc1
    with pytest.raises(ValueError, match="unknown fields.*'fuse_rope'"):
        DecodePlan.from_dict({"fuse_rope": True})
    with pytest.raises(ValueError, match="launches for unknown kernels.*'qkv'"):
        DecodePlan.from_dict({"launches": {"qkv": [1, 8]}})
    with pytest.raises(ValueError, match="decode preset 'auto'"):  # auto is resolved per device, not a base
        DecodePlan.from_dict({"preset": "auto"})


def test_engine_config_refuses_an_unknown_preset() -> None:
    with pytest.raises(ValueError, match=r"decode_kernels='fast': use a preset name \('auto', 'none', 'attention'"):
        EngineConfig(decode_kernels="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="decode_kernels=True: use a preset name"):
        EngineConfig(decode_kernels=True)  # type: ignore[arg-type]
    assert EngineConfig().decode_kernels == "auto"
    assert EngineConfig(decode_kernels=ROW).decode_kernels is ROW


def _plan(model: GPTModel, kernels: Any = "auto", **where: Any) -> DecodePlan:
    return prepare_for_decode(model, kernels, **{**FAST, **where}).plan


def test_auto_resolves_as_the_device_and_model_allow() -> None:
    """auto: everything but norm_linear on CUDA with the Triton backend and compiled layers, where the model allows
    each row kernel (tp=1, bias-free, SwiGLU for swiglu_down) and never an error where it does not; without compiled
    layers or on the plain backend no row kernels, and on the plain backend no RoPE or KV write in attention."""
    m = tiny_model(num_layers=2)
    assert _plan(m) == GPT_ROW
    assert _plan(m, compiled=False) == ATTENTION
    assert _plan(m, backend="plain") == _plan(m, device_type="cpu", backend="plain") == DecodePlan(defer_residual=True)
    assert _plan(tiny_model(num_layers=2, activation="gelu")) == replace(GPT_ROW, swiglu_down=False)
    biased = replace(ATTENTION, combine_in_attention=True, embed_rope=True, argmax_in_graph=True)  # no row kernel
    assert _plan(tiny_model(num_layers=2, add_bias_linear=True)) == biased
    # a bias on the QKV projection only: the row GEMV (which adds no bias) stays off for it
    assert _plan(tiny_model(num_layers=2, add_qkv_bias=True)) == replace(GPT_ROW, row_gemv=False, norm_gemv=False)
    assert _plan(m, "none") == DecodePlan()
    no_qkv = replace(GPT_ROW, row_gemv=False, norm_gemv=False)
    assert _plan(m, no_qkv) == no_qkv


def test_a_strict_plan_names_what_the_model_lacks() -> None:
    with pytest.raises(ValueError, match=r"DecodePlan.swiglu_down cannot apply to decoder.layers.0: activation='gelu'"):
        _plan(tiny_model(activation="gelu"), "row")
    with pytest.raises(
        ValueError, match=r"DecodePlan.row_gemv cannot apply to decoder.layers.0: .*linear_qkv has a bias"
    ):
        _plan(tiny_model(add_bias_linear=True), DecodePlan(row_gemv=True))
    with pytest.raises(ValueError, match=r"DecodePlan.proj_partials cannot .*linear_proj has a bias"):
        _plan(tiny_model(add_bias_linear=True), DecodePlan(proj_partials=True))
    with pytest.raises(
        ValueError, match=r"DecodePlan.norm_gemv cannot .*input_layernorm is a LayerNorm \(needs RMSNorm"
    ):
        _plan(tiny_model(normalization="layernorm"), DecodePlan(row_gemv=True, norm_gemv=True))
    with pytest.raises(ValueError, match=r"DecodePlan.fused_mlp cannot .*activation='gelu'"):
        _plan(tiny_model(activation="gelu"), DecodePlan(fused_mlp=True))
    with pytest.raises(ValueError, match=r"DecodePlan.norm_linear cannot .*needs RMSNorm; normalization='layernorm'"):
        tiny_llm(tiny_model(normalization="layernorm"), decode_kernels="norm_linear")


# ------------------------------------------------------------------------------- every preset, one real step
def _step_logits(llm: Any, prompts: list[list[int]], nxt: list[int]) -> list[torch.Tensor]:
    """The runner's logits of a prefill step of ``prompts``, then of a decode step of one more token each."""
    r = llm.runner
    bs = r.block_size
    tables = [r.blocks.allocate(blocks_for(len(p) + 1, bs)) for p in prompts]
    pre, dec = StepBatch(), StepBatch()
    for p, t, n in zip(prompts, tables, nxt):
        pre.add(p, 0, t, bs, "last")
        dec.add([n], len(p), t, bs, "last")
    return [r.execute(pre).clone(), r.execute(dec).clone()]


BACKENDS = ["plain"] + (["triton"] if INTERPRETED else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kernels", list(get_args(DecodeKernels)))
def test_each_preset_gives_the_plain_models_logits(kernels: str, backend: str) -> None:
    """A prefill step of 14 tokens (norm_linear's rows) and a decode step of 2 (the row kernels'): the decode
    module's logits equal the plain model's full forward at those positions (on the Triton backend: interpreted on the
    CPU)."""
    model = tiny_model(num_layers=2)
    prompts, nxt = prompts_of_lengths(3, 11, seed=3), [7, 200]
    llm = tiny_llm(model, decode_kernels=kernels, attention_backend=backend)
    got = _step_logits(llm, prompts, nxt)
    with torch.no_grad():
        want = [
            torch.stack([model(torch.tensor([p]), gather_logits=True)[0, -1] for p in prompts]),
            torch.stack([model(torch.tensor([p + [n]]), gather_logits=True)[0, -1] for p, n in zip(prompts, nxt)]),
        ]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- the caller's model is its own
def _attributes(model: nn.Module) -> dict[tuple[str, str], object]:
    """Every module's instance attributes: plain values as they are, containers by the identity of their items,
    everything else by identity."""
    out: dict[tuple[str, str], object] = {}
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if isinstance(value, dict):
                value = {k: id(v) for k, v in value.items()}
            elif not isinstance(value, (bool, int, float, str, type(None))):
                value = id(value)
            out[name, key] = value
    return out


def test_serving_leaves_the_callers_model_alone() -> None:
    """Building an engine (compiled, every row kernel) and generating with it adds, sets and compiles nothing on
    the caller's model: same attributes, same forward, same parameters (shared with the decode module, not
    copied), same logits."""
    torch._dynamo.reset()
    model = tiny_model(num_layers=2)
    ids = torch.tensor([prompts_of_lengths(9, seed=8)[0]])
    with torch.no_grad():
        before_logits = model(ids, gather_logits=True)
    before = _attributes(model)
    state = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    llm = tiny_llm(model, compile=True, decode_kernels="row")
    llm.generate([ids[0].tolist()], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert _attributes(model) == before
    assert all("forward" not in vars(m) and getattr(m, "_compiled_call_impl", None) is None for m in model.modules())
    after = model.state_dict()
    assert after.keys() == state.keys()
    assert all(after[k].data_ptr() == p and torch.equal(after[k], v) for k, (p, v) in state.items())
    decode = llm.runner.decode
    assert {p.data_ptr() for p in decode.parameters()} == {p.data_ptr() for p in model.parameters()}
    assert all(w._compiled_call_impl is not None for w in decode.layers.values())  # the wrappers are compiled
    with torch.no_grad():
        assert torch.equal(model(ids, gather_logits=True), before_logits)
    with pytest.raises(ValueError, match=r"eval mode: call model.eval\(\)"):
        tiny_llm(tiny_model().train())


# -------------------------------------------------------------------------------------- other layer types
def _every_other_layer(config: Any, ctx: Any, spec: LayerSpec, layer_number: int, prefix: str) -> nn.Module:
    cls = ParallelBlock if layer_number % 2 else TransformerLayer
    return cls(config, ctx, spec, layer_number, prefix)


def test_another_layer_type_serves_through_the_plain_path() -> None:
    """Layers built by ``LayerSpec(layer=...)`` that are not the standard layer run their own forward under any plan
    (the standard layers around them keep their fusions, the deferred residual add included): a fusion that does not
    concern a layer is never an error, so a new layer type serves without touching the decode plan."""
    model = GPTModel(tiny_config(num_layers=3), spec=LayerSpec(layer=_every_other_layer)).eval()
    prompts = prompts_of_lengths(5, 40, 3, seed=6)
    expected = [reference_greedy(model, p, 6) for p in prompts]
    llm = tiny_llm(model)
    assert [type(w) for w in llm.runner.decode.layers.values()] == [
        FusedDecodeLayer,
        PlainDecodeLayer,
        FusedDecodeLayer,
    ]
    assert llm.runner.plan.defer_residual
    res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [r.outputs[0].token_ids for r in res] == expected
    assert _plan(model) == GPT_ROW  # auto on a GPU: every fusion, on the layers that take it
    for kernels in ("attention", "row", DecodePlan(defer_residual=True), "none"):
        llm = tiny_llm(model, decode_kernels=kernels)
        assert isinstance(llm.runner.decode.layers["1"], PlainDecodeLayer)


class GeluMLP(nn.Module):
    """A stand-in for a non-standard MLP (an MoE, say): the standard layer around it still takes the attention
    fusions, not the MLP's."""

    def __init__(self, config: Any, ctx: Any, spec: LayerSpec, prefix: str) -> None:
        super().__init__()
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.nn.functional.gelu(x))


class PlainAttention(nn.Module):
    """A stand-in for another attention: no projections, ``q`` the layer's input split into heads and ``k = v`` its
    first head of each query group."""

    def __init__(self, config: Any, ctx: Any, spec: LayerSpec, prefix: str, **kw: Any) -> None:
        super().__init__()
        self.heads, self.groups, self.d = config.num_attention_heads, config.query_groups, config.head_dim

    def forward(self, x: torch.Tensor, rotary: Any = None, inference_context: Any = None) -> torch.Tensor:
        s, b, _ = x.shape
        rep = self.heads // self.groups
        q = x.reshape(s, b, self.heads, self.d)
        k = q[:, :, ::rep]
        if inference_context is not None:
            return inference_context.attention(q, k, k)
        q, k = q.permute(1, 2, 0, 3), k.repeat_interleave(rep, dim=2).permute(1, 2, 0, 3)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def test_a_standard_layer_with_another_mlp_keeps_the_attention_fusions() -> None:
    """Decided per layer part: every preset leaves the other MLP to its own forward (no swiglu_down; norm_linear
    fuses only the first norm into the QKV projection) and keeps the attention's fusions."""
    model = GPTModel(tiny_config(num_layers=2), spec=LayerSpec(mlp=GeluMLP)).eval()
    assert _plan(model) == replace(GPT_ROW, swiglu_down=False, row_fc1=False)
    assert _plan(model, "row") == replace(GPT_ROW, swiglu_down=False, row_fc1=False)
    assert _plan(model, "norm_linear") == DECODE_PRESETS["norm_linear"]
    prompts = prompts_of_lengths(5, 20, seed=2)
    expected = [reference_greedy(model, p, 5) for p in prompts]
    for kernels in ("row", "norm_linear"):
        llm = tiny_llm(model, decode_kernels=kernels)
        layer = llm.runner.decode.layers["0"]
        assert isinstance(layer, FusedDecodeLayer) and not layer.swiglu_down and not layer.norm_linear_mlp
        res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        assert [r.outputs[0].token_ids for r in res] == expected


def test_a_standard_layer_with_another_attention_keeps_the_deferred_add() -> None:
    """Another attention module is called whole (never its pieces), while the layer keeps the deferred residual add
    and, with the standard MLP, swiglu_down."""
    model = GPTModel(tiny_config(num_layers=2), spec=LayerSpec(attention=PlainAttention)).eval()
    assert _plan(model, "row") == replace(
        ATTENTION, swiglu_down=True, pdl=True, combine_in_attention=True, row_fc1=True, embed_rope=True,
        argmax_in_graph=True,
    )  # fmt: skip
    prompts = prompts_of_lengths(5, 20, seed=4)
    expected = [reference_greedy(model, p, 5) for p in prompts]
    llm = tiny_llm(model, decode_kernels="row")
    assert all(isinstance(w, FusedDecodeLayer) and w.defer for w in llm.runner.decode.layers.values())
    res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert [r.outputs[0].token_ids for r in res] == expected


def test_graph_steps_take_every_attention_option_of_the_plan() -> None:
    """A CUDA graph's step builds its attention context through the runner as an eager step does: the plan's
    attention launch and fusions reach the kernels in both (the graphs once dropped the launch, so launches timed
    through the graphs all ran the default)."""
    from mcore_infer import AttentionLaunch
    from mcore_infer.graphs import _context

    launch = AttentionLaunch(8, 1, 1, 8)
    plan = replace(GPT_ROW, launches=DecodeLaunches(attention=launch))
    llm = tiny_llm(tiny_model(), decode_kernels=plan)
    runner = llm.runner
    st = {k: torch.zeros(4, dtype=torch.int64) for k in ("slots", "tseq", "tctx")} | {"bt": torch.zeros(4, 3).long()}
    graph = _context(runner, st, 2, 2, None, decode=True)
    eager = runner.attention_context(st["slots"][:2], st["bt"][:2], st["tseq"][:2], st["tctx"][:2], None, "triton",
                                     True, None)  # fmt: skip
    assert graph.attention_launch == launch
    for name in ("attention_launch", "fuses_rotary", "fuse_kv_write", "pdl", "fold_combine", "kv_index", "backend"):
        assert getattr(graph, name) == getattr(eager, name), name
    p = runner.plan
    assert (graph.fuse_kv_write, graph.fold_combine, graph.fuses_rotary, graph.pdl) == (
        p.kv_write_in_attention, p.combine_in_attention, p.rope_in_attention, p.pdl)  # fmt: skip
    assert runner.plan.launches.attention == launch


def test_decode_sets_offer_the_next_sets_ids_with_two_sets_only() -> None:
    """``DecodeSets.next_ids``: with two input sets a draw may write its tokens into the ids of the set the next decode
    step replays (up to the largest graph's rows); with one set (the default) it may not, so the draw keeps its own
    tensor and the step copies it."""
    from types import SimpleNamespace

    from mcore_infer.graphs import DecodeSets

    bufs = [torch.zeros(8, dtype=torch.int64) for _ in range(2)]
    sets = [(SimpleNamespace(view={"ids": b}), {1: None, 4: None}) for b in bufs]
    two = DecodeSets(sets, upload_stream=None)  # type: ignore[arg-type]
    assert two.next_ids(3) is not None and two.next_ids(3).data_ptr() == bufs[0].data_ptr()  # type: ignore[union-attr]
    two.next = 1
    got = two.next_ids(4)
    assert got is not None and got.data_ptr() == bufs[1].data_ptr() and got.shape == (4,)
    assert two.next_ids(5) is None  # beyond the largest graph: the step runs another way
    assert DecodeSets(sets[:1], upload_stream=None).next_ids(3) is None  # type: ignore[arg-type]


def test_decode_sets_offer_a_graphs_drawn_ids_only_for_its_rows() -> None:
    """``DecodeSets.drawn_ids``: the next set's ids hold the last step's greedy tokens when its graph drew them
    (``argmax_in_graph``) for exactly these rows; after any other step, or for another row count, none."""
    from types import SimpleNamespace

    from mcore_infer.graphs import DecodeSets

    bufs = [torch.zeros(8, dtype=torch.int64) for _ in range(2)]
    sets = DecodeSets([(SimpleNamespace(view={"ids": b}), {4: None}) for b in bufs], None, draws=True)  # type: ignore[misc]
    assert sets.drawn_ids(3) is None  # nothing drawn yet
    sets.next, sets.drawn = 1, 3
    got = sets.drawn_ids(3)
    assert got is not None and got.data_ptr() == bufs[1].data_ptr() and got.shape == (3,)
    assert sets.drawn_ids(2) is None
    sets.drawn = None
    assert sets.drawn_ids(3) is None


def test_a_step_whose_context_names_argmax_out_draws_into_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a decode graph captures with ``argmax_in_graph``: after the logits, each row's argmax goes into the
    context's ``argmax_out`` (the next set's ids), equal to the logits' own argmax."""
    llm = tiny_llm(tiny_model(num_layers=2), decode_kernels=replace(GPT_ROW, argmax_in_graph=True))
    runner = llm.runner
    assert runner.plan.argmax_in_graph
    buf = torch.full((2,), -1, dtype=torch.int64)
    real = runner.attention_context

    def with_out(*a: Any, **k: Any) -> Any:
        ctx = real(*a, **k)
        ctx.argmax_out = buf
        return ctx

    monkeypatch.setattr(runner, "attention_context", with_out)
    _, decode_logits = _step_logits(llm, prompts_of_lengths(3, 11, seed=4), [9, 100])
    assert torch.equal(buf, decode_logits.argmax(-1))
