"""The decode plan's layer fusions on a hybrid model (``M*-M-``): each Mamba layer's projections, the attention
layer's and the MLP layers' run through the row kernels in decode steps, and the tokens stay full recompute's. On the
CPU the kernels' ops compute with PyTorch ops; under ``TRITON_INTERPRET=1`` (the nox ``kernels`` session) the Triton
row kernels run, on the Mamba layers' shapes too."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mcore_infer import DECODE_PRESETS, decode_layers
from mcore_models import GPTModel, preset
from tests.infer._kernels import INTERPRETED
from tests.infer._tiny import prompts_of_lengths, reference_greedy, tiny_llm
from tests.infer.test_mamba import GREEDY, PROMPT_LENGTHS


def _weights(model: GPTModel, *names: str) -> set[int]:
    """The storages of the parameters of ``model``'s layers at the dotted ``names`` (those each layer has)."""
    return {p.data_ptr() for layer in model.decoder.layers.values() for n, p in layer.named_parameters() if n in names}


@pytest.mark.parametrize(
    ("pattern", "compiled", "gated"),
    [("M*-M-", False, False), ("M*-M-", True, False), ("-*M", False, False), ("M*-M-", False, True),
     ("M*-M-", True, True)],
    ids=["mamba-first", "mamba-first-compiled", "mlp-first", "gated-norm-gemv", "gated-norm-gemv-compiled"],
)  # fmt: skip
def test_the_row_plan_fuses_every_hybrid_layer(
    monkeypatch: pytest.MonkeyPatch, compiled: bool, pattern: str, gated: bool
) -> None:
    """Under the ``row`` plan a decode step runs each Mamba layer's in-projection with the residual add and the norm
    inside its row GEMV and its out-projection as partial sums (with ``gated_norm_gemv``, the gated norm inside it),
    the attention layer's QKV and the MLP layers' up projections the same way, SwiGLU inside their down projections;
    the tokens are full recompute's. The first layer, Mamba or MLP, has no residual to add."""
    if compiled and INTERPRETED:
        pytest.skip("compiled: the wiring is checked on the PyTorch path; the eager cases run the interpreted kernels")
    torch._dynamo.reset()
    cfg = preset("hybrid-tiny", vocab_size=259, init_method_std=0.2, hybrid_pattern=pattern, num_layers=len(pattern),
                 seed=7)  # fmt: skip
    model = GPTModel(cfg).eval()
    calls: dict[str, list[int]] = {}  # each call's weight, by its storage
    for name in ("norm_row_linear", "linear_partials", "swiglu_down_partials", "row_linear", "gated_norm_partials"):
        real = getattr(decode_layers, name)

        def spy(x, *a, _name=name, _real=real, **k):  # type: ignore[no-untyped-def]
            weight = next(t for t in a if isinstance(t, torch.Tensor) and t.dim() == 2)
            calls.setdefault(_name, []).append(weight.data_ptr())
            return _real(x, *a, **k)

        monkeypatch.setattr(decode_layers, name, spy)
    prompts = prompts_of_lengths(*PROMPT_LENGTHS, seed=11)
    plan = replace(DECODE_PRESETS["row"], gated_norm_gemv=gated)
    llm = tiny_llm(model, decode_kernels=plan, compile=compiled)
    assert [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)] == [
        reference_greedy(model, p, 8) for p in prompts
    ]
    served = llm.runner.decode.model
    qkv, proj = "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight"
    assert {*calls["norm_row_linear"]} == _weights(served, "mixer.in_proj.weight", qkv, "mlp.linear_fc1.weight")
    mamba_out = _weights(served, "mixer.out_proj.weight")
    assert {*calls["linear_partials"]} == _weights(served, proj) | (set() if gated else mamba_out)
    assert {*calls.get("gated_norm_partials", [])} == (mamba_out if gated else set())
    assert {*calls["swiglu_down_partials"]} == _weights(served, "mlp.linear_fc2.weight")
    assert len(_weights(served, "mixer.in_proj.weight")) == pattern.count("M")
    assert "row_linear" not in calls  # every row GEMV took its norm inside


