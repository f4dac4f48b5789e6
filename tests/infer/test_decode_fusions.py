"""Each layer fusion of a decode plan gives the plain recompute loop's greedy tokens, eager and compiled, and really
runs where it should (steps of at most 4 or 16 tokens). On the CPU the kernels' ops compute with PyTorch ops (the
Triton kernels themselves are checked in test_norm_linear.py and test_small_gemv.py): this checks the wiring."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from mcore_infer import DECODE_PRESETS, DecodeLaunches, DecodePlan, SamplingParams
from mcore_infer.kernels import GemvLaunch
from tests.infer._kernels import INTERPRETED
from tests.infer._tiny import prompts_of_lengths, reference_greedy, tiny_llm, tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
FUSED_PROMPTS = prompts_of_lengths(5, 40, 17, 70, 3, 33)
ATTENTION = DECODE_PRESETS["attention"]
# these count the calls of the ops' PyTorch fallbacks, which the interpreter replaces by the kernels
counts_fallbacks = pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET=1 runs the kernels, not the fallbacks")

ROW_GEMVS = replace(DECODE_PRESETS["row"], norm_gemv=False, row_fc1=False, combine_in_attention=False)
"""The ``row`` preset without its norm-in-GEMV, up-projection GEMV and combine-in-attention fusions: the row GEMVs
and the separate add + norm kernels whose launches the tests below count."""


@pytest.fixture(scope="module")
def fused_expected() -> list[list[int]]:
    """The plain recompute loop's greedy tokens for FUSED_PROMPTS (computed before any test installs its spies)."""
    return [reference_greedy(tiny_model(num_layers=3), p, 10) for p in FUSED_PROMPTS]


