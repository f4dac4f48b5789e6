"""``pretrain(config)``: set up, train, report. The Python entry point behind ``mcore-train pretrain``."""

from __future__ import annotations

import logging

import torch.distributed as dist

from mcore_train.config import TrainConfig
from mcore_train.generate import greedy_generate
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
    if tr.generate_at_end and result.exit_reason == "train_iters":
        if st.pp.size == 1:
            prompt = run.data.tokenizer.encode(tr.generate_prompt)
            new = greedy_generate(run.chunks[0], prompt, tr.generate_at_end, stop_id=run.data.tokenizer.eod)
            result.generated = tr.generate_prompt + run.data.tokenizer.decode(new)
            if st.rank == 0:
                logger.info("sample (greedy, %d tokens):\n%s", len(new), result.generated)
        elif st.rank == 0:
            logger.info("generation at the end is skipped under pipeline parallelism (use mcore-infer)")
    if st.rank == 0:
        logger.info(
            "done: %d steps, final loss %s, exit reason %s", result.steps, result.final_loss, result.exit_reason
        )
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return result
