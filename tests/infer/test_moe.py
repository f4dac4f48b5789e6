"""Serving MoE models: greedy generation through the engine (paged KV cache, continuous batching, chunked prefill)
equals full-recompute greedy decoding, under every decode preset with the MoE layers left to their own forward; an
MoE checkpoint loads and serves (Python API and the OpenAI server); and CUDA-graph capture is refused, with the
reason, where an MoE layer's step would read device values on the host."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, get_args

import pytest
import torch

from mcore_infer import LLM, EngineConfig, SamplingParams
from mcore_infer.decode import DecodeKernels
from mcore_infer.decode_layers import FusedDecodeLayer, PlainDecodeLayer
from mcore_infer.runner import graph_blockers
from mcore_models import GPTModel
from mcore_models.checkpoint import save_weights
from mcore_models.moe import MoEConfig, MoELayer
from mcore_models.presets import preset
from mcore_parallel import ParallelConfig, ParallelState
from mcore_parallel.testing import run_distributed
from tests.infer._tiny import prompts_of_lengths, reference_greedy, tiny_config, tiny_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CASES = {
    # a dense layer, then an MoE layer
    "mixed": dict(num_experts=4, router_topk=2, ffn_hidden_size=32, layer_freq=[0, 1]),
    # every layer MoE, with a gated shared expert and DeepSeek-style sigmoid routing
    "shared": dict(
        num_experts=4,
        router_topk=2,
        ffn_hidden_size=32,
        shared_expert_ffn_hidden_size=48,
        shared_expert_gate=True,
        router_score_function="sigmoid",
    ),
}


def moe_model(case: str, **kw: Any) -> GPTModel:
    return GPTModel(tiny_config(num_layers=2, moe=MoEConfig(**{**CASES[case], **kw}))).eval()


def _count_moe_calls(model: GPTModel) -> list[int]:
    """A counter of the calls of the model's MoE layers (a forward hook on each)."""
    calls = [0]

    def hook(*_: Any) -> None:
        calls[0] += 1

    for m in model.modules():
        if isinstance(m, MoELayer):
            m.register_forward_hook(hook)
    return calls


@pytest.mark.parametrize("case", CASES)
def test_engine_greedy_equals_full_recompute(case: str) -> None:
    """Five requests of different lengths through four sequence slots and a 32-token step budget: continuous
    batching, chunked prefill and decode steps mixing requests. Every step calls each MoE layer once."""
    model = moe_model(case)
    prompts = prompts_of_lengths(5, 40, 17, 3, 33, seed=11)
    expected = [reference_greedy(model, p, 8) for p in prompts]
    assert len({tuple(e) for e in expected}) > 1  # the outputs depend on the prompt
    llm = tiny_llm(model)
    calls = _count_moe_calls(model)
    res = llm.generate(prompts, GREEDY)
    assert [r.outputs[0].token_ids for r in res] == expected
    moe = sum(isinstance(m, MoELayer) for m in model.modules())
    assert calls[0] == moe * llm.engine.num_steps


@pytest.mark.parametrize("kernels", get_args(DecodeKernels))
def test_every_preset_leaves_the_moe_layers_unfused(kernels: str) -> None:
    """Any preset applies to an MoE model: the MoE layers' MLP gets no fusion (no swiglu_down, and norm_linear fuses
    only the first norm into the QKV projection), the attention side and the dense layer keep theirs, and the tokens
    are the plain model's."""
    model = moe_model("mixed")
    prompts = prompts_of_lengths(6, 21, 2, seed=5)
    expected = [reference_greedy(model, p, 6) for p in prompts]
    llm = tiny_llm(model, decode_kernels=kernels)
    wrappers = llm.runner.decode.layers
    if kernels == "none":
        assert all(isinstance(w, PlainDecodeLayer) for w in wrappers.values())
    else:
        dense, moe = wrappers["0"], wrappers["1"]
        assert isinstance(dense, FusedDecodeLayer) and isinstance(moe, FusedDecodeLayer)
        assert not moe.swiglu_down and not moe.norm_linear_mlp
        assert dense.swiglu_down == (kernels == "row") and dense.norm_linear_mlp == (kernels == "norm_linear")
        assert moe.row_gemv == moe.proj_partials == (kernels == "row") and moe.norm_linear == (kernels == "norm_linear")
    calls = _count_moe_calls(model)
    res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [r.outputs[0].token_ids for r in res] == expected
    assert calls[0] == llm.engine.num_steps


def test_cuda_graphs_are_refused_where_an_moe_step_syncs(caplog: pytest.LogCaptureFixture) -> None:
    """The experts' per-expert loop (not grouped_mm: float32 here) reads the row counts on the host, which CUDA-graph
    capture cannot take, and a capacity depends on the step's token count: the runner says so and runs eagerly.
    Dense models have no blocker."""
    model = moe_model("mixed")
    (reason,) = graph_blockers(model)
    assert reason.startswith("MoE layers 1: the experts' weights (torch.float32 on cpu) run the per-expert loop")
    capped = graph_blockers(moe_model("shared", capacity_factor=1.0))
    assert len(capped) == 2 and "MoE layers 0,1: moe.capacity_factor=1.0" in capped[0]
    assert graph_blockers(GPTModel(tiny_config(num_layers=2)).eval()) == []
    llm = tiny_llm(model)
    runner = llm.runner
    runner.device, runner.backend = torch.device("cuda"), "triton"  # where capture would otherwise begin
    with caplog.at_level(logging.WARNING, logger="mcore_infer.runner"):
        runner.capture_graphs()
    assert runner.graphs == {}
    assert "CUDA graphs off, every step runs eagerly: MoE layers 1: the experts' weights" in caplog.text


