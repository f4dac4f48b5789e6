"""The engine with the Triton decode step of the Mamba layers (``mamba.decode_kernel``,
``mcore_models.ssm.decode_triton``): greedy tokens of a hybrid model equal those of the PyTorch decode step and of full
recompute. On the CPU under ``TRITON_INTERPRET=1`` (float32; the ``kernels`` nox session) and on the GPU with CUDA
graphs (float32 and bfloat16); skipped without either."""

from __future__ import annotations

import pytest
import torch

from mcore_infer import LLM, EngineConfig
from mcore_models.ssm.inference import uses_decode_kernel
from tests.infer._kernels import INTERPRETED
from tests.infer._tiny import prompts_of_lengths, reference_greedy, tiny_llm
from tests.infer.test_mamba import GREEDY, PROMPT_LENGTHS, mamba_model


def _mixer_uses_kernel(llm: LLM, dtype: torch.dtype) -> bool:
    mixer = llm.runner.model.decoder.layers["0"].mixer
    mamba = llm.runner.mamba
    assert mamba is not None
    x = torch.zeros(1, 1, dtype=dtype, device=mamba.ssm[0].device)
    return uses_decode_kernel(mixer, x, mamba.ssm[0])


@pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1 and Triton")
def test_interpreted_kernel_serves_like_full_recompute() -> None:
    """decode_kernel=triton on the CPU: decode steps (and the one-token requests of mixed steps) run the kernels."""
    prompts = prompts_of_lengths(*PROMPT_LENGTHS, seed=11)
    model = mamba_model("hybrid", mamba=dict(decode_kernel="triton"))
    llm = tiny_llm(model)
    assert _mixer_uses_kernel(llm, torch.float32)
    got = [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]
    assert got == [reference_greedy(model, p, 8) for p in prompts]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_with_the_kernel_gives_the_pytorch_steps_tokens(dtype: str) -> None:
    """CUDA-graph decode (padded rows on the scratch slot) with the kernels (``auto``, the default) against the same
    engine with ``decode_kernel=torch``: equal greedy tokens; in float32 both equal full recompute on the GPU."""
    prompts = prompts_of_lengths(*PROMPT_LENGTHS, seed=11)
    cfg = dict(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, cuda_graphs=True)
    tokens = {}
    for choice in ("auto", "torch"):
        model = mamba_model("hybrid", params_dtype=dtype, mamba=dict(decode_kernel=choice)).cuda()
        llm = LLM(model=model, config=EngineConfig(**cfg))
        assert llm.runner.graphs and _mixer_uses_kernel(llm, model.config.dtype) == (choice == "auto")
        tokens[choice] = [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]
    assert tokens["auto"] == tokens["torch"]
    if dtype == "float32":
        assert tokens["auto"] == [reference_greedy(model, p, 8) for p in prompts]
