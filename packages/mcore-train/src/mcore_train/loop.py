"""The training loop: :func:`train` drives :func:`~mcore_train.step.train_step` until an exit condition, with the
progress bar, logging, evaluation and checkpoints around it.

Log lines: every ``logging.log_interval`` steps, and in the first interval of a run also after its steps 1, 2, 4, 8, ...
(so a slow machine shows the loss, the speed and an ETA within a step or two, not only at step 10). Each line has the
mean loss of the steps since the previous line and an ETA from the mean time per step since the run's first step.

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

from mcore_data._progress import format_duration
from mcore_models import training_flops_per_token
from mcore_models.flops import llava_training_flops
from mcore_train.errors import TrainingDiverged
from mcore_train.metrics import MetricsWindow, MetricsWriter, moe_window_metrics, peak_tflops_for
from mcore_train.profiling import StepProfiler
from mcore_train.step import StepClock, StepOutcome, deferred_reads, eval_loss, train_step
from mcore_train.trainer import Run, rank_state

__all__ = ["train", "TrainResult", "evaluate", "save_checkpoint"]

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    steps: int
    final_loss: float | None
    """The loss of the last step (one global batch)."""
    exit_reason: str
    losses: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    generated: str | None = None
    logged_loss: tuple[int, int, float] | None = None
    """The last log line's loss: (first step, last step, mean loss of those steps)."""


class _StopFlag:
    """Whether this rank wants to stop: SIGTERM/SIGINT (the handler only records the request; the step in progress
    finishes) or the wall-clock limit ``training.exit_duration_minutes`` passed."""

    def __init__(self, minutes: float | None) -> None:
        self.requested: str | None = None
        self._deadline = None if minutes is None else time.monotonic() + 60 * minutes
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: cannot install handlers
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = signal.Signals(signum).name
        logger.warning("received %s: finishing this step, saving and exiting", self.requested)

    def wanted(self) -> bool:
        return self.requested is not None or (self._deadline is not None and time.monotonic() > self._deadline)

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)


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
            total += eval_loss(run, iterators, num_micro)
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
        "model": (run.llava or run.model_config).to_dict(),
        "tokenizer": tokenizer,
        "config": cfg.to_dict(),
        "scheduler": run.scheduler.state_dict(),
        "loss_scaler": None if run.optimizer.scaler is None else run.optimizer.scaler.state_dict(),
        "data": {"consumed_samples": run.consumed_samples},
        "reason": reason,
    }
    run.checkpoints.save(f"step_{run.step:07d}", run.items, run.optimizer, meta, rank_state(run), extra_files)
    run.last_saved_step = run.step


def _every(step: int, interval: int | None) -> bool:
    return interval is not None and interval > 0 and step % interval == 0


def _logs(step: int, first: int, train_iters: int, interval: int) -> bool:
    """Whether step ``step`` of a run that started after step ``first - 1`` gets a log line: every ``interval`` steps,
    the last step, and within the run's first interval its 1st, 2nd, 4th, 8th, ... step."""
    n = step - first + 1
    return step % interval == 0 or step == train_iters or (n < interval and n & (n - 1) == 0)


def _checkpoint_upkeep(run: Run, reserved: bool) -> bool:
    """After a step: with interval saves, the host staging buffer is reserved (in the background) once the optimizer
    state exists, so the first async save finds it allocated; finished background saves are collected. Returns
    whether the buffer is reserved."""
    if run.checkpoints is None:
        return reserved
    if not reserved and run.config.checkpoint.save_interval:
        run.checkpoints.reserve(run.items, run.optimizer)
        reserved = True
    run.checkpoints.poll()
    return reserved


