"""The training loop: steps, LR schedule, logging, evaluation, checkpoints and every exit condition.

Exit conditions: ``train_iters`` (or ``train_tokens``) reached, the wall-clock limit, SIGTERM/SIGINT (the step in
progress finishes, a checkpoint is saved, and the run returns normally so the process exits 0), and a nan/inf loss
(stop with a message naming the step, or skip that step's update when ``training.on_nan=skip``). Ranks agree on
stopping through one small all-reduce per step that also carries the loss; with an optimizer that drops nan/inf
steps on the device (fused AdamW), the host reads it one step later, so no step waits for the GPU (:func:`train`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mcore_models import training_flops_per_token
from mcore_parallel.ddp import DistributedDataParallel
from mcore_parallel.pipeline import forward_backward
from mcore_train.errors import TrainingDiverged
from mcore_train.metrics import MetricsWriter, memory_stats, peak_tflops_for
from mcore_train.profiling import StepProfiler
from mcore_train.trainer import Run, rank_state

__all__ = ["train", "TrainResult", "evaluate", "save_checkpoint"]

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    steps: int
    final_loss: float | None
    exit_reason: str
    losses: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    generated: str | None = None


class _StopFlag:
    """Set by SIGTERM/SIGINT; the handler only records the request (the step in progress finishes)."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: cannot install handlers
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = signal.Signals(signum).name
        logger.warning("received %s: finishing this step, saving and exiting", self.requested)

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)


def _forward_step(data_iterator: Any, chunk: Any) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    model = chunk.module if isinstance(chunk, DistributedDataParallel) else chunk
    tokens = batch["tokens"] if model.pre_process else None
    labels = batch["labels"] if model.post_process else None
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


def _agree_values(run: Run, loss_sum: float, stops: float) -> tuple[float, bool]:
    """(mean loss over data-parallel ranks, whether any rank wants to stop), identical on every rank."""
    return loss_sum / run.state.dp_size / run.state.cp.size, stops > 0


def _agree(run: Run, loss: float, stop: bool) -> tuple[float, bool]:
    loss_sum, stops = _agree_start(run, loss, stop).tolist()
    return _agree_values(run, loss_sum, stops)


def _schedule_loss(run: Run, iterators: list[Any], num_micro: int, forward_only: bool) -> torch.Tensor | None:
    """Run the schedule; the mean loss over its micro-batches as a device scalar (None on ranks that compute none)."""
    cfg = run.config
    reported = forward_backward(
        _forward_step, iterators, list[Any](run.ddp), num_micro, cfg.data.seq_length, cfg.training.micro_batch_size,
        run.model_config.hidden_size, run.state, run.model_config.dtype, forward_only,
        grad_scale_func=None if forward_only else run.optimizer.scale_loss,
    )  # fmt: skip
    if not reported:
        return None
    return torch.stack([r["loss"].float() for r in reported]).mean()


def _run_schedule(run: Run, iterators: list[Any], num_micro: int, forward_only: bool) -> float:
    loss = _schedule_loss(run, iterators, num_micro, forward_only)
    return 0.0 if loss is None else float(loss.item())


@dataclass
class _InFlight:
    """A training step whose work is enqueued but whose loss the host has not read yet."""

    step: int  # 1-based
    global_batch: int
    lr: float
    logs: bool  # this step is logged
    values: torch.Tensor  # [loss sum, votes, skipped, grad norm, zeros] on the host (pinned, filled asynchronously)
    ready: Any  # CUDA event recorded after the copy (None when the values are already there)
    end: Any  # CUDA timing event recorded after the step's last work (None off CUDA): where its time ends
    result: Any  # the optimizer's StepResult (None when the host skipped the step)
    samples_before: int  # consumed samples when the step began
    tokens_after: int  # consumed tokens when it ended


def _launch_readback(t: torch.Tensor, result: Any) -> tuple[torch.Tensor, Any]:
    """Copy the step's agreed values, skip flag, gradient norm and zero count (nan when not counted) to the host
    without waiting for them."""
    zeros = result.num_zeros_tensor
    zeros = torch.full_like(t[:1], math.nan) if zeros is None else zeros.double().reshape(1)
    values = torch.cat([t, result.skipped.double().reshape(1), result.grad_norm_tensor.double().reshape(1), zeros])
    if values.device.type != "cuda":
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    return host, _mark_end()


def _timed_on_device(device: torch.device) -> bool:
    """Whether logging windows are timed by events on the device's stream (CUDA) rather than the host's clock."""
    return device.type == "cuda"