def _spy_rows(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Record the token count (rows of the first argument) of every call to ``module.name``."""
    rows: list[int] = []
    real = getattr(module, name)

    def spy(x, *a, **k):  # type: ignore[no-untyped-def]
        rows.append(x.numel() // x.shape[-1])
        return real(x, *a, **k)

    monkeypatch.setattr(module, name, spy)
    return rows


def _spy_deferred_adds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record, for every ``add_deferred`` of the decode layers, how many dims its output had over the residual (1:
    the output was split-K partial sums)."""
    from mcore_infer import decode_layers

    added: list[int] = []
    real = decode_layers.add_deferred

    def spy(x, residual):  # type: ignore[no-untyped-def]
        added.append(x.dim() - residual.dim())
        return real(x, residual)

    monkeypatch.setattr(decode_layers, "add_deferred", spy)
    return added


def _assert_same_greedy_tokens(expected: list[list[int]], **cfg: object) -> None:
    torch._dynamo.reset()
    res = tiny_llm(tiny_model(num_layers=3), **cfg).generate(FUSED_PROMPTS, GREEDY)
    assert [r.outputs[0].token_ids for r in res] == expected


@counts_fallbacks
@pytest.mark.parametrize(("compiled", "residual"), [(False, False), (True, True)], ids=["eager", "compiled-deferred"])
def test_norms_fused_into_the_projections_give_the_same_tokens(
    compiled: bool, residual: bool, fused_expected: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``norm_linear``: steps of at most 16 tokens run each norm inside the projection after it (with the residual
    add and SwiGLU), prefill chunks above 16 tokens do not; greedy tokens unchanged. Checks the layer wiring
    (residual stream, attention from the fused QKV, SwiGLU, the fused output layer)."""
    from mcore_infer.kernels import norm_linear as nl

    rows = _spy_rows(monkeypatch, nl, "norm_linear_reference")
    plan = DecodePlan(norm_linear=True, defer_residual=residual)
    _assert_same_greedy_tokens(fused_expected, compile=compiled, decode_kernels=plan)
    # 2 norms per layer + the final norm, on every step of at most 16 tokens: decode steps (1-4 rows) ran fused
    assert rows and max(rows) <= 16 and 1 in rows and len(rows) % 7 == 0


@counts_fallbacks
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_swiglu_inside_the_down_projection_gives_the_same_tokens(
    compiled: bool, fused_expected: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``swiglu_down``: steps of at most 4 tokens run each MLP's SwiGLU inside its down projection, longer prefill
    chunks do not; greedy tokens unchanged."""
    from mcore_infer.kernels import small_gemv as sg

    rows = _spy_rows(monkeypatch, sg, "swiglu_down_reference")
    added = _spy_deferred_adds(monkeypatch)
    _assert_same_greedy_tokens(fused_expected, compile=compiled, decode_kernels=replace(ATTENTION, swiglu_down=True))
    assert rows and max(rows) <= 4 and 1 in rows and len(rows) % 3 == 0  # one per layer, decode steps fused
    # with the deferred residual add the next layer adds the down projection's partial sums itself (seen at trace
    # time when compiled)
    assert 1 in added and 0 in added  # decode steps: partials; long prefill chunks: the plain output


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_output_projection_partials_give_the_same_tokens(
    compiled: bool, fused_expected: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``proj_partials``: steps of at most 4 tokens leave each attention output projection as split-K partial sums
    that the layer's residual add sums; greedy tokens unchanged."""
    added = _spy_deferred_adds(monkeypatch)
    _assert_same_greedy_tokens(fused_expected, compile=compiled, decode_kernels=DecodePlan(proj_partials=True))
    assert 1 in added  # without the deferred residual add, only the projection's partial sums reach add_deferred


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_row_gemv_projections_give_the_same_tokens(
    compiled: bool, fused_expected: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The row GEMVs (``row_gemv`` with the projection and SwiGLU partials): steps of at most 4 tokens run the QKV
    projection through the row_linear op, longer steps through cuBLAS; greedy tokens unchanged."""
    from mcore_infer import decode_layers

    rows = _spy_rows(monkeypatch, decode_layers, "row_linear")
    _assert_same_greedy_tokens(fused_expected, compile=compiled, decode_kernels=ROW_GEMVS)
    assert rows and max(rows) <= 4 and 1 in rows and len(rows) % 3 == 0  # the QKV projection of each of 3 layers


ROW_FC1_PLANS = {
    "eager": (False, DecodePlan(row_fc1=True)),  # the up projection's output through the MLP's activation and fc2
    "compiled-row": (True, replace(ROW_GEMVS, row_fc1=True)),  # into swiglu_down
}


@pytest.mark.parametrize("case", list(ROW_FC1_PLANS))
def test_row_gemv_up_projection_gives_the_same_tokens(
    case: str, fused_expected: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``row_fc1``: steps of at most 4 tokens run each MLP's up projection through the row_linear op (longer steps
    through cuBLAS); greedy tokens unchanged, with and without the other row kernels."""
    from mcore_infer import decode_layers

    compiled, plan = ROW_FC1_PLANS[case]
    ffn2 = 2 * tiny_model(num_layers=3).config.ffn_size  # the gated up projection's outputs
    widths: list[tuple[int, int]] = []
    real = decode_layers.row_linear

    def spy(x, weight, *a, **k):  # type: ignore[no-untyped-def]
        widths.append((x.numel() // x.shape[-1], weight.shape[0]))
        return real(x, weight, *a, **k)

    monkeypatch.setattr(decode_layers, "row_linear", spy)
    _assert_same_greedy_tokens(fused_expected, compile=compiled, decode_kernels=plan)
    fc1 = [rows for rows, n in widths if n == ffn2]
    assert fc1 and max(fc1) <= 4 and 1 in fc1 and len(fc1) % 3 == 0  # one per layer, decode steps only


FUSED_MLP_PLANS = {
    "eager": (False, DecodePlan(fused_mlp=True)),
    "eager-deferred": (False, DecodePlan(fused_mlp=True, defer_residual=True)),
    "compiled-row": (True, replace(DECODE_PRESETS["row"], swiglu_down=False, row_fc1=False, fused_mlp=True)),
}


@pytest.mark.parametrize("case", list(FUSED_MLP_PLANS))
def test_fused_mlp_gives_the_same_tokens(
    case: str, fused_expected: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fused_mlp``: steps of at most 4 tokens run each MLP, with the residual add and RMSNorm before it, through
    the fused kernel's op (its float32 sum rounded back to the layer's dtype without the deferred add, added by the
    next layer's residual add with it), longer prefill chunks through the layer's own norm and GEMMs; greedy tokens
    unchanged."""
    from mcore_infer import decode_layers

    compiled, plan = FUSED_MLP_PLANS[case]
    rows = _spy_rows(monkeypatch, decode_layers, "norm_mlp_partials")
    added = _spy_deferred_adds(monkeypatch)
    _assert_same_greedy_tokens(fused_expected, compile=compiled, decode_kernels=plan)
    assert rows and max(rows) <= 4 and 1 in rows and len(rows) % 3 == 0  # one per layer, decode steps fused
    if plan.defer_residual and not plan.pdl:  # (with pdl the add + norm kernel's op adds it)
        assert 1 in added  # the next layer adds the MLP's float32 sum as a partial


NORM_GEMV_PLANS = {
    "eager": (False, DecodePlan(row_gemv=True, norm_gemv=True)),
    "compiled-row-fused-mlp": (
        True,
        replace(DECODE_PRESETS["row"], swiglu_down=False, row_fc1=False, fused_mlp=True, norm_gemv=True),
    ),
    "compiled-row": (True, DECODE_PRESETS["row"]),  # the row preset: the MLP's norm too, the combine in attention
    "eager-fc1-no-swiglu-down": (False, DecodePlan(row_gemv=True, norm_gemv=True, row_fc1=True)),
}


@pytest.mark.parametrize("case", list(NORM_GEMV_PLANS))
def test_norms_inside_the_row_gemvs_give_the_same_tokens(
    case: str, fused_expected: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``norm_gemv``: in steps of at most 4 tokens every layer runs its residual add (the first and, without the
    deferred add, every layer: none) and input norm inside the QKV row GEMV, and the model its last add and final
    norm inside the output layer's (with ``row_fc1`` each MLP's add and norm inside its up projection's); longer
    prefill chunks run the norms and cuBLAS. Greedy tokens unchanged, also with every other small-step fusion of the
    candidate plans."""
    from mcore_infer import decode, decode_layers

    compiled, plan = NORM_GEMV_PLANS[case]
    rows = _spy_rows(monkeypatch, decode_layers, "norm_row_linear")
    plain = _spy_rows(monkeypatch, decode_layers, "row_linear")
    head = _spy_rows(monkeypatch, decode, "norm_row_linear")
    _assert_same_greedy_tokens(fused_expected, compile=compiled, decode_kernels=plan)
    per_layer = 2 if plan.row_fc1 else 1  # the QKV projection's (and the up projection's)
    assert rows and max(rows) <= 4 and 1 in rows and len(rows) % (3 * per_layer) == 0 and not plain
    assert head and max(head) <= 4 and 1 in head  # (eager, not compiled: every decode step)


def test_fused_mlp_after_another_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A LayerNorm model: the norm runs by itself and the fused kernel takes its output (the kernel's own norm is
    an RMSNorm); greedy tokens unchanged."""
    from mcore_infer import decode_layers

    model = tiny_model(num_layers=2, normalization="layernorm")
    expected = [reference_greedy(model, p, 10) for p in FUSED_PROMPTS]
    rows = _spy_rows(monkeypatch, decode_layers, "fused_mlp_partials")
    fused = _spy_rows(monkeypatch, decode_layers, "norm_mlp_partials")
    torch._dynamo.reset()
    plan = DecodePlan(fused_mlp=True, defer_residual=True)
    res = tiny_llm(tiny_model(num_layers=2, normalization="layernorm"), decode_kernels=plan).generate(
        FUSED_PROMPTS, GREEDY
    )
    assert [r.outputs[0].token_ids for r in res] == expected
    assert rows and max(rows) <= 4 and 1 in rows and not fused


def test_plan_launches_reach_the_kernels(fused_expected: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan's launch overrides are passed to each kernel call of its fusion (None: the kernel's heuristic)."""
    from mcore_infer import decode_layers

    seen: dict[str, set[object]] = {"swiglu_down_partials": set(), "linear_partials": set(), "row_linear": set()}
    for name in seen:
        real = getattr(decode_layers, name)

        def spy(x, w, launch, *more, _real=real, _name=name):  # type: ignore[no-untyped-def]
            seen[_name].add(launch)
            return _real(x, w, launch, *more)

        monkeypatch.setattr(decode_layers, name, spy)
    launches = DecodeLaunches(swiglu_down=GemvLaunch(4, 16), proj_partials=GemvLaunch(2, 8, 512, 2))
    plan = replace(ROW_GEMVS, launches=launches)
    _assert_same_greedy_tokens(fused_expected, decode_kernels=plan)
    assert seen == {
        "swiglu_down_partials": {GemvLaunch(4, 16, 256, 4)},
        "linear_partials": {GemvLaunch(2, 8, 512, 2)},
        "row_linear": {None},
    }


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_pdl_norms_give_the_same_tokens(
    compiled: bool, fused_expected: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pdl``: steps of at most 4 tokens run both norms of each layer as add_rms_norm (the first layer's without a
    residual, the others' with the previous layer's partial sums), and the last add with the final norm before the
    output layer; longer steps the layer's norms and the model's head; greedy tokens unchanged."""
    from mcore_infer import decode, decode_layers

    rows = _spy_rows(monkeypatch, decode_layers, "add_rms_norm")
    head = _spy_rows(monkeypatch, decode, "add_rms_norm")
    assert ROW_GEMVS.pdl and DECODE_PRESETS["row"].pdl  # (the default on CUDA with compiled layers)
    _assert_same_greedy_tokens(fused_expected, compile=compiled, decode_kernels=ROW_GEMVS)
    assert rows and max(rows) <= 4 and 1 in rows and len(rows) % 6 == 0  # two norms in each of 3 layers
    assert head and max(head) <= 4 and 1 in head and len(head) == len(rows) // 6  # the final norm of each step