# ----------------------------------------------------------------------------------------- checkpoints, server
CKPT_ENGINE = dict(block_size=16, num_blocks=32, max_num_seqs=2, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, GPTModel]:
    """The moe-tiny preset (8 experts, top-2) on the byte vocabulary, with a larger init so greedy outputs vary, its
    weights moved off their seeded initial values (so only a model that loaded them matches), saved weights-only."""
    model = GPTModel(preset("moe-tiny", vocab_size=259, init_method_std=0.2)).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    path = save_weights(model, ParallelState.initialize(), tmp_path_factory.mktemp("moe"))
    return path, model


def test_an_moe_checkpoint_loads_and_serves(moe_checkpoint: tuple[Path, GPTModel]) -> None:
    path, model = moe_checkpoint
    prompts = prompts_of_lengths(9, 26, seed=1)
    expected = [reference_greedy(model, p, 8) for p in prompts]
    llm = LLM(path, config=EngineConfig(**CKPT_ENGINE))
    served = llm.runner.model
    assert served.config.moe == model.config.moe and served.config.extra["preset"] == "moe-tiny"
    assert sum(isinstance(m, MoELayer) for m in served.modules()) == 2
    res = llm.generate(prompts, GREEDY)
    assert [r.outputs[0].token_ids for r in res] == expected


def _serve_tp(path: str, prompts: list[list[int]]) -> list[list[int]] | None:
    state = ParallelState.initialize(ParallelConfig(tp=2))
    llm = LLM(path, config=EngineConfig(**CKPT_ENGINE), tp=state.tp, device="cpu")
    experts: Any = llm.runner.model.decoder.layers["0"].mlp.experts
    assert experts.linear_fc2.weight.shape == (8, 64, 32)  # every expert, half of each one's 64 ffn columns
    if not llm.is_driver:
        llm.follow()
        return None
    out = [g.outputs[0].token_ids for g in llm.generate(prompts, GREEDY)]
    llm.shutdown()
    return out


def test_tp2_serves_the_checkpoint_with_each_expert_split(moe_checkpoint: tuple[Path, GPTModel]) -> None:
    """tp=2 without sequence parallelism: every expert's weights split over the two ranks (expert_tp = tp), loaded
    from the one-process checkpoint; the same greedy tokens as the plain model."""
    path, model = moe_checkpoint
    prompts = prompts_of_lengths(7, 19, seed=4)
    expected = [reference_greedy(model, p, 8) for p in prompts]
    results = run_distributed(_serve_tp, 2, str(path), prompts)
    assert results == [expected, None]


def test_the_openai_server_serves_an_moe_checkpoint(moe_checkpoint: tuple[Path, GPTModel]) -> None:
    """One completion request through the real ``openai`` client, in process (FastAPI's test client as its HTTP
    client): the greedy text of the plain model."""
    openai = pytest.importorskip("openai")
    from fastapi.testclient import TestClient

    from mcore_infer.async_engine import AsyncEngine
    from mcore_infer.server import build_app

    path, model = moe_checkpoint
    llm = LLM(path, config=EngineConfig(**CKPT_ENGINE))
    want = llm.tokenizer.decode(reference_greedy(model, llm.tokenizer.encode("Mixture"), 8))
    app = build_app(AsyncEngine(llm.engine), llm.tokenizer, "moe", shutdown_timeout=2.0)
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
        r = client.completions.create(
            model="moe", prompt="Mixture", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bf16_moe_serves_in_cuda_graphs_with_grouped_gemm(compiled: bool) -> None:
    """bf16 on the GPU: the experts run grouped_mm, nothing syncs, so decode steps are captured as CUDA graphs;
    their greedy tokens equal the same engine's without graphs, and (float32 loop path) the engine equals full
    recompute on the GPU."""
    prompts = prompts_of_lengths(5, 40, 17, 3, 33, seed=11)
    model = GPTModel(tiny_config(num_layers=2, params_dtype="bfloat16", moe=MoEConfig(**CASES["shared"])),
                     device="cuda").eval()  # fmt: skip
    assert graph_blockers(model) == []
    cfg = dict(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, compile=compiled)
    graphs = LLM(model=model, config=EngineConfig(**cfg))
    assert graphs.runner.graphs
    eager = LLM(model=model, config=EngineConfig(**cfg, cuda_graphs=False))
    a = [r.outputs[0].token_ids for r in graphs.generate(prompts, GREEDY)]
    b = [r.outputs[0].token_ids for r in eager.generate(prompts, GREEDY)]
    assert a == b
    fp32 = moe_model("shared").cuda()
    expected = [reference_greedy(fp32, p, 8) for p in prompts]
    llm = LLM(model=fp32, config=EngineConfig(**cfg))
    assert [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)] == expected
