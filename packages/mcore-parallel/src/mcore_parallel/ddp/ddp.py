"""``DistributedDataParallel``: data-parallel gradient reduction over ``state.dp_cp`` with bucketed, overlapped
collectives, fp32 ``main_grad`` accumulation and explicit handling of parameters shared across ranks.

Usage per step::

    ddp.zero_grad_buffer()
    with ddp.no_sync():          # every micro-batch but the last (the pipeline schedules do this for you)
        loss(mb).backward()
    loss(last_mb).backward()     # buckets launch their all-reduce as soon as their gradients are complete
    ddp.finish_grad_sync()       # wait; then sum sequence-parallel grads over tp
    optimizer.step()

The result in ``param.main_grad`` is the mean over data-parallel ranks of each rank's gradient (each rank's gradient
being whatever its loss produced, e.g. the mean over its micro-batches). ``param.grad`` is folded into
``main_grad`` by a post-accumulate-grad hook and freed.

Expert-parallel parameters (``param.expert_parallel``) live in buffers of their own, reduced over ``state.expert_dp``
instead: their gradient is the *sum* over ``expert_dp`` divided by the ``dp_cp`` size. Each rank's expert gradient
already holds the contributions of the tokens its expert-parallel peers routed to it, so this is the gradient of the
mean loss over all data-parallel ranks, as for the dense parameters.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mcore_parallel.ddp.buffer import GradBuffer
from mcore_parallel.sharding import data_parallel_group, is_expert
from mcore_parallel.state import ParallelState
from mcore_parallel.tensor import _comm

__all__ = ["DDPConfig", "DistributedDataParallel"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DDPConfig:
    """How gradients are bucketed and reduced."""

    bucket_size: int | None = 40_000_000
    """Elements per bucket (a bucket closes once it holds at least this many); ``None``: one bucket per buffer."""
    overlap_grad_reduce: bool = True
    """Launch each bucket's collective from the backward hook; ``False``: reduce everything in finish_grad_sync."""
    use_distributed_optimizer: bool = False
    """Reduce-scatter instead of all-reduce (pads buckets to a multiple of dp and puts params in a flat buffer)."""
    gradient_accumulation_fusion: bool = False
    """Linear layers add their weight gradients straight into ``main_grad`` from the weight-gradient GEMM (float32
    output on CUDA, ``aten::addmm.dtype_out``) instead of writing a bf16 gradient that a hook then adds: one pass over
    every weight gradient fewer per micro-batch. Marks the parameters; the layers of ``mcore_parallel.tensor`` honour
    it for weights they own."""

    exchange: str = "nccl"
    """How buckets and parameters are exchanged: ``nccl`` collectives, or ``p2p``: peer-to-peer copies between
    symmetric buffers on the copy engines (GPUs of one host with peer access; also CPU, for tests), see
    :mod:`mcore_parallel.ddp.buffer`."""

    def __post_init__(self) -> None:
        if self.exchange not in ("nccl", "p2p"):
            raise ValueError(f"exchange={self.exchange!r} must be nccl or p2p")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ValueError(f"bucket_size={self.bucket_size} must be a positive number of elements or None")


