"""LlavaModel under TP = 2 (gloo), with and without sequence parallelism, against one process: the loss and every
parameter's gradient (float64; the float32 loss to float32 rounding), with 2 images in a batch of 2 whose image tokens fall in both sequence chunks; and
weights-only checkpoints saved at TP 1 loaded at TP 2 and the reverse.

One distributed call runs the parity checks and one the checkpoint checks (process start-up dominates on two cores).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mcore_models.multimodal import LlavaModel, llava_preset
from mcore_models.multimodal.checkpoint import load_llava_weights, save_llava_weights
from mcore_parallel import Group, ParallelConfig, ParallelState, shard_info
from mcore_parallel.tensor import allreduce_sequence_parallel_grads
from mcore_parallel.testing import run_distributed

IMAGE, T, S = 255, 16, 48


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, IMAGE, (2, S), generator=gen)
    ids[0, 16:32] = IMAGE  # rank 1's half under SP (chunks of 24: the image straddles 24)
    ids[1, 2:18] = IMAGE  # rank 0's half
    images = torch.randn(2, 3, 16, 16, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, IMAGE, (2, S), generator=gen)
    return ids, images, labels


def _global_grad(name: str, param: torch.nn.Parameter) -> torch.Tensor:
    assert param.grad is not None, name
    info = shard_info(name, param.grad, Group.single(), like=param)
    full = torch.zeros(info.global_shape, dtype=param.grad.dtype)
    info.scatter_into(full)
    return full


def _parity(tp: Group, sp: bool, learned_positions: bool) -> None:
    language: dict[str, Any] = {}
    if learned_positions:
        language = dict(position_embedding="learned_absolute", normalization="layernorm", add_bias_linear=True,
                        activation="gelu")  # fmt: skip
    config = llava_preset("llava-tiny", language=language)
    ref = LlavaModel(config, tp=Group.single()).double()
    model = LlavaModel(config, tp=tp, sequence_parallel=sp).double()
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    qkv: Any = model.language.decoder.layers["0"].self_attention.linear_qkv.weight
    assert qkv.shape[0] == 128 // tp.size and model.ctx.sequence_parallel == sp  # really split
    ids, images, labels = _batch()
    # the loss is float32 (the cross-entropy's), so the two agree to float32 rounding
    with torch.no_grad():
        torch.testing.assert_close(model(ids, images, labels=labels), ref(ids, images, labels=labels), rtol=1e-6,
                                   atol=1e-6)  # fmt: skip
    # the gradients of a float64 objective of the logits agree to float64 rounding
    logits, ref_logits = model(ids, images, gather_logits=True), ref(ids, images, gather_logits=True)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-12)
    weights = torch.randn(ref_logits.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    (ref_logits * weights).sum().backward()
    (logits * weights).sum().backward()
    allreduce_sequence_parallel_grads(model, tp)
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        if not param.requires_grad:  # the tower's unused last layer and post-norm
            assert param.grad is None and ref_params[name].grad is None, name
            continue
        assert param.grad is not None, name
        expected = _global_grad(name, ref_params[name])
        info = shard_info(name, param.grad, tp, like=param)
        assert info.pieces, name
        for local_idx, global_idx in info.pieces:
            torch.testing.assert_close(param.grad[local_idx], expected[global_idx], rtol=1e-9, atol=1e-11,
                                       msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip


def _run_parity(tp_size: int) -> None:
    state = ParallelState.initialize(ParallelConfig(tp=tp_size))
    for sp, learned in ((False, False), (True, False), (True, True)):
        _parity(state.tp, sp, learned)


def test_llava_tp2_and_tp2_sp_match_one_process() -> None:
    run_distributed(_run_parity, 2, 2)


def _perturbed(model: LlavaModel) -> LlavaModel:
    """Weights unlike any seed's (so a load is seen), the same on every rank (a global tensor, then sharded)."""
    full = model.global_state_dict()
    gen = torch.Generator().manual_seed(9)
    model.load_global_state_dict({k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in sorted(full.items())})
    return model


def _run_checkpoints(tp1_dir: str, tp2_dir: str, expected: dict[str, torch.Tensor]) -> None:
    state = ParallelState.initialize(ParallelConfig(tp=2))
    config = llava_preset("llava-tiny")
    model = LlavaModel(config, tp=state.tp)
    load_llava_weights(model, tp1_dir)  # saved by one process
    got = model.global_state_dict()
    assert set(got) == set(expected)
    for key, tensor in got.items():
        torch.testing.assert_close(tensor, expected[key], rtol=0.0, atol=0.0, msg=key)
    save_llava_weights(_perturbed(LlavaModel(config, tp=state.tp)), state, tp2_dir)


def test_llava_checkpoint_loads_at_another_tp_size(tmp_path: Path) -> None:
    config = llava_preset("llava-tiny")
    one = _perturbed(LlavaModel(config))
    save_llava_weights(one, ParallelState.initialize(ParallelConfig()), tmp_path / "tp1")
    run_distributed(_run_checkpoints, 2, str(tmp_path / "tp1"), str(tmp_path / "tp2"), one.global_state_dict())
    loaded = LlavaModel(config)
    load_llava_weights(loaded, tmp_path / "tp2")  # saved at TP 2
    expected = _perturbed(LlavaModel(config)).global_state_dict()
    for key, tensor in loaded.global_state_dict().items():
        torch.testing.assert_close(tensor, expected[key], rtol=0.0, atol=0.0, msg=key)
