"""Every speed switch with a CPU path against every recompute mode, the tp / SP / pp / vpp / dp layouts and the
distributed optimizer, through the real training loop (CPU, gloo, float32, the tiny model, 3 steps): each case's
loss and gradient norm per step equal the single-process run with every switch off, and each switch it turns on
did run (weight gradients into ``main_grad``, compiled layers, recomputed regions).

The switches: ``training.compile=layers`` and ``parallel.gradient_accumulation_fusion=true`` (what ``auto`` turns on
on CUDA), ``model.cross_entropy_fusion``, ``model.attention_contiguous``, ``model.defer_residual_add``,
``parallel.tp_comm=p2p`` and ``parallel.dp_comm=p2p`` (mcore's exchanges, on CPU through shared memory). The CUDA-only
ones (the Triton SwiGLU and RoPE kernels, the cuDNN/flash attention backends, the float32-output GEMM of the fusion,
inductor's GPU kernels, the exchanges over GPU symmetric memory) are ``tests/train/test_speed_matrix_gpu.py``'s. The
layouts share one world of 2 ranks (a pool kept between cases, so compiled graphs are reused) and one of 4.
"""

from __future__ import annotations

from typing import Any

import pytest

from mcore_parallel.testing import run_distributed
from tests.train._speed import FAST, OFF, assert_switches_ran, assert_trains_like, totals, train

STEPS = ["training.train_iters=3", "training.device=cpu"]
RECOMPUTE = {
    "none": ["model.recompute=none"],
    "selective": ["model.recompute=selective"],
    "full": ["model.recompute=full"],
    "full-2-layers": ["model.recompute=full", "model.recompute_num_layers=2"],
    "selective-mlp": ["model.recompute=selective", "model.recompute_modules=[mlp]"],
}
SWITCHES = {
    "fast": FAST,  # the CUDA defaults together
    "fusion": ["training.compile=none", "parallel.gradient_accumulation_fusion=true"],
    "compile": ["training.compile=layers", "parallel.gradient_accumulation_fusion=false"],
    "all": [
        *FAST,
        "model.cross_entropy_fusion=true",
        "model.attention_contiguous=true",
        "model.defer_residual_add=true",
    ],
}

# one process: every switch set x every recompute mode (recompute of some layers, and of the MLPs, only with the CUDA
# defaults)
SINGLE = [(s, r) for s in SWITCHES for r in RECOMPUTE if r not in ("full-2-layers", "selective-mlp") or s == "fast"]

# the layouts, each with the CUDA defaults on and a recompute mode (every layout meets full recompute, the mode that
# crashed with the fusion, or selective); world size first
TP2_SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
DISTOPT = ["optimizer.use_distributed_optimizer=true"]
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "tp2-full": (2, ["parallel.tp=2", "model.recompute=full"]),
    "tp2-sp-full": (2, [*TP2_SP, "model.recompute=full"]),
    "tp2-sp-selective-mlp": (2, [*TP2_SP, "model.recompute=selective", "model.recompute_modules=[core_attn,mlp]"]),
    "tp2-sp-p2p-selective": (
        2,
        [
            *TP2_SP,
            "parallel.tp_comm=p2p",
            "model.recompute=selective",
            "model.cross_entropy_fusion=true",
            "model.defer_residual_add=true",
        ],
    ),
    "pp2-full": (2, ["parallel.pp=2", "model.recompute=full"]),
    "pp2-vpp2-selective-untied": (
        2,
        [
            "parallel.pp=2",
            "parallel.vpp=2",
            "model.recompute=selective",
            "model.share_embeddings_and_output_weights=false",
            "model.defer_residual_add=true",
        ],
    ),
    "dp2-distopt-full": (2, [*DISTOPT, "model.recompute=full"]),
    "dp2-distopt-p2p-selective": (2, [*DISTOPT, "parallel.dp_comm=p2p", "model.recompute=selective"]),
    "dp2-buckets-none": (2, ["parallel.bucket_size=1000", "model.recompute=none"]),
    "tp2-sp-dp2-distopt-full": (4, [*TP2_SP, *DISTOPT, "model.recompute=full"]),
}


def _untied(overrides: list[str]) -> bool:
    return "model.share_embeddings_and_output_weights=false" in overrides


@pytest.fixture(scope="module")
def plain() -> dict[bool, dict[str, Any]]:
    """The single-process runs with every switch off and no recompute (tied and untied output layer)."""
    untied = ["model.share_embeddings_and_output_weights=false"]
    return {tied: train([*STEPS, *OFF, *([] if tied else untied)]) for tied in (True, False)}


@pytest.mark.parametrize(("switches", "recompute"), SINGLE, ids=[f"{s}-{r}" for s, r in SINGLE])
def test_one_process(switches: str, recompute: str, plain: dict[bool, dict[str, Any]]) -> None:
    overrides = [*STEPS, *SWITCHES[switches], *RECOMPUTE[recompute]]
    got = train(overrides)
    assert_switches_ran(got, overrides, f"{switches}-{recompute}")
    assert_trains_like(got, plain[True], f"{switches}-{recompute}")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts(name: str, plain: dict[bool, dict[str, Any]]) -> None:
    world, layout = LAYOUTS[name]
    overrides = [*STEPS, *FAST, *layout]
    got = totals(run_distributed(train, world, overrides, timeout=300))
    assert_switches_ran(got, overrides, name)
    assert_trains_like(got, plain[not _untied(layout)], name)


def test_moe_with_fusion_and_full_recompute() -> None:
    """MoE layers (moe-tiny, one process): ``auto`` on CUDA keeps compile off for them (aux losses) but fuses the
    dense linears' weight gradients; with full recompute too."""
    base = ["training.train_iters=3", "training.compile=none"]
    want = train([*base, "parallel.gradient_accumulation_fusion=false"], recipe="moe")
    overrides = [*base, "parallel.gradient_accumulation_fusion=true", "model.recompute=full"]
    got = train(overrides, recipe="moe")
    assert_switches_ran(got, overrides, "moe")
    assert_trains_like(got, want, "moe")
