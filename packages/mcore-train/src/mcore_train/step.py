"""One training step: :func:`train_step` runs a whole optimizer step and returns its :class:`StepOutcome`.

A step is the learning rate from the schedule, the forward and backward passes over the step's micro-batches
(through the pipeline schedule, the gradient reduction overlapped with backward; FP8 layers' weight casts cached for
the step and their delayed scaling rolled after it, :func:`mcore_parallel.fp8.fp8_step`; MoE layers' auxiliary
losses scaled like the main loss, and their expert biases moved after the backward), one small all-reduce in which
the ranks agree on the loss and on whether to stop, then clipping and the update. When the optimizer can drop a
non-finite step on the device (AdamW's fused kernel without fp16 loss scaling, the default on GPUs) nothing in it
waits for the device: the loss, stop votes, skip flag, gradient norm and zero count are copied to pinned host memory
behind the step's work and read only when the outcome is first asked for them. Otherwise the loss is read before the
update, which is skipped on the host when it is not finite.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mcore_models.moe import set_aux_loss_scale, update_expert_biases
from mcore_parallel import Group
from mcore_parallel.ddp import DistributedDataParallel
from mcore_parallel.fp8 import fp8_step
from mcore_parallel.optim import StepResult
from mcore_parallel.pipeline import forward_backward
from mcore_train.context_parallel import cp_forward_step
from mcore_train.trainer import Run

__all__ = ["StepOutcome", "StepClock", "train_step", "deferred_reads"]


def _forward_step(data_iterator: Any, chunk: Any, cp: Group | None = None) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    if cp is not None and cp.size > 1:  # this rank's chunks of the sequences (mcore_train.context_parallel)
        return cp_forward_step(batch, chunk, cp)
    model = chunk.module if isinstance(chunk, DistributedDataParallel) else chunk
    tokens = batch["tokens"] if model.pre_process else None
    labels = batch["labels"] if model.post_process else None
    if "pixels" in batch:  # a vision-language model: the images and where their tokens go, on the first stage
        first = model.pre_process
        output = chunk(tokens, batch["pixels"] if first else None, None, labels,
                       image_positions=batch["image_mask"] if first else None)  # fmt: skip
    elif "document_ids" in batch:  # packed sequences (data.packing): attention and positions per document
        output = chunk(tokens, batch["position_ids"], labels=labels, document_ids=batch["document_ids"])
    else:
        output = chunk(tokens, None, labels=labels)

    def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = batch["loss_mask"]
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
        return loss, {"loss": loss.detach()}

    return output, loss_func


def _global_batch_size(run: Run) -> int:
    tr = run.config.training
    if not tr.rampup_batch_size:
        return tr.global_batch_size
    start, increment, ramp_samples = tr.rampup_batch_size
    steps = max(1, (tr.global_batch_size - start) // increment)
    per_increment = ramp_samples / steps
    return min(tr.global_batch_size, start + int(run.consumed_samples // per_increment) * increment)


def _agree_start(run: Run, loss: torch.Tensor | float | None, stop: bool) -> torch.Tensor:
    """``[loss sum over the ranks that report it, number of ranks that want to stop]`` (float64, on the device): one
    all-reduce, enqueued without waiting for it (:func:`_agree_values` turns it into host values)."""
    st = run.state
    # filled on the device: torch.tensor(..., device="cuda") would copy from pageable memory and wait for the GPU
    t = torch.zeros(2, dtype=torch.float64, device=st.device)
    if stop:
        t[1] = 1.0
    if loss is not None and st.is_last_stage and st.tp.rank == 0:
        t[0] = loss
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)  # one collective: the loss sum, and how many ranks want to stop
    return t


def _agree_values(loss_sum: float, stops: float, dp_size: int, cp_size: int) -> tuple[float, bool]:
    """(mean loss over data-parallel ranks, whether any rank wants to stop), identical on every rank."""
    return loss_sum / dp_size / cp_size, stops > 0


def _schedule_loss(run: Run, iterators: list[Any], num_micro: int, forward_only: bool) -> torch.Tensor | None:
    """Run the schedule; the mean loss over its micro-batches as a device scalar (None on ranks that compute none)."""
    cfg = run.config
    reported = forward_backward(
        functools.partial(_forward_step, cp=run.state.cp), iterators, list[Any](run.ddp), num_micro,
        cfg.data.seq_length // run.state.cp.size, cfg.training.micro_batch_size,
        run.model_config.hidden_size, run.state, run.model_config.dtype, forward_only,
        grad_scale_func=None if forward_only else run.optimizer.scale_loss,
    )  # fmt: skip
    if not reported:
        return None
    return torch.stack([r["loss"].float() for r in reported]).mean()


def eval_loss(run: Run, iterators: list[Any], num_micro: int) -> float:
    """The loss of one forward-only global batch, agreed over the ranks (read on the host)."""
    with fp8_step(run.chunks, update_scaling=False):  # FP8 weights cast once for the batch
        loss = _schedule_loss(run, iterators, num_micro, True)
    loss_sum, stops = _agree_start(run, 0.0 if loss is None else float(loss.item()), False).tolist()
    return _agree_values(loss_sum, stops, run.state.dp_size, run.state.cp.size)[0]


def _timed_on_device(device: torch.device) -> bool:
    """Whether logging windows are timed by events on the device's stream (CUDA) rather than the host's clock."""
    return device.type == "cuda"


def _mark_end() -> Any:
    """A CUDA timing event recorded after the work enqueued so far (the end of a step on the device's timeline)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class StepClock:
    """Seconds between the ends of steps: from the end of the step that closed the previous window (or the clock's
    creation) to the end of a window's last step.

    The deferred loop reads a step's values after it has enqueued the next step, and enqueuing can block (a full
    launch queue) until the device is well into that next step, so the host's clock at the read can lie anywhere
    inside the following step, and a window timed by it misses up to a step of device time (measured: 662 TFLOP/s
    reported for a step whose kernels alone took 3.39 s, i.e. 545). On CUDA a window is therefore the time between
    two timing events that end steps on the device's stream (idle gaps and evaluations inside the window included);
    elsewhere the host clock when the step's values are read (the host waited for them).
    """

    def __init__(self, device: torch.device) -> None:
        self.start: Any = _mark_end() if _timed_on_device(device) else time.perf_counter()

    def lap(self, end: Any) -> float:
        """Seconds from the window's start to ``end`` (a step's end event on CUDA; None elsewhere: now on the host's
        clock); the next window starts there."""
        if end is None:
            end = time.perf_counter()
            seconds = end - self.start
        else:
            end.synchronize()
            seconds = self.start.elapsed_time(end) / 1e3
        self.start = end
        return seconds


def _read_host(values: torch.Tensor, ready: Any) -> list[float]:
    """A step's values on the host: waits for their copy only (``ready``), not for the work enqueued after it."""
    if ready is not None:
        ready.synchronize()
    return values.tolist()


@dataclass(eq=False)
class StepOutcome:
    """One optimizer step. The values the device computes (:attr:`loss`, :attr:`stop_requested`, :attr:`skipped`,
    :attr:`grad_norm`, :attr:`num_zeros`) are read on first use, which waits for this step's few values only; until
    then the step may still be running."""

    step: int
    """The step's number (1-based)."""
    lr: float
    """Its learning rate."""
    global_batch: int
    """Its samples (the global batch size, which a ramp-up changes)."""
    tokens: int
    """Its tokens (samples x sequence length)."""
    samples_before: int
    """Consumed samples when it began."""
    tokens_after: int
    """Consumed tokens when it ended."""
    logged: bool
    """Whether the step is logged (its zeros are counted, and without deferred reads its gradient norm read)."""
    update: StepResult | None = field(repr=False)
    """The optimizer's result (None when the host skipped the update)."""
    end: Any = field(repr=False)
    """A CUDA timing event after the step's last work (None off CUDA): where its time ends."""
    values: torch.Tensor = field(repr=False)
    """[loss sum, stop votes, skipped, grad norm, zeros] (nan: not computed), on the host or on its way there."""
    ready: Any = field(repr=False)
    """A CUDA event after the copy of ``values`` to the host (None when they are there already)."""
    dp_size: int = 1
    """Data-parallel ranks the loss sum is over (each context-parallel rank reports its part)."""
    cp_size: int = 1
    """Context-parallel ranks."""
    data_seconds: float = 0.0
    """Host seconds this rank spent getting the step's micro-batches from the data iterators (the data loader's
    time in the step: decoding, collating, waiting for workers)."""
    images: int = 0
    """Images (tiles) in this rank's micro-batches of the step."""
    moe: dict[str, float] = field(default_factory=dict)
    """MoE models, on logged steps: the routing metrics of the log window
    (:func:`~mcore_train.metrics.moe_window_metrics`, filled in by the loop)."""

    @functools.cached_property
    def _host(self) -> tuple[float, bool, bool, float, float]:
        loss_sum, stops, skipped, norm, zeros = _read_host(self.values, self.ready)
        loss, stop = _agree_values(loss_sum, stops, self.dp_size, self.cp_size)
        return loss, stop, bool(skipped), norm, zeros

    @property
    def loss(self) -> float:
        """The mean loss over the data-parallel ranks (the same on every rank; nan or inf when it diverged)."""
        return self._host[0]

    @property
    def stop_requested(self) -> bool:
        """Whether any rank asked to stop during the step (a signal, the time limit)."""
        return self._host[1]

    @property
    def skipped(self) -> bool:
        """Whether the update was dropped (a non-finite loss or gradient norm, or an fp16 overflow)."""
        return self._host[2]

    @property
    def grad_norm(self) -> float:
        """The global gradient norm before clipping (nan when not computed: a step that is not logged without deferred
        reads, or one the host skipped)."""
        return self._host[3]

    @property
    def num_zeros(self) -> int | None:
        """Zero gradient elements (None when not counted)."""
        zeros = self._host[4]
        return None if math.isnan(zeros) else int(zeros)

    @property
    def loss_scale(self) -> float | None:
        """The fp16 loss scale the step used (None without fp16 or when the host skipped the update)."""
        return None if self.update is None else self.update.loss_scale


def deferred_reads(run: Run) -> bool:
    """Whether :func:`train_step` leaves its values on their way to the host (the optimizer drops non-finite steps
    on the device and ``training.read_loss_every_step`` is off) instead of reading the loss before the update."""
    return run.optimizer.skips_on_device and not run.config.training.read_loss_every_step


def _launch_readback(t: torch.Tensor, result: StepResult) -> tuple[torch.Tensor, Any]:
    """Copy the step's agreed values, skip flag, gradient norm and zero count (nan when not counted) to the host
    without waiting for them."""
    assert result.skipped is not None and result.grad_norm_tensor is not None  # the device-side skip computes both
    zeros = result.num_zeros_tensor
    zeros = torch.full_like(t[:1], math.nan) if zeros is None else zeros.double().reshape(1)
    values = torch.cat([t, result.skipped.double().reshape(1), result.grad_norm_tensor.double().reshape(1), zeros])
    if values.device.type != "cuda":
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host, _mark_end()


def _step_now(run: Run, t: torch.Tensor, logged: bool) -> tuple[StepResult | None, torch.Tensor]:
    """The update when the optimizer cannot skip on the device: read the loss first, step only when it is finite."""
    loss_sum, stops = t.tolist()
    # zeros are counted only for the steps that are logged (a pass over the gradients)
    result = run.optimizer.step(count_zeros=None if logged else False) if math.isfinite(loss_sum) else None
    skipped = result is None or not result.success
    norm = result.grad_norm if logged and result is not None else None
    zeros = result.num_zeros if result is not None else None
    nan = math.nan
    return result, torch.tensor([loss_sum, stops, float(skipped), nan if norm is None else norm,
                                 nan if zeros is None else zeros], dtype=torch.float64)  # fmt: skip


def _loss_weight(run: Run, num_micro: int) -> float:
    """The factor the schedule backpropagates each micro-batch's loss with: ``1 / num_micro`` times the fp16 loss
    scale (``optimizer.scale_loss``; a host value: no sync)."""
    scaler = run.optimizer.scaler
    return (1.0 if scaler is None else float(scaler.scale)) / num_micro


def _set_aux_loss_scale(run: Run, num_micro: int) -> None:
    """The MoE layers' auxiliary losses get the gradient the schedule gives the main loss (:func:`_loss_weight`)."""
    set_aux_loss_scale(run.chunks, _loss_weight(run, num_micro))


def _data_counters(iterators: list[Any]) -> tuple[float, int]:
    """(host seconds the iterators spent producing batches, images they served) so far: MicroBatchIterator's
    counters (0 for other iterators); the images of the first chunk's iterator (every chunk reads each batch)."""
    waited = sum(getattr(it, "wait_seconds", 0.0) for it in iterators)
    return waited, int(getattr(iterators[0], "images", 0)) if iterators else 0


def train_step(
    run: Run, iterators: list[Any], *, logged: bool = True, stop_vote: Callable[[], bool] | None = None
) -> StepOutcome:
    """One optimizer step of ``run`` on micro-batches from ``iterators`` (:meth:`Run.train_iterators`): LR, forward
    and backward with the gradient reduction, the ranks' agreement, clipping and the update. Advances ``run.step``
    and the consumed samples and tokens.

    ``logged``: the step's zero-gradient count is wanted (a pass over the gradients). ``stop_vote``: asked after the
    backward, just before the ranks agree, whether this rank wants to stop (a signal or time limit reached during the
    step counts for it); the outcome's :attr:`~StepOutcome.stop_requested` says whether any rank did.
    """
    cfg, st = run.config, run.state
    gb = _global_batch_size(run)
    num_micro = gb // (cfg.training.micro_batch_size * st.dp_size)
    lr = run.scheduler.apply(run.optimizer, run.step)
    run.optimizer.zero_grad()
    moe = run.model_config.moe is not None
    if moe:
        _set_aux_loss_scale(run, num_micro)
    # FP8 layers: weights cast once for the step's micro-batches; delayed scaling rolled over the stage's ranks, its
    # gradient maxima per unit of the loss weight each rank backpropagates (times cp: a cp rank's loss is its share
    # times cp, mcore_train.context_parallel), so the histories do not depend on dp or cp
    data_before = _data_counters(iterators)
    with fp8_step(run.chunks, st.tp_dp_cp, grad_weight=_loss_weight(run, num_micro) * st.cp.size):
        local_loss = _schedule_loss(run, iterators, num_micro, False)
    data_after = _data_counters(iterators)
    if moe:  # aux-loss-free balancing: the step's tokens per expert move the expert biases (no-op without them)
        update_expert_biases(run.chunks, st.tp_dp_cp)
    t = _agree_start(run, local_loss, stop_vote is not None and stop_vote())
    update: StepResult | None
    if deferred_reads(run):
        # zeros are counted only for the steps that are logged (a pass over the gradients)
        update = run.optimizer.step(count_zeros=None if logged else False, skip_if_nonfinite=t[0])
        values, ready = _launch_readback(t, update)
    else:
        (update, values), ready = _step_now(run, t, logged), None
    end = ready if ready is not None else _mark_end() if _timed_on_device(st.device) else None
    tokens = gb * cfg.data.seq_length
    outcome = StepOutcome(
        step=run.step + 1, lr=lr, global_batch=gb, tokens=tokens, samples_before=run.consumed_samples,
        tokens_after=run.consumed_tokens + tokens, logged=logged, update=update, end=end, values=values, ready=ready,
        dp_size=st.dp_size, cp_size=st.cp.size, data_seconds=data_after[0] - data_before[0],
        images=data_after[1] - data_before[1],
    )  # fmt: skip
    run.step += 1
    run.consumed_samples += gb
    run.consumed_tokens += tokens
    return outcome