class DistributedDataParallel(nn.Module):
    """Wraps one model chunk; see the module docstring for the protocol."""

    def __init__(self, module: nn.Module, state: ParallelState, config: DDPConfig | None = None) -> None:
        super().__init__()
        self.module = module
        self.state = state
        self.config = config or DDPConfig()
        self.group, self.expert_group = state.dp_cp, state.expert_dp
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"{type(module).__name__} has no trainable parameters to wrap")
        self.grad_buffers = self._make_buffers(params)
        self._buffer_of = {p: buf for buf in self.grad_buffers for p in buf.params}
        self._sp_params = [p for p in params if getattr(p, "sequence_parallel", False)]
        if self.config.gradient_accumulation_fusion:
            for p in params:
                p.fuse_wgrad_accumulation = True  # type: ignore[attr-defined]
        self.is_last_microbatch = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        if state.rank == 0:
            logger.info(
                "DDP: %d params in %d buffer(s), %d bucket(s), dp_cp=%d, expert_dp=%d, overlap=%s, "
                "distributed_optimizer=%s",
                len(params), len(self.grad_buffers), sum(len(b.buckets) for b in self.grad_buffers),
                self.group.size, self.expert_group.size, self.config.overlap_grad_reduce,
                self.config.use_distributed_optimizer,
            )  # fmt: skip

    def _make_buffers(self, params: list[nn.Parameter]) -> list[GradBuffer]:
        """One buffer per (dtype, dense or expert): dense ones average over ``dp_cp``, expert ones sum over
        ``expert_dp`` and divide by the ``dp_cp`` size (see the module docstring)."""
        groups: dict[tuple[torch.dtype, bool], list[nn.Parameter]] = {}
        for p in reversed(params):
            groups.setdefault((p.dtype, is_expert(p)), []).append(p)
        buffers = []
        for (_, expert), ps in sorted(groups.items(), key=lambda kv: kv[0][1]):  # dense buffers first
            if expert and any(getattr(p, "shared_embedding", False) for p in ps):
                raise ValueError("an expert-parallel parameter cannot also be a shared embedding")
            scale = 1.0 / self.group.size if expert else None
            group = data_parallel_group(ps[0], self.state)
            buffers.append(
                GradBuffer(ps, group, self.config.bucket_size, self.config.use_distributed_optimizer,
                           self.state.device, self.config.exchange, scale=scale)
            )  # fmt: skip
        return buffers

    # ------------------------------------------------------------------------------------------- module protocol
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        """Forwarded to the wrapped chunk (the pipeline schedules call it)."""
        inner = getattr(self.module, "set_input_tensor", None)
        if inner is not None:
            inner(tensor)
        elif tensor is not None:
            raise TypeError(f"{type(self.module).__name__} has no set_input_tensor(tensor); pipeline stages need one")

    # ------------------------------------------------------------------------------------------- grad sync
    def set_is_last_microbatch(self, flag: bool) -> None:
        """``False``: accumulate only (no collectives); ``True``: this backward completes the step's gradients."""
        self.is_last_microbatch = flag

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (all micro-batches but the last)."""
        previous = self.is_last_microbatch
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = previous

    @torch.no_grad()
    def _on_grad(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            if getattr(param, "grad_added_to_main_grad", False):  # the layer's GEMM already added it (fusion)
                param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
            else:
                param.main_grad.add_(param.grad)  # type: ignore[attr-defined]
            param.grad = None
        if self.is_last_microbatch and self.config.overlap_grad_reduce:
            buf = self._buffer_of[param]  # type: ignore[index]
            bucket = buf.bucket_of[param]  # type: ignore[index]
            bucket.ready.add(id(param))
            if len(bucket.ready) == len(bucket.params) and not bucket.deferred:
                buf.start_grad_reduce(bucket)

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        """Finish the step's gradient reduction: data-parallel mean, shared-embedding and sequence-parallel sums.

        Shared embedding buckets are first summed over ``state.embedding`` (first + last stage), then reduced over
        dp. Sequence-parallel parameters are summed over tp after the data-parallel reduction (every tp rank has
        the same buffer layout, so under the distributed optimizer the owned shard ranges agree).
        """
        for buf in self.grad_buffers:
            for bucket in buf.buckets:
                if bucket.deferred:
                    self._reduce_embedding(bucket.grad)
                buf.start_grad_reduce(bucket)
            for bucket in buf.buckets:
                buf.wait_grad_reduce(bucket)
            buf.finish_p2p()
            buf.reset()
        if self._sp_params and self.state.tp.size > 1:
            grads = [p.main_grad for p in self._sp_params]  # type: ignore[attr-defined]
            flat = torch.cat([g.reshape(-1) for g in grads])
            _comm.all_reduce(flat, self.state.tp)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def _reduce_embedding(self, grad: torch.Tensor) -> None:
        emb = self.state.embedding
        if emb.is_member and emb.size > 1:
            dist.all_reduce(grad, group=emb.pg)

    @torch.no_grad()
    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad`` (and drop ``.grad``); call at the start of each step."""
        for buf in self.grad_buffers:
            buf.reset()
            buf.grad_data.zero_()
            for p in buf.params:
                p.grad = None

    @torch.no_grad()
    def broadcast_params(self) -> None:
        """Copy data-parallel rank 0's parameters to the other data-parallel ranks (call once at setup): dense
        parameters over ``dp_cp``, expert parameters over ``expert_dp`` (from its first rank)."""
        for p in self.module.parameters():
            group = data_parallel_group(p, self.state)
            if group.size > 1:
                dist.broadcast(p.data, src=group.ranks[0], group=group.pg)

    def all_gather_params(self) -> None:
        """Distributed optimizer: gather every rank's updated parameter shard (the optimizer calls this)."""
        for buf in self.grad_buffers:
            buf.all_gather_params()
