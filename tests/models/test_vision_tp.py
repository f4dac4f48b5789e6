"""VisionEncoder under TP = 2 (gloo) against one process: outputs and every parameter gradient, for a CLIP- and a
SigLIP-shaped tower; and an HF CLIP tower's weights loaded straight into a TP = 2 encoder.

One distributed call runs all three checks (the suite runs on two cores: process start-up dominates). TP = 4 is the
same code path with more ranks and is left out for time.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_models.hf_vision import vision_config_from_hf, vision_hf_to_mcore
from mcore_models.vision import VisionEncoder, vision_preset
from mcore_parallel import Group, ParallelConfig, ParallelState, shard_info
from mcore_parallel.testing import run_distributed


def _tp_matches_one_process(kind: str, tp: Group) -> None:
    config = vision_preset(f"tiny-{kind}", num_attention_heads=4, ffn_hidden_size=64, vision_feature_layer=-1)
    ref = VisionEncoder(config, tp=Group.single())
    model = VisionEncoder(config, tp=tp)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    first: Any = model.decoder.layers["0"]
    qkv = first.self_attention.linear_qkv.weight
    assert qkv.shape[0] == 3 * config.hidden_size // tp.size  # the heads really are split
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    outs = []
    for m in (model, ref):
        hidden = m(x)
        assert m.post_layernorm is not None
        outs.append((hidden, m.post_layernorm(hidden)))  # the post-norm too, so it gets a gradient
    (out, out_post), (ref_out, ref_post) = outs
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    weights = torch.linspace(0.5, 1.5, out.numel()).view_as(out)
    ((out + out_post) * weights).sum().backward()
    ((ref_out + ref_post) * weights).sum().backward()
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        ref_grad = ref_params[name].grad
        assert ref_grad is not None, name
        for local_idx, global_idx in shard_info(name, param, tp).pieces:
            torch.testing.assert_close(param.grad[local_idx], ref_grad[global_idx], rtol=1e-4, atol=1e-5, msg=name)


def _hf_into_tp(tp: Group, hf_config: dict[str, Any], hf_state: dict[str, torch.Tensor], x: torch.Tensor,
                expected: torch.Tensor) -> None:  # fmt: skip
    config = vision_config_from_hf(hf_config)
    enc = VisionEncoder(config, tp=tp)
    enc.load_global_state_dict(dict(vision_hf_to_mcore(config, hf_state.__getitem__)))
    enc = enc.double().eval()
    with torch.no_grad():
        torch.testing.assert_close(enc.last_hidden_state(x), expected, rtol=0.0, atol=1e-12)


def _run(tp_size: int, hf_case: tuple[Any, ...]) -> None:
    state = ParallelState.initialize(ParallelConfig(tp=tp_size))
    for kind in ("clip", "siglip"):
        _tp_matches_one_process(kind, state.tp)
    _hf_into_tp(state.tp, *hf_case)


def test_vision_tp2_matches_one_process_and_hf() -> None:
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                              num_attention_heads=4, image_size=16, patch_size=4)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.CLIPVisionModel(hf_config).double().eval()
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        expected = hf(x).last_hidden_state
    # the ranks get the HF weights and reference output from here (no transformers import in the workers)
    run_distributed(_run, 2, 2, (hf_config.to_dict(), dict(hf.state_dict()), x, expected))
