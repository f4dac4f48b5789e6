"""Training metrics: throughput and model FLOPs, and the sinks they go to (console, JSONL, TensorBoard, W&B)."""

from __future__ import annotations

import json
import logging
import resource
from pathlib import Path
from typing import Any

import torch

from mcore_parallel.tensor.p2p import symmetric_bytes

__all__ = ["MetricsWriter", "peak_tflops_for", "memory_stats"]

logger = logging.getLogger(__name__)

# Dense bf16 tensor-core peaks (vendor figures, TFLOP/s), used for MFU when logging.peak_tflops is not set.
_PEAKS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def peak_tflops_for(device: torch.device, configured: float | None) -> float | None:
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAKS.items() if k in name), None)


def memory_stats(device: torch.device) -> dict[str, float]:
    """GPU: allocated and peak bytes, counting the symmetric buffers of the p2p exchanges (allocated once, outside
    PyTorch's caching allocator) in both and on their own; CPU: peak resident set."""
    if device.type == "cuda":
        symmetric = symmetric_bytes(device)
        stats = {
            "mem_allocated_gib": (torch.cuda.memory_allocated(device) + symmetric) / 2**30,
            "mem_peak_gib": (torch.cuda.max_memory_allocated(device) + symmetric) / 2**30,
        }
        if symmetric:
            stats["mem_symmetric_gib"] = symmetric / 2**30
        return stats
    return {"mem_rss_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


class MetricsWriter:
    """Writes one record per logged step to metrics.jsonl, TensorBoard and W&B (whichever are enabled)."""

    def __init__(self, directory: str | Path | None, *, jsonl: bool, tensorboard: bool, wandb_project: str | None,
                 config: dict[str, Any]) -> None:  # fmt: skip
        self.jsonl = None
        self.tb: Any = None
        self.wandb: Any = None
        if directory is not None:
            path = Path(directory)
            path.mkdir(parents=True, exist_ok=True)
            if jsonl:
                self.jsonl = open(path / "metrics.jsonl", "a")  # noqa: SIM115 - kept open for the run
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError:
                    raise ImportError("TensorBoard logging needs: pip install mcore-train[tensorboard]") from None
                self.tb = SummaryWriter(str(path / "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise ImportError("Weights & Biases logging needs: pip install mcore-train[wandb]") from None
            self.wandb = wandb.init(project=wandb_project, config=config)

    def write(self, step: int, record: dict[str, Any]) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **record}) + "\n")
            self.jsonl.flush()
        numeric = {k: v for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        if self.tb is not None:
            for k, v in numeric.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(numeric, step=step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