class _Bookkeeping:
    """The host's side of a run's steps: the nan check and the skipped-step count, the progress bar, the metrics
    window with its records and log lines (rank 0), evaluations, and the profiler around the steps."""

    def __init__(self, run: Run, result: TrainResult) -> None:
        cfg, st, lg = run.config, run.state, run.config.logging
        self.run, self.result = run, result
        self.is_logger = st.rank == 0
        log_dir = lg.dir or cfg.checkpoint.dir
        self.writer = MetricsWriter(log_dir if self.is_logger else None, jsonl=lg.jsonl, tensorboard=lg.tensorboard,
                                    wandb_project=lg.wandb_project if self.is_logger else None,
                                    config=cfg.to_dict())  # fmt: skip
        self.profiler = StepProfiler(lg.profile_steps, log_dir, st.rank, lg.profile_ranks, lg.profile_trace)
        self.bar = _progress(run) if self.is_logger and lg.progress_bar else None
        seq = cfg.data.seq_length
        flops = training_flops_per_token(run.model_config, seq, tp_size=st.tp.size)
        per_image = 0.0
        if run.llava is not None:  # the tower and projector too, for the images (tiles) the steps read
            flops = (
                llava_training_flops(run.llava, batch_size=1, seq_length=seq, num_images=0, tp_size=st.tp.size) / seq
            )
            per_image = llava_training_flops(run.llava, batch_size=0, seq_length=seq, num_images=1, tp_size=st.tp.size)
        self.window = MetricsWindow(StepClock(st.device), flops_per_token=flops, world_size=st.world_size,
                                    peak_tflops=peak_tflops_for(st.device, lg.peak_tflops), device=st.device,
                                    flops_per_image=per_image, image_scale=st.dp_size)  # fmt: skip
        self.window_first = run.step + 1  # the first step of the open log window
        self.eta_origin: tuple[int, float] | None = None  # (step, time) once the run's first step is done

    def settle(self, step: StepOutcome) -> bool:
        """The host's part of a step whose work is enqueued: nan check, skip count, progress, log; True to stop."""
        loss = step.loss
        finite = math.isfinite(loss)
        if not finite and self.run.config.training.on_nan == "stop":
            raise TrainingDiverged(
                f"the loss is {loss} at step {step.step} (consumed samples {step.samples_before}); lower "
                "optimizer.lr, check the data, or set training.on_nan=skip to drop such steps"
            )
        if step.skipped:
            self.run.skipped_steps += 1
            if not finite or (step.update is not None and step.update.skipped is not None):
                logger.warning("step %d: loss %s, gradient norm %s: update skipped", step.step, loss, step.grad_norm)
        if finite:
            self.result.losses.append(loss)
        # the profiler's steps and the step after them (enqueued only once the profile is written) run slower
        self.window.add(step, profiled=self.profiler.covers(step.step))
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{step.lr:.2e}")
        now = time.monotonic()
        if self.eta_origin is None:  # ETAs count from the end of the first step, whose warm-up is not typical
            self.eta_origin = (step.step, now)
        if step.logged:
            record = self.window.close(step, self.run.skipped_steps)
            self.result.logged_loss = (self.window_first, step.step, record["loss"])
            self.window_first = step.step + 1
            first, t0 = self.eta_origin
            if first < step.step < self.run.train_iters:
                record["eta_s"] = (now - t0) / (step.step - first) * (self.run.train_iters - step.step)
            if self.is_logger:
                self.writer.write(step.step, record)
                _log_line(self.run, step.step, record)
        return step.stop_requested

    def evaluation(self, index: int, final: bool) -> None:
        """Evaluate (the ``index``-th evaluation of the run, which picks its validation samples) and report it."""
        ev = evaluate(self.run, index)
        if ev is None:
            return
        step = self.run.step
        self.result.eval_losses.append((step, ev))
        if self.is_logger:
            self.writer.write(step, {"valid_loss": ev})
            if final:
                logger.info("final validation loss %.4f (ppl %.2f)", ev, math.exp(min(ev, 50)))
            else:
                logger.info("step %d: validation loss %.4f (ppl %.2f)", step, ev, math.exp(min(ev, 50)))

    def close(self) -> None:
        self.profiler.close()
        if self.bar is not None:
            self.bar.close()
        self.writer.close()