def _mark_end() -> Any:
    """A CUDA timing event recorded after the work enqueued so far (the end of a step on the device's timeline)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class _WindowClock:
    """The time of a logging window: from the end of the step that closed the previous window to the end of its
    last step.

    The deferred loop reads a step's values after it has enqueued the next step, and enqueuing can block (a full
    launch queue) until the device is well into that next step, so the host's clock at the read can lie anywhere
    inside the following step and a window timed by it misses up to a step of device time (the sixth session's loop
    reported 662 TFLOP/s for a step whose kernels alone took 3.39 s, i.e. 545). On CUDA a window is therefore the
    time between two timing events that end steps on the device's stream (idle gaps and evaluations inside the window
    included); elsewhere the host clock when the step's values are read (the host waited for them).
    """

    def __init__(self, cuda: bool) -> None:
        self.start: Any = _mark_end() if cuda else time.perf_counter()

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


def evaluate(run: Run, evaluation_index: int) -> float | None:
    """Mean validation loss over ``training.eval_iters`` global batches (forward only)."""
    tr = run.config.training
    iterators = run.eval_iterators(evaluation_index)
    if iterators is None or tr.eval_iters == 0:
        return None
    num_micro = tr.global_batch_size // (tr.micro_batch_size * run.state.dp_size)
    for chunk in run.ddp:
        chunk.eval()
    total = 0.0
    try:
        for _ in range(tr.eval_iters):
            loss, _ = _agree(run, _run_schedule(run, iterators, num_micro, True), False)
            total += loss
    except StopIteration:
        logger.warning("the validation split ran out of samples; evaluated fewer batches")
    finally:
        for chunk in run.ddp:
            chunk.train()
    return total / tr.eval_iters


def save_checkpoint(run: Run, reason: str) -> None:
    if run.checkpoints is None:
        return
    cfg = run.config
    extra_files = {}
    tokenizer: dict[str, Any] = {"kind": cfg.data.tokenizer, "path": None}
    if cfg.data.tokenizer_model:
        inside = f"tokenizer/{Path(cfg.data.tokenizer_model).name}"
        extra_files[inside] = cfg.data.tokenizer_model
        tokenizer["path"] = inside
    meta = {
        "step": run.step,
        "consumed_samples": run.consumed_samples,
        "consumed_tokens": run.consumed_tokens,
        "skipped_steps": run.skipped_steps,
        "model": run.model_config.to_dict(),
        "tokenizer": tokenizer,
        "config": cfg.to_dict(),
        "scheduler": run.scheduler.state_dict(),
        "loss_scaler": None if run.optimizer.scaler is None else run.optimizer.scaler.state_dict(),
        "data": {"consumed_samples": run.consumed_samples},
        "reason": reason,
    }
    run.checkpoints.save(f"step_{run.step:07d}", run.items, run.optimizer, meta, rank_state(run), extra_files)
    run.last_saved_step = run.step


def _empty_window() -> dict[str, Any]:
    """A logging window's running sums (and whether it holds a profiled step)."""
    return {"loss": 0.0, "n": 0, "tokens": 0, "samples": 0, "profiled": False}


def _every(step: int, interval: int | None) -> bool:
    return interval is not None and interval > 0 and step % interval == 0


def _diverged(run: Run, step: int, loss: float, samples: int) -> TrainingDiverged:
    return TrainingDiverged(
        f"the loss is {loss} at step {step} (consumed samples {samples}); lower optimizer.lr, check the data, or set "
        "training.on_nan=skip to drop such steps"
    )


def _step_now(run: Run, t: torch.Tensor, step: int, logs: bool) -> tuple[Any, torch.Tensor]:
    """The update when the optimizer cannot skip on the device: read the loss first, step only when it is finite."""
    loss_sum, stops = t.tolist()
    finite = math.isfinite(loss_sum)  # the mean loss is the sum over a positive count
    if not finite and run.config.training.on_nan == "stop":
        raise _diverged(run, step, loss_sum, run.consumed_samples)
    # zeros are counted only for the steps that are logged (a pass over the gradients)
    result = run.optimizer.step(count_zeros=None if logs else False) if finite else None
    skipped = result is None or not result.success
    norm = result.grad_norm if logs and result is not None else None
    zeros = result.num_zeros if result is not None else None
    nan = math.nan
    return result, torch.tensor([loss_sum, stops, float(skipped), nan if norm is None else norm,
                                 nan if zeros is None else zeros], dtype=torch.float64)  # fmt: skip


