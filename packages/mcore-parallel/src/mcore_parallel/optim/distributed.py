"""``DistributedOptimizer`` (ZeRO-1): fp32 master weights and optimizer state sharded over data-parallel ranks.

DDP (with ``use_distributed_optimizer=True``) reduce-scatters each gradient bucket so data-parallel rank ``i``
holds the mean gradient of the ``i``-th contiguous ``1/dp`` of every bucket. This optimizer keeps fp32 master
copies and Adam moments only for that shard (one master tensor per parameter piece inside the shard), steps them
locally, writes the new values into the model's flat parameter buffer and all-gathers every bucket so each rank
again holds the full parameters. Optimizer-state memory per rank is therefore about ``1/dp`` of the unsharded one.

Expert-parallel parameters live in buffers of their own, sharded over ``expert_dp`` (each buffer's own group): the
slots of a buffer are this rank's shard over ``buf.group``.

The gradient norm sums squares over the world (tensor x pipeline x data-parallel ranks): the shards are disjoint, so
nothing is counted twice. The all-gather is synchronous, at the end of ``step()``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from mcore_parallel.ddp.ddp import DistributedDataParallel
from mcore_parallel.optim.config import OptimizerConfig
from mcore_parallel.optim.optimizer import MixedPrecisionOptimizer, _Slot, default_no_weight_decay
from mcore_parallel.state import Group, ParallelState

__all__ = ["DistributedOptimizer"]

logger = logging.getLogger(__name__)


class DistributedOptimizer(MixedPrecisionOptimizer):
    """ZeRO-1 over ``state.dp_cp`` (expert parameters: ``state.expert_dp``); every chunk must be a DDP wrapper
    built with ``use_distributed_optimizer``."""

    def __init__(
        self,
        model_chunks: Sequence[nn.Module],
        state: ParallelState,
        config: OptimizerConfig | None = None,
        *,
        no_weight_decay: Callable[[str, torch.Tensor], bool] = default_no_weight_decay,
    ) -> None:
        for i, chunk in enumerate(model_chunks):
            if not (isinstance(chunk, DistributedDataParallel) and chunk.config.use_distributed_optimizer):
                raise ValueError(
                    f"model chunk {i} ({type(chunk).__name__}) must be wrapped in DistributedDataParallel with "
                    "DDPConfig(use_distributed_optimizer=True) to use the distributed optimizer"
                )
        super().__init__(model_chunks, state, config, no_weight_decay=no_weight_decay)

    dp_sharded = True

    @property
    def norm_group(self) -> Group:
        return self.state.world

    def _build_slots(
        self, named: list[tuple[str, nn.Parameter]], no_wd: Callable[[str, torch.Tensor], bool]
    ) -> list[_Slot]:
        name_of = {id(p): n for n, p in named}
        slots = []
        for chunk in self.chunks:
            assert isinstance(chunk, DistributedDataParallel)
            for buf in chunk.grad_buffers:
                for bucket in buf.buckets:
                    lo, hi = bucket.shard_range(max(buf.group.rank, 0), buf.dp)
                    for p in bucket.params:
                        start, end = buf.ranges[p]
                        a, b = max(start, lo), min(end, hi)
                        if a >= b:
                            continue
                        name = name_of[id(p)]
                        master = p.detach().reshape(-1)[a - start : b - start].float().clone()
                        slots.append(
                            _Slot(name, p, master, a - start, b - start, self._counts_in_norm(p), not no_wd(name, p))
                        )
        owned = sum(s.hi - s.lo for s in slots)
        logger.debug("distributed optimizer: rank %d owns %d of %d elements", self.state.rank, owned,
                     sum(p.numel() for _, p in named))  # fmt: skip
        return slots

    def _grad_of(self, s: _Slot) -> torch.Tensor | None:
        return s.param.main_grad.reshape(-1)[s.lo : s.hi]  # type: ignore[attr-defined]

    @torch.no_grad()
    def _copy_to_model(self) -> None:
        if self.slots:  # one multi-tensor copy (with the cast) into each parameter's owned range
            torch._foreach_copy_([s.param.data.view(-1)[s.lo : s.hi] for s in self.slots],
                                 [s.master.view(-1) for s in self.slots])  # fmt: skip
        for chunk in self.chunks:
            assert isinstance(chunk, DistributedDataParallel)
            chunk.all_gather_params()