def train(run: Run) -> TrainResult:
    """Train until an exit condition; returns the losses and why it stopped.

    When the optimizer can drop a non-finite step on the device (AdamW's fused kernel without fp16 loss scaling:
    the default on GPUs), nothing in a step waits for the GPU: the host reads a step's loss (and the ranks' stop
    votes) after it has enqueued the next step, so the GPU never idles between steps; a nan loss and a stop request
    then take effect one step later. Otherwise each step's loss is read before its update.
    """
    tr, ck = run.config.training, run.config.checkpoint
    result = TrainResult(run.step, None, "train_iters")
    books = _Bookkeeping(run, result)
    iterators = run.train_iterators()
    deferred = deferred_reads(run)
    first, interval = run.step + 1, run.config.logging.log_interval
    pending: StepOutcome | None = None  # a step whose values the host has not read yet
    evaluations, reserved = 0, False
    stop = _StopFlag(tr.exit_duration_minutes)
    stop.install()
    try:
        while run.step < run.train_iters:
            logged = _logs(run.step + 1, first, run.train_iters, interval)
            books.profiler.before_step(run.step + 1)
            step = train_step(run, iterators, logged=logged, stop_vote=stop.wanted)
            if logged:  # every rank, the same steps: one all-reduce (and for MoE models a host read) per window
                step.moe = moe_window_metrics(run.chunks, run.model_config, run.state)
            books.profiler.after_step(run.step)
            reserved = _checkpoint_upkeep(run, reserved)
            # the previous step's bookkeeping runs while the GPU works on this one
            want_stop = books.settle(pending) if pending is not None else False
            pending = step
            more = run.step < run.train_iters
            eval_due = more and _every(run.step, tr.eval_interval)
            exit_due = more and _every(run.step, tr.exit_interval)
            save_due = _every(run.step, ck.save_interval)
            if not deferred or want_stop or eval_due or exit_due or save_due or not more:
                want_stop = books.settle(pending) or want_stop
                pending = None
            if eval_due:
                books.evaluation(evaluations, final=False)
                evaluations += 1
            if want_stop:
                result.exit_reason = stop.requested or "time_limit"
                break
            if exit_due:
                result.exit_reason = "exit_interval"
                break
            if save_due:
                save_checkpoint(run, "interval")
        if result.exit_reason == "train_iters":
            books.evaluation(evaluations, final=True)
        # skip when a checkpoint of this very step is already in the checkpoint directory (interval save, resume)
        wants_save = ck.save_at_end or result.exit_reason != "train_iters"
        if ck.dir is not None and wants_save and run.last_saved_step != run.step:
            save_checkpoint(run, result.exit_reason)
    finally:
        if run.checkpoints is not None:
            run.checkpoints.wait()  # never exit with a save in flight
        stop.restore()
        books.close()
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
    if "moe_aux_loss" in r:
        parts.append(f"aux loss {r['moe_aux_loss']:.4f}")
        parts.append(f"load max {r['moe_load_max']:.2f}")
        if "moe_dropped" in r:
            parts.append(f"dropped {r['moe_dropped']:.1%}")
    parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
    parts.append(f"{r['samples_per_s']:.1f} samples/s")
    if run.state.device.type == "cuda":
        parts.append(f"{r['tflops_per_gpu']:.1f} TFLOP/s/GPU")
    else:  # a CPU's model FLOP/s in TFLOP/s with one decimal would read 0.0 or 0.1
        parts.append(f"{r['tflops_per_gpu'] * 1e3:.1f} GFLOP/s/rank")
    if "mfu" in r:
        parts.append(f"MFU {r['mfu']:.1%}")
    mem = r.get("mem_peak_gib", r.get("mem_rss_peak_gib"))
    if mem is not None:
        parts.append(f"mem {mem:.2f} GiB")
    if "eta_s" in r:
        parts.append(f"ETA {format_duration(r['eta_s'])}")
    logger.info(" | ".join(parts))
