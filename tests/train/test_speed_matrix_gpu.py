"""The speed-switch matrix on GPUs: what only CUDA runs (``auto`` resolving to compiled layers and the fused weight
gradient, inductor's GPU kernels, the float32-output GEMM of the fusion, the Triton SwiGLU and RoPE kernels, the
cuDNN / flash / efficient attention backends, the tp and dp exchanges over GPU symmetric memory) against every
recompute mode, the tp / SP / pp / dp layouts and the distributed optimizer. Each case equals the run with every
switch off on one GPU (float32 within 1e-4; bf16 at llama-1b's width within bf16 rounding). The CPU half is
``tests/train/test_speed_matrix.py``. Run through the device tool; skipped without CUDA (the layouts without 2 GPUs).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mcore_parallel.testing import run_distributed
from tests.train._speed import OFF, assert_switches_ran, assert_trains_like, totals, train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

CUDA = ["training.train_iters=3", "training.device=cuda"]
PLAIN = [*OFF, "model.swiglu_backward=torch", "model.rope_kernel=torch", "model.attention_backend=math"]
"""Every speed switch off: the reference of every case."""
RECOMPUTE = {
    "none": ["model.recompute=none"],
    "selective": ["model.recompute=selective"],
    "full": ["model.recompute=full"],
    "full-2-layers": ["model.recompute=full", "model.recompute_num_layers=2"],
    "selective-mlp": ["model.recompute=selective", "model.recompute_modules=[core_attn,mlp]"],
}
BF16 = dict(rel=2e-2, abs_=2e-2)


def _assert_auto_ran(got: dict[str, Any], label: str) -> None:
    """``auto`` on CUDA compiled the layers and fused the weight gradients."""
    assert got["compiled"] > 0 and got["fused"] > 0, (label, got)


@pytest.fixture(scope="module")
def plain() -> dict[str, Any]:
    return train([*CUDA, *PLAIN])


@pytest.fixture(scope="module")
def plain_bf16() -> dict[str, Any]:
    return train(PLAIN, recipe="llama-1b")


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
def test_the_cuda_defaults_train_like_the_plain_path(recompute: str, plain: dict[str, Any]) -> None:
    """Nothing set: auto (compiled layers, the fused weight gradient) with the Triton kernels, float32."""
    got = train([*CUDA, *RECOMPUTE[recompute]])
    _assert_auto_ran(got, recompute)
    assert_switches_ran(got, RECOMPUTE[recompute], recompute)
    assert_trains_like(got, plain, recompute, rel=1e-4, abs_=1e-5)


BF16_CASES: dict[str, list[str]] = {
    **{f"defaults-{name}": r for name, r in RECOMPUTE.items() if name != "full-2-layers"},
    **{f"{b}-full": [f"model.attention_backend={b}", "model.recompute=full"] for b in ("flash", "cudnn", "efficient")},
    "ce-fusion-contiguous-full": [
        "model.cross_entropy_fusion=true",
        "model.attention_contiguous=true",
        "model.recompute=full",
    ],
    "eager-fusion-full": [
        "training.compile=none",
        "parallel.gradient_accumulation_fusion=true",
        "model.recompute=full",
    ],
}


@pytest.mark.parametrize("name", list(BF16_CASES))
def test_bf16_at_llama_1b_width(name: str, plain_bf16: dict[str, Any]) -> None:
    """llama-1b's layers in bf16 (the fusion's float32-output GEMM, the attention backends' bf16 kernels)."""
    got = train(BF16_CASES[name], recipe="llama-1b")
    if "training.compile=none" not in BF16_CASES[name]:
        _assert_auto_ran(got, name)
    assert_switches_ran(got, BF16_CASES[name], name)
    assert_trains_like(got, plain_bf16, name, **BF16)


TP2_SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
DISTOPT = ["optimizer.use_distributed_optimizer=true"]
LAYOUTS: dict[str, list[str]] = {
    "tp2-sp-auto-full": [*TP2_SP, "model.recompute=full"],  # tp_comm=auto: mcore's p2p exchange at tp2
    "tp2-sp-auto-selective": [*TP2_SP, "model.recompute=selective"],
    "tp2-sp-symmetric-memory-full": [*TP2_SP, "parallel.tp_comm=symmetric_memory", "model.recompute=full"],
    "tp2-sp-nccl-full": [*TP2_SP, "parallel.tp_comm=nccl", "model.recompute=full"],
    "tp2-nosp-full": ["parallel.tp=2", "model.recompute=full"],
    "pp2-full": ["parallel.pp=2", "model.recompute=full"],
    "pp2-vpp2-selective": ["parallel.pp=2", "parallel.vpp=2", "model.recompute=selective"],
    "dp2-distopt-auto-full": [*DISTOPT, "model.recompute=full"],  # dp_comm=auto: p2p at dp2
    "dp2-distopt-nccl-full": [*DISTOPT, "parallel.dp_comm=nccl", "model.recompute=full"],
    "dp2-allreduce-none": ["model.recompute=none"],
}


@TWO_GPUS
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_on_two_gpus(name: str, plain: dict[str, Any]) -> None:
    got = totals(run_distributed(train, 2, [*CUDA, *LAYOUTS[name]], backend="nccl", timeout=600))
    _assert_auto_ran(got, name)
    assert_switches_ran(got, LAYOUTS[name], name)
    assert_trains_like(got, plain, name, rel=1e-4, abs_=1e-5)


def test_the_reported_crash_at_its_length() -> None:
    """The reported command's switches (bf16, compiled layers, the fusion, full recompute) at sequence 65536: it failed
    in the first backward with ``'Tensor' object has no attribute 'main_grad'``."""
    overrides = ["data.seq_length=65536", "training.train_iters=2", "model.recompute=full", "training.compile=layers",
                 "parallel.gradient_accumulation_fusion=true"]  # fmt: skip
    got = train(overrides, recipe="llama-1b")
    assert got["fused"] > 0 and got["recomputed"] > 0
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in got["records"])
