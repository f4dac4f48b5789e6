"""Training metrics: the log record of a window of steps (throughput, model FLOPs, memory), and the sinks records go
to (JSONL, TensorBoard, W&B)."""

from __future__ import annotations

import json
import logging
import math
import resource
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mcore_models import TransformerConfig
from mcore_models.moe import moe_metrics
from mcore_parallel import ParallelState
from mcore_parallel.tensor.p2p import symmetric_bytes

if TYPE_CHECKING:
    from mcore_train.step import StepOutcome

__all__ = ["MetricsWindow", "MetricsWriter", "peak_tflops_for", "memory_stats", "moe_window_metrics"]

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


def moe_window_metrics(chunks: list[Any], model: TransformerConfig, state: ParallelState) -> dict[str, float]:
    """The routing of an MoE model's layers since the last call (the log window): per layer
    (``moe/layer<i>/aux_loss``, ``z_loss``, ``dropped``, ``load_min``, ``load_max``, from
    :func:`~mcore_models.moe.moe_metrics`) and over the layers (``moe_aux_loss``: the mean load-balancing loss,
    ``moe_load_max`` / ``moe_load_min``: the most and least loaded expert of any layer relative to an even split, and
    with a capacity ``moe_dropped``, with a z-loss ``moe_z_loss``: means). Every rank calls it at the same steps (one
    all-reduce over the world, then a host read); empty for a dense model."""
    if model.moe is None:
        return {}
    sp_size = state.tp.size if state.sequence_parallel else 1
    per_layer = moe_metrics(chunks, model.num_layers, model.moe.num_experts, state.world, sp_size)
    if not per_layer:
        return {}

    def values(name: str) -> list[float]:
        return [v for k, v in per_layer.items() if k.endswith(f"/{name}")]

    out = {"moe_aux_loss": sum(values("aux_loss")) / len(values("aux_loss")),
           "moe_load_max": max(values("load_max")), "moe_load_min": min(values("load_min"))}  # fmt: skip
    if model.moe.z_loss_coeff:
        out["moe_z_loss"] = sum(values("z_loss")) / len(values("z_loss"))
    if model.moe.capacity_factor is not None:
        out["moe_dropped"] = sum(values("dropped")) / len(values("dropped"))
    return {**out, **per_layer}


class _Clock(Protocol):
    def lap(self, end: Any) -> float: ...


class MetricsWindow:
    """The steps between two log lines: their losses, samples and tokens, and the time from the end of the step
    before the window to the end of its last step (``clock``, a :class:`~mcore_train.step.StepClock`). :meth:`close`
    makes the log record and starts the next window."""

    def __init__(self, clock: _Clock, *, flops_per_token: float, world_size: int, peak_tflops: float | None,
                 device: torch.device, flops_per_image: float = 0.0, image_scale: int = 1) -> None:  # fmt: skip
        """``flops_per_image``: model FLOPs of one image's tower and projector (a VLM), counted for the images of
        this rank's steps times ``image_scale`` (the data-parallel ranks, each reading as many batches)."""
        self.clock = clock
        self.flops_per_token = flops_per_token
        self.flops_per_image, self.image_scale = flops_per_image, image_scale
        self.world_size = world_size
        self.peak_tflops = peak_tflops
        self.device = device
        self._reset()

    def _reset(self) -> None:
        self.loss_sum = 0.0
        self.losses = 0  # the finite ones
        self.samples = 0
        self.tokens = 0
        self.steps = 0
        self.images = 0
        self.data_seconds = 0.0
        self.profiled = False

    def add(self, step: StepOutcome, profiled: bool = False) -> None:
        """One more step: its loss counts in the mean when finite, its samples and tokens always; ``profiled``: it ran
        under the profiler (the window's throughput is then not a measurement)."""
        if math.isfinite(step.loss):
            self.loss_sum += step.loss
            self.losses += 1
        self.samples += step.global_batch
        self.tokens += step.tokens
        self.steps += 1
        self.images += step.images
        self.data_seconds += step.data_seconds
        self.profiled = self.profiled or profiled

    def close(self, last: StepOutcome, skipped_steps: int) -> dict[str, Any]:
        """The record of the window ending with step ``last`` (whose LR, gradient norm, zero count and loss scale it
        reports), and a new, empty window from there."""
        elapsed = self.clock.lap(last.end)
        tok_s = self.tokens / elapsed
        flops = self.tokens * self.flops_per_token + self.images * self.image_scale * self.flops_per_image
        tflops = flops / elapsed / self.world_size / 1e12
        norm = last.grad_norm
        record: dict[str, Any] = {
            "loss": self.loss_sum / max(self.losses, 1),
            "lr": last.lr,
            "grad_norm": None if last.update is None or math.isnan(norm) else norm,
            "num_zeros": None if last.update is None else last.num_zeros,
            "loss_scale": last.loss_scale,
            "tokens_per_s": tok_s,
            "samples_per_s": self.samples / elapsed,
            "tflops_per_gpu": tflops,
            # the data loader's host time per step (rank 0), and its share of the window's time
            "data_ms_per_step": 1e3 * self.data_seconds / max(self.steps, 1),
            "data_share": self.data_seconds / elapsed,
            "global_batch_size": last.global_batch,
            "consumed_tokens": last.tokens_after,
            "skipped_steps": skipped_steps,
            **memory_stats(self.device),
            **last.moe,
        }
        if self.profiled:
            record["profiled"] = True  # its throughput includes the profiler's overhead: not a measurement
        if self.peak_tflops:
            record["mfu"] = tflops / self.peak_tflops
        self._reset()
        return record


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
