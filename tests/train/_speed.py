"""One training run with counters of what the speed switches did, for the speed-switch matrices (CPU and GPU).

:func:`train` runs ``pretrain`` on the tiny test model and returns, from every rank, how many weight gradients went
straight into ``main_grad``, how many recomputed regions ran and how many layers were compiled; rank 0 also returns the
logged loss and gradient norm of every step. :func:`assert_trains_like` compares two runs step by step.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from mcore_train import pretrain
from tests.train._util import config

KEYS = ("loss", "grad_norm")

OFF = ["training.compile=none", "parallel.gradient_accumulation_fusion=false", "model.defer_residual_add=false"]
"""The defaulting switches off: the plain path every case is compared with."""

FAST = ["training.compile=layers", "parallel.gradient_accumulation_fusion=true"]
"""What ``auto`` turns on on CUDA."""


def train(overrides: list[str], recipe: str = "tiny") -> dict[str, Any]:
    from mcore_models.transformer.context import ModelContext
    from mcore_parallel.tensor import mappings
    from mcore_train import trainer

    counts = {"fused": 0, "recomputed": 0, "compiled": 0}
    real_wgrad, real_recompute, real_compile = mappings.weight_grad, ModelContext.recompute, trainer.compile_layers

    def wgrad(weight: torch.Tensor, g2: torch.Tensor, x2: torch.Tensor, fuse: bool) -> torch.Tensor:
        counts["fused"] += int(fuse)
        return real_wgrad(weight, g2, x2, fuse)

    def recompute(self: Any, fn: Any, *args: Any) -> torch.Tensor:
        counts["recomputed"] += 1
        return real_recompute(self, fn, *args)

    def compile_layers(chunks: list[Any], mode: str | None = None) -> None:
        counts["compiled"] += sum(len(c.decoder.layers) for c in chunks)
        real_compile(chunks, mode)

    mappings.weight_grad = wgrad  # type: ignore[assignment]
    ModelContext.recompute = recompute  # type: ignore[method-assign]
    trainer.compile_layers = compile_layers  # type: ignore[assignment]
    try:
        with tempfile.TemporaryDirectory() as log_dir:
            if recipe == "tiny":
                cfg = config(*overrides, f"logging.dir={log_dir}")
            else:
                cfg = (_llama if recipe == "llama-1b" else _moe)(overrides, log_dir)
            result = pretrain(cfg)
            out: dict[str, Any] = dict(counts)
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                lines = [json.loads(line) for line in (Path(log_dir) / "metrics.jsonl").read_text().splitlines()]
                out["records"] = [{k: r.get(k) for k in KEYS} for r in lines if "loss" in r]
                assert [r["loss"] for r in out["records"]] == result.losses
            return out
    finally:
        mappings.weight_grad = real_wgrad  # type: ignore[assignment]
        ModelContext.recompute = real_recompute  # type: ignore[method-assign]
        trainer.compile_layers = real_compile  # type: ignore[assignment]


LLAMA_1B_SHAPE = [
    "data.mock=true",
    "data.tokenizer=byte",
    "data.seq_length=2048",
    "model.num_layers=2",
    "training.micro_batch_size=1",
    "training.global_batch_size=2",
    "training.train_iters=3",
    "training.eval_iters=0",
    "scheduler.warmup_iters=1",
    "optimizer.lr=1e-3",
    "checkpoint.async_save=false",
    "logging.progress_bar=false",
    "logging.log_interval=1",
]
"""llama-1b's layers (bf16, hidden 2048, its vocabulary) cut to 2 layers and 2 micro-batches of 2048 tokens."""


def _llama(overrides: list[str], log_dir: str) -> Any:
    from mcore_train import load_config

    return load_config(recipe="llama-1b", overrides=[*LLAMA_1B_SHAPE, *overrides, f"logging.dir={log_dir}"])


def _moe(overrides: list[str], log_dir: str) -> Any:
    from tests.train.test_moe import moe_config

    return moe_config(*overrides, f"logging.dir={log_dir}")


def totals(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The counters summed over ranks, with rank 0's records."""
    out = {k: sum(r[k] for r in per_rank) for k in ("fused", "recomputed", "compiled")}
    return {**out, "records": per_rank[0]["records"]}


def assert_trains_like(got: dict[str, Any], want: dict[str, Any], label: str, rel: float = 1e-5,
                       abs_: float = 1e-6) -> None:  # fmt: skip
    """Per step, the loss and the gradient norm of ``got`` within ``rel``/``abs_`` of ``want``'s."""
    a, b = got["records"], want["records"]
    assert len(a) == len(b) and len(b) >= 2 and b[0]["loss"] != b[-1]["loss"], (label, a, b)
    for step, (x, y) in enumerate(zip(a, b, strict=True), 1):
        for key in KEYS:
            assert x[key] == pytest.approx(y[key], rel=rel, abs=abs_), (label, step, key, x[key], y[key])


def assert_switches_ran(got: dict[str, Any], overrides: list[str], label: str) -> None:
    """Each switch the overrides turn on did something (a switch that silently stays off would match trivially)."""
    on = set(overrides)
    if "parallel.gradient_accumulation_fusion=true" in on:
        assert got["fused"] > 0, (label, "no weight gradient went into main_grad")
    if "training.compile=layers" in on:
        assert got["compiled"] > 0, (label, "no layer compiled")
    if any(o.startswith("model.recompute=") and o != "model.recompute=none" for o in on):
        assert got["recomputed"] > 0, (label, "nothing recomputed")