def train(run: Run) -> TrainResult:
    """Train until an exit condition; returns the losses and why it stopped.

    When the optimizer can drop a non-finite step on the device (AdamW's fused kernel without fp16 loss scaling:
    the default on GPUs), nothing in a step waits for the GPU: the host reads a step's loss (and the ranks' stop
    votes) after it has enqueued the next step, so the GPU never idles between steps; a nan loss and a stop request
    then take effect one step later. Otherwise each step's loss is read before its update.
    """
    cfg, st = run.config, run.state
    tr, lg = cfg.training, cfg.logging
    is_logger = st.rank == 0
    log_dir = lg.dir or cfg.checkpoint.dir
    writer = MetricsWriter(log_dir if is_logger else None, jsonl=lg.jsonl, tensorboard=lg.tensorboard,
                           wandb_project=lg.wandb_project if is_logger else None, config=cfg.to_dict())  # fmt: skip
    flops_per_token = training_flops_per_token(run.model_config, cfg.data.seq_length, tp_size=st.tp.size)
    peak = peak_tflops_for(st.device, lg.peak_tflops)
    profiler = StepProfiler(lg.profile_steps, log_dir, st.rank, lg.profile_ranks, lg.profile_trace)
    stop = _StopFlag()
    stop.install()
    bar = _progress(run) if is_logger and lg.progress_bar else None
    result = TrainResult(run.step, None, "train_iters")
    iterators = run.train_iterators()
    start_time = time.monotonic()
    window = _empty_window()
    clock = _WindowClock(_timed_on_device(st.device))
    staging_reserved = False  # async saves: host staging buffer allocated in the background after the first step
    evaluation_index = 0
    lagged = run.optimizer.skips_on_device and not tr.read_loss_every_step
    in_flight: _InFlight | None = None

    def finish(f: _InFlight) -> bool:
        """The host's part of a step whose work is enqueued: nan check, skip count, progress, log; True to stop."""
        nonlocal window
        if f.ready is not None:
            f.ready.synchronize()  # waits for this step's values only, not for the work enqueued after them
        loss_sum, stops, skipped, norm, zeros = f.values.tolist()
        loss, want_stop = _agree_values(run, loss_sum, stops)
        finite = math.isfinite(loss)
        if not finite and tr.on_nan == "stop":
            result.exit_reason = "nan"
            raise _diverged(run, f.step, loss, f.samples_before)
        if skipped:
            run.skipped_steps += 1
            if not finite or (f.result is not None and f.result.skipped is not None):
                logger.warning("step %d: loss %s, gradient norm %s: update skipped", f.step, loss, norm)
        if finite:
            result.losses.append(loss)
            window["loss"] += loss
            window["n"] += 1
        window["tokens"] += f.global_batch * cfg.data.seq_length
        window["samples"] += f.global_batch
        # the profiler's steps and the step after them (enqueued only once the profile is written) run slower
        window["profiled"] = window["profiled"] or profiler.covers(f.step)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{f.lr:.2e}")
        if f.logs:
            elapsed = clock.lap(f.end)
            tok_s = window["tokens"] / elapsed
            tflops = tok_s * flops_per_token / st.world_size / 1e12
            step_result = f.result
            record: dict[str, Any] = {
                "loss": window["loss"] / max(window["n"], 1),
                "lr": f.lr,
                "grad_norm": None if step_result is None or math.isnan(norm) else norm,
                "num_zeros": None if step_result is None or math.isnan(zeros) else int(zeros),
                "loss_scale": None if step_result is None else step_result.loss_scale,
                "tokens_per_s": tok_s,
                "samples_per_s": window["samples"] / elapsed,
                "tflops_per_gpu": tflops,
                "global_batch_size": f.global_batch,
                "consumed_tokens": f.tokens_after,
                "skipped_steps": run.skipped_steps,
                **memory_stats(st.device),
            }
            if window["profiled"]:
                record["profiled"] = True  # its throughput includes the profiler's overhead: not a measurement
            if peak:
                record["mfu"] = tflops / peak
            if is_logger:
                writer.write(f.step, record)
                _log_line(run, f.step, record)
            window = _empty_window()
        return want_stop

    try:
        while run.step < run.train_iters:
            gb = _global_batch_size(run)
            num_micro = gb // (tr.micro_batch_size * st.dp_size)
            lr = run.scheduler.apply(run.optimizer, run.step)
            profiler.before_step(run.step + 1)
            run.optimizer.zero_grad()
            local_loss = _schedule_loss(run, iterators, num_micro, False)
            over_time = (
                tr.exit_duration_minutes is not None and time.monotonic() - start_time > 60 * tr.exit_duration_minutes
            )
            t = _agree_start(run, local_loss, stop.requested is not None or over_time)
            logs_now = (run.step + 1) % lg.log_interval == 0 or run.step + 1 == run.train_iters  # this step is logged
            if lagged:
                # zeros are counted only for the steps that are logged (a pass over the gradients)
                step_result = run.optimizer.step(count_zeros=None if logs_now else False, skip_if_nonfinite=t[0])
                values, ready = _launch_readback(t, step_result)
            else:
                (step_result, values), ready = _step_now(run, t, run.step + 1, logs_now), None
            end = ready if ready is not None else _mark_end() if _timed_on_device(st.device) else None
            current = _InFlight(run.step + 1, gb, lr, logs_now, values, ready, end, step_result,
                                run.consumed_samples, run.consumed_tokens + gb * cfg.data.seq_length)  # fmt: skip
            run.step += 1
            profiler.after_step(run.step)
            run.consumed_samples += gb
            run.consumed_tokens += gb * cfg.data.seq_length
            if run.checkpoints is not None:
                if not staging_reserved and cfg.checkpoint.save_interval:
                    # the optimizer state exists now: the first async save then finds its host buffer allocated
                    run.checkpoints.reserve(run.items, run.optimizer)
                    staging_reserved = True
                run.checkpoints.poll()
            # the previous step's bookkeeping runs while the GPU works on this one
            want_stop = finish(in_flight) if in_flight is not None else False
            in_flight = current
            more = run.step < run.train_iters
            eval_due = more and _every(run.step, tr.eval_interval)
            exit_due = more and _every(run.step, tr.exit_interval)
            save_due = _every(run.step, cfg.checkpoint.save_interval)
            if not lagged or want_stop or eval_due or exit_due or save_due or run.step >= run.train_iters:
                want_stop = finish(in_flight) or want_stop
                in_flight = None
            if eval_due:
                ev = evaluate(run, evaluation_index)
                evaluation_index += 1
                if ev is not None:
                    result.eval_losses.append((run.step, ev))
                    if is_logger:
                        writer.write(run.step, {"valid_loss": ev})
                        logger.info("step %d: validation loss %.4f (ppl %.2f)", run.step, ev, math.exp(min(ev, 50)))
            if want_stop:
                result.exit_reason = stop.requested or "time_limit"
                break
            if exit_due:
                result.exit_reason = "exit_interval"
                break
            if save_due:
                save_checkpoint(run, "interval")
        if result.exit_reason == "train_iters":
            ev = evaluate(run, evaluation_index)
            if ev is not None:
                result.eval_losses.append((run.step, ev))
                if is_logger:
                    writer.write(run.step, {"valid_loss": ev})
                    logger.info("final validation loss %.4f (ppl %.2f)", ev, math.exp(min(ev, 50)))
        wants_save = cfg.checkpoint.save_at_end or result.exit_reason != "train_iters"
        # skip when a checkpoint of this very step is already in the checkpoint directory (interval save, resume)
        if cfg.checkpoint.dir is not None and wants_save and run.last_saved_step != run.step:
            save_checkpoint(run, result.exit_reason)
    finally:
        profiler.close()
        if run.checkpoints is not None:
            run.checkpoints.wait()  # never exit with a save in flight
        stop.restore()
        if bar is not None:
            bar.close()
        writer.close()
    result.steps = run.step
    result.final_loss = result.losses[-1] if result.losses else None
    return result


def _progress(run: Run) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    # disable=None: no bar when the output is not a terminal (logs and CI get the periodic log lines instead)
    return tqdm(total=run.train_iters, initial=run.step, desc="train", unit="step", dynamic_ncols=True, leave=True,
                mininterval=1.0, disable=None)  # fmt: skip


def _log_line(run: Run, step: int, r: dict[str, Any]) -> None:
    parts = [f"step {step}/{run.train_iters}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.3e}"]
    if r.get("grad_norm") is not None:
        parts.append(f"grad norm {r['grad_norm']:.3f}")
    if r.get("loss_scale") is not None:
        parts.append(f"loss scale {r['loss_scale']:g}")
    parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
    parts.append(f"{r['samples_per_s']:.1f} samples/s")
    parts.append(f"{r['tflops_per_gpu']:.1f} TFLOP/s/GPU")
    if "mfu" in r:
        parts.append(f"MFU {r['mfu']:.1%}")
    mem = r.get("mem_peak_gib", r.get("mem_rss_peak_gib"))
    if mem is not None:
        parts.append(f"mem {mem:.2f} GiB")
    logger.info(" | ".join(parts))
