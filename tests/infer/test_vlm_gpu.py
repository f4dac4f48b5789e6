"""A LLaVA VLM served on the GPU (run through the device tool; skipped without CUDA + Triton): the engine's greedy
tokens with images (eager image steps, graphed decode, compiled layers) equal ``LlavaModel.forward``'s full
recompute on the same GPU, for one image cut across prefill chunks and for a tiled image's tiles."""

from __future__ import annotations

import pytest
import torch

from mcore_data.multimodal_torch import image_tiles
from mcore_data.tiling import Tiling
from mcore_infer import LLM, EngineConfig, SamplingParams
from mcore_infer._triton_attention import triton_available
from tests.infer._vlm import IMG, T, prompt, tiny_vlm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and Triton"),
]


@torch.no_grad()
def _reference(model: torch.nn.Module, ids: list[int], images: torch.Tensor, n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        logits = model(torch.tensor([ids + out], device="cuda"), images, gather_logits=True)
        out.append(int(logits[0, -1].argmax()))
    return out


@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_vlm_engine_matches_recompute(compiled: bool) -> None:
    model = tiny_vlm().cuda()
    llm = LLM(model=model, config=EngineConfig(block_size=16, num_blocks=64, max_num_batched_tokens=24,
                                               max_num_seqs=4, max_images=2, max_tiles=4, max_model_len=160,
                                               compile=compiled))  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tiles = image_tiles(torch.rand(3, 16, 40, generator=torch.Generator().manual_seed(3)), 16, Tiling(4))
    assert tiles.shape[0] == 4  # a 3 x 1 grid and the thumbnail
    cases = [
        (prompt(16, 9), torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))),  # cut at token 24
        (prompt(3, 5, images=2, seed=1), torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))),
        ([*prompt(2, 0, images=0), *([IMG] * T * 4), *prompt(6, 0, images=0, seed=4)], tiles),
    ]
    for ids, px in cases:
        px = px.cuda()
        rid = llm.engine.add_request(ids, params, images=px)
        done = {}
        while llm.engine.has_work():
            done.update({o.request_id: o.token_ids for o in llm.engine.step() if o.finished})
        assert done[rid] == _reference(model, ids, px, 8), len(ids)
    assert llm.runner.blocks.num_free == llm.runner.blocks.capacity
