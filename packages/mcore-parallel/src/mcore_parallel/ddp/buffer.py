"""Contiguous fp32 gradient buffers split into buckets, and each bucket's data-parallel collective.

Parameters are laid out in reverse registration order (roughly the order backward produces their gradients), one
buffer per parameter dtype. ``param.main_grad`` is a view into the buffer, always float32, so micro-batch
gradients accumulate in fp32 even for bf16/fp16 parameters. A bucket closes when it holds at least
``bucket_size`` elements; a parameter marked ``shared_embedding`` gets a bucket of its own (it must first be summed
over the embedding group, see ``DistributedDataParallel.finish_grad_sync``).

With the distributed optimizer each bucket is padded to a multiple of the data-parallel size and reduce-scattered:
data-parallel rank ``i`` owns the ``i``-th contiguous ``1/dp`` of every bucket. The parameters then also live in
one buffer of their own dtype with the same layout (``param.data`` is a view), so the updated shards can be
all-gathered back in place.

Gradients are multiplied by ``1/dp`` *before* the collective (a sum), so the result is the data-parallel mean and
low-precision collectives would not overflow.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mcore_parallel.state import Group

__all__ = ["Bucket", "GradBuffer"]

logger = logging.getLogger(__name__)

_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(eq=False)
class Bucket:
    """A contiguous range ``[start, end)`` of a buffer (``end`` padded under the distributed optimizer)."""

    index: int
    params: list[nn.Parameter]
    start: int
    end: int
    grad: torch.Tensor
    param_data: torch.Tensor | None
    deferred: bool
    """Reduced only in ``finish_grad_sync`` (shared embedding weights), never from the backward hook."""
    ready: set[int] = field(default_factory=set)
    started: bool = False
    handle: dist.Work | None = None
    scatter_out: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, rank: int, size: int) -> tuple[int, int]:
        """Buffer offsets ``[lo, hi)`` of data-parallel rank ``rank``'s shard of this bucket."""
        n = self.numel // size
        return self.start + rank * n, self.start + (rank + 1) * n


class GradBuffer:
    """One fp32 gradient buffer (and, for the distributed optimizer, one parameter buffer) for ``params``."""

    def __init__(
        self,
        params: list[nn.Parameter],
        group: Group,
        bucket_size: int | None,
        distributed_optimizer: bool,
        device: torch.device,
    ) -> None:
        self.params, self.group, self.distributed_optimizer = params, group, distributed_optimizer
        self.param_dtype = params[0].dtype
        self.dp = max(group.size, 1)
        pad = self.dp if distributed_optimizer else 1
        self.ranges: dict[nn.Parameter, tuple[int, int]] = {}
        spans: list[tuple[list[nn.Parameter], int, int, bool]] = []
        current: list[nn.Parameter] = []
        offset, bucket_start = 0, 0

        def close(deferred: bool = False) -> None:
            nonlocal offset, current, bucket_start
            if current:
                end = -(-offset // pad) * pad
                spans.append((current, bucket_start, end, deferred))
                offset, current, bucket_start = end, [], end

        for p in params:
            shared = getattr(p, "shared_embedding", False)
            if shared:
                close()
            self.ranges[p] = (offset, offset + p.numel())
            offset += p.numel()
            current.append(p)
            if shared or (bucket_size is not None and offset - bucket_start >= bucket_size):
                close(deferred=shared)
        close()
        self.numel = offset
        self.grad_data = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.param_data: torch.Tensor | None = None
        if distributed_optimizer:
            self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=device)
        for p, (s, e) in self.ranges.items():
            p.main_grad = self.grad_data[s:e].view(p.shape)  # type: ignore[attr-defined]
            if self.param_data is not None:
                self.param_data[s:e].copy_(p.data.reshape(-1))
                p.data = self.param_data[s:e].view(p.shape)
        self.buckets = [
            Bucket(
                i,
                ps,
                s,
                e,
                self.grad_data[s:e],
                None if self.param_data is None else self.param_data[s:e],
                deferred,
            )
            for i, (ps, s, e, deferred) in enumerate(spans)
        ]
        self.bucket_of = {p: b for b in self.buckets for p in b.params}

    # ------------------------------------------------------------------------------------------- gradients
    def start_grad_reduce(self, bucket: Bucket) -> None:
        """Scale by ``1/dp`` and launch the bucket's asynchronous all-reduce (or reduce-scatter)."""
        if bucket.started:
            return
        bucket.started = True
        if self.dp == 1 or self.group.pg is None:
            return
        bucket.grad.mul_(1.0 / self.dp)
        if self.distributed_optimizer:
            bucket.scatter_out = torch.empty(
                bucket.numel // self.dp, dtype=bucket.grad.dtype, device=bucket.grad.device
            )
            bucket.handle = _reduce_scatter_single(bucket.scatter_out, bucket.grad, group=self.group.pg, async_op=True)
        else:
            bucket.handle = dist.all_reduce(bucket.grad, group=self.group.pg, async_op=True)

    def wait_grad_reduce(self, bucket: Bucket) -> None:
        if not bucket.started:
            raise RuntimeError(f"internal error: bucket {bucket.index} waited on before its reduction started")
        if bucket.handle is not None:
            bucket.handle.wait()
            bucket.handle = None
        if bucket.scatter_out is not None:
            lo, hi = bucket.shard_range(self.group.rank, self.dp)
            self.grad_data[lo:hi].copy_(bucket.scatter_out)
            bucket.scatter_out = None

    def reset(self) -> None:
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
            b.ready.clear()
            b.started, b.handle, b.scatter_out = False, None, None

    # ------------------------------------------------------------------------------------------- parameters
    def all_gather_params(self) -> None:
        """After each rank updated its shard of ``param_data``, gather every bucket's shards in place."""
        if self.param_data is None or self.dp == 1 or self.group.pg is None:
            return
        handles = []
        for b in self.buckets:
            assert b.param_data is not None
            lo, hi = b.shard_range(self.group.rank, self.dp)
            mine = self.param_data[lo:hi].clone()
            handles.append(_all_gather_single(b.param_data, mine, group=self.group.pg, async_op=True))
        for h in handles:
            h.wait()
