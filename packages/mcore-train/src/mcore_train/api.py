"""``pretrain(config)``: set up, train, report. The Python entry point behind ``mcore-train pretrain``."""

from __future__ import annotations

import dataclasses
import logging
import math

import torch.distributed as dist

from mcore_train.config import TrainConfig
from mcore_train.generate import END_OF_RUN_SAMPLING, generate
from mcore_train.loop import TrainResult, train
from mcore_train.trainer import setup

__all__ = ["pretrain"]

logger = logging.getLogger(__name__)


def launch_world_size() -> int:
    """The number of processes of this run: torch.distributed's when it is up, else the launcher's (torchrun,
    SLURM), else 1."""
    from mcore_parallel import read_launch_env

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return read_launch_env().world_size


def pretrain(config: TrainConfig) -> TrainResult:
    config.check_layout(launch_world_size())  # every config problem at once, before any process group exists
    run = setup(config)
    st = run.state
    if st.rank == 0:
        logger.info("resolved configuration:\n%s", config.to_yaml())
        n = sum(p.numel() for c in run.chunks for p in c.parameters())
        logger.info(
            "world %d (tp %d, pp %d, dp %d) on %s; %d parameters on rank 0; %d steps of %d samples x %d tokens",
            st.world_size, st.tp.size, st.pp.size, st.dp_size, st.device, n, run.train_iters,
            config.training.global_batch_size, config.data.seq_length,
        )  # fmt: skip
    result = train(run)
    tr = config.training
    tokenizer = run.data.tokenizer
    if tr.generate_at_end and result.exit_reason == "train_iters":
        if st.pp.size == 1:
            sampling = dataclasses.replace(END_OF_RUN_SAMPLING, seed=tr.seed)
            prompt = tokenizer.encode(tr.generate_prompt)
            new = generate(run.chunks[0], prompt, tr.generate_at_end, sampling, stop_id=tokenizer.eod,
                           vocab_size=tokenizer.vocab_size)  # fmt: skip
            result.generated = tr.generate_prompt + tokenizer.decode(new)
            if st.rank == 0:
                logger.info("sample (%s; %d tokens after %r):\n%s", sampling.describe(), len(new),
                            tr.generate_prompt, result.generated)  # fmt: skip
        elif st.rank == 0:
            logger.info("generation at the end is skipped under pipeline parallelism (use mcore-infer)")
    if st.rank == 0:
        logger.info("%s", summary(result, tokenizer.vocab_size))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return result


def summary(result: TrainResult, vocab_size: int) -> str:
    """The closing line: steps and why the run stopped, the training loss as the last log line reported it (the mean
    over its steps), and the last validation loss with its perplexity next to a uniform guess's (the vocabulary
    size: what an untrained model scores)."""
    parts = [f"done: {result.steps} steps ({result.exit_reason})"]
    if result.logged_loss is not None:
        first, last, loss = result.logged_loss
        steps = f"step {last}" if first == last else f"steps {first}-{last}"
        parts.append(f"training loss {loss:.4f} (mean of {steps}, as logged)")
    if result.eval_losses:
        step, ev = result.eval_losses[-1]
        parts.append(f"validation loss {ev:.4f} at step {step}, perplexity {math.exp(min(ev, 50)):.2f} "
                     f"(a uniform guess over the {vocab_size:,} tokens: {vocab_size:,})")  # fmt: skip
    return "; ".join(parts)