def test_a_layer_that_cannot_take_a_fusion_is_named_or_keeps_it_off() -> None:
    """With LayerNorm the norm cannot go inside the in-projection's GEMV: the ``row`` preset (strict) names the Mamba
    layer and why; ``auto`` on a GPU keeps that one fusion off and the layer's others on."""
    from mcore_infer.decode import prepare_for_decode
    from mcore_infer.decode_layers import FusedMambaLayer

    cfg = preset("hybrid-tiny", vocab_size=259, hybrid_pattern="M-", num_layers=2, normalization="layernorm")
    model = GPTModel(cfg).eval()
    with pytest.raises(
        ValueError, match=r"norm_gemv cannot apply to decoder\.layers\.0: input_layernorm is a LayerNorm"
    ):
        prepare_for_decode(model, "row", device_type="cpu")
    decode = prepare_for_decode(model, "auto", device_type="cuda", backend="triton", compiled=True)
    mamba = decode.layers["0"]
    assert isinstance(mamba, FusedMambaLayer)
    assert (mamba.row_gemv, mamba.norm_gemv, mamba.proj_partials, mamba.defer) == (True, False, True, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gated", [False, True], ids=["row", "row-gated-norm-gemv"])
def test_the_row_plan_on_cuda_gives_full_recompute_tokens(gated: bool) -> None:
    """On the GPU, compiled layers under CUDA graphs, the row plan's Triton kernels on every hybrid layer (with
    ``gated_norm_gemv``, the gated norm inside the out-projection's GEMV) give full recompute's tokens in float32."""
    torch._dynamo.reset()
    cfg = preset("hybrid-tiny", vocab_size=259, init_method_std=0.2, hybrid_pattern="M*-M-", num_layers=5, seed=7)
    model = GPTModel(cfg).eval().cuda()
    prompts = prompts_of_lengths(*PROMPT_LENGTHS, seed=11)
    plan = replace(DECODE_PRESETS["row"], gated_norm_gemv=gated)
    llm = tiny_llm(model, decode_kernels=plan, compile=True, cuda_graphs=True)
    assert llm.runner.graphs
    assert [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)] == [
        reference_greedy(model, p, 8) for p in prompts
    ]


def test_each_kind_of_hybrid_layer_has_its_own_compiled_graphs() -> None:
    """``torch.compile`` keeps at most ``recompile_limit`` (8) graphs a function over all instances. The attention
    and MLP halves of a hybrid model each have their own ``forward`` (one shared forward outgrew the limit serving
    ``hybrid-1b`` on an H100, and the layers past it ran uncompiled): after steps of 1, 2-4 and more tokens, each
    holds a few graphs, well under the limit; the tokens are full recompute's."""
    if INTERPRETED:
        pytest.skip("compiled: the graphs are counted on the PyTorch path")
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from mcore_infer.decode_layers import FusedAttentionLayer, FusedDecodeLayer, FusedMambaLayer, FusedMLPLayer

    torch._dynamo.reset()
    cfg = preset("hybrid-tiny", vocab_size=259, init_method_std=0.2, hybrid_pattern="M-M-*-M-", num_layers=8, seed=7)
    model = GPTModel(cfg).eval()
    llm = tiny_llm(model, decode_kernels="row", compile=True, max_num_seqs=8)
    prompts = prompts_of_lengths(3, 5, 9, 17, 30, 2, seed=1)
    for n in (1, 3, 6):  # decode steps of 1, 3 and 6 rows, prefill chunks of more
        got = [r.outputs[0].token_ids for r in llm.generate(prompts[:n], GREEDY)]
        assert got == [reference_greedy(model, p, 8) for p in prompts[:n]]
    wrappers = {type(w) for w in llm.runner.decode.layers.values()}
    assert wrappers == {FusedMambaLayer, FusedAttentionLayer, FusedMLPLayer}
    graphs = {c.__name__: len(_debug_get_cache_entry_list(c.forward.__code__)) for c in wrappers | {FusedDecodeLayer}}
    assert graphs["FusedDecodeLayer"] == 0
    assert 1 <= graphs["FusedAttentionLayer"] <= 4 and 1 <= graphs["FusedMLPLayer"] <= 4, graphs
    assert graphs["FusedMambaLayer"] <= 6, graphs  # with the first layer's (no residual yet)
