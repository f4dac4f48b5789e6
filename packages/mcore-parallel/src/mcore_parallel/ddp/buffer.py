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

Gradients are multiplied by ``scale`` (default ``1/dp``) *before* the collective (a sum), so the default result is the
data-parallel mean and low-precision collectives would not overflow. Expert-parallel buffers reduce over
``expert_dp`` with ``scale = 1/dp_cp`` (see :class:`~mcore_parallel.ddp.DistributedDataParallel`); the factor is
applied even when the group has one member.

``exchange="p2p"`` (GPUs of one host with peer access; CPU for tests) replaces the NCCL collectives by peer-to-peer
copies: both buffers live in symmetric memory (:class:`~mcore_parallel.tensor.p2p.PeerBuffer`), and a bucket is
reduced on a side stream by a barrier, a pull of every peer's copy of this rank's range (copy engines, so it runs
beside the backward's GEMMs instead of waiting for SMs as NCCL's kernels do) and one pass that averages them into
this rank's range. The parameter all-gather pulls every peer's updated shard straight into place. A barrier after
the last bucket (``finish_p2p``) keeps a peer from reading a range this rank writes again (the sequence-parallel sums
over tp, zeroing, the next update).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mcore_parallel.state import Group
from mcore_parallel.tensor.p2p import PeerBuffer, on_stream

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
        exchange: str = "nccl",
        scale: float | None = None,
    ) -> None:
        self.params, self.group, self.distributed_optimizer = params, group, distributed_optimizer
        self.param_dtype = params[0].dtype
        self.dp = max(group.size, 1)
        self.scale = 1.0 / self.dp if scale is None else float(scale)
        """Factor applied to the gradients before they are summed over ``group`` (``1/dp``: the mean)."""
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
        self.p2p = exchange == "p2p" and self.dp > 1 and group.pg is not None
        self._peer_grads = self._peer_params = None
        self._side: torch.cuda.Stream | None = None
        self.param_data: torch.Tensor | None = None
        if self.p2p:
            self._peer_grads = PeerBuffer(group, self.numel, torch.float32, device)
            self.grad_data = self._peer_grads.local.zero_()
            if distributed_optimizer:
                self._peer_params = PeerBuffer(group, self.numel, self.param_dtype, device)
                self.param_data = self._peer_params.local.zero_()
            if device.type == "cuda":
                self._side = torch.cuda.Stream(device=device)
        else:
            self.grad_data = torch.zeros(self.numel, dtype=torch.float32, device=device)
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
        if self.p2p:  # the widest shard, for the pulls of the reduce-scatter (reused in order on the side stream)
            widest = max((b.numel // (self.dp if distributed_optimizer else 1) for b in self.buckets), default=0)
            self._scratch = torch.empty(widest, dtype=torch.float32, device=device)

    # ------------------------------------------------------------------------------------------- gradients
    def start_grad_reduce(self, bucket: Bucket) -> None:
        """Scale by ``scale`` and launch the bucket's asynchronous all-reduce (or reduce-scatter)."""
        if bucket.started:
            return
        bucket.started = True
        if self.dp == 1 or self.group.pg is None:
            if self.scale != 1.0:
                bucket.grad.mul_(self.scale)
            return
        if self.p2p:
            self._p2p_reduce(bucket)
            return
        bucket.grad.mul_(self.scale)
        if self.distributed_optimizer:
            bucket.scatter_out = torch.empty(
                bucket.numel // self.dp, dtype=bucket.grad.dtype, device=bucket.grad.device
            )
            bucket.handle = _reduce_scatter_single(bucket.scatter_out, bucket.grad, group=self.group.pg, async_op=True)
        else:
            bucket.handle = dist.all_reduce(bucket.grad, group=self.group.pg, async_op=True)

    def _p2p_reduce(self, bucket: Bucket) -> None:
        """The bucket's scaled data-parallel sum by peer-to-peer pulls, on the side stream (module docstring)."""
        assert self._peer_grads is not None
        me = self.group.rank
        lo, hi = bucket.shard_range(me, self.dp) if self.distributed_optimizer else (bucket.start, bucket.end)
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.grad_data.device))
        with on_stream(self._side):
            self._peer_grads.barrier()  # every rank's gradients of this bucket are complete
            mine, tmp = self.grad_data[lo:hi], self._scratch[: hi - lo]
            peers = [(me + i) % self.dp for i in range(1, self.dp)]
            if not self.distributed_optimizer:
                # every rank sums the same values in the same (rank) order, so the replicas stay bitwise equal; all
                # ranks read before any rank overwrites its range
                pulled = torch.stack([self._peer_grads.peer(r)[lo:hi] for r in range(self.dp)])
                self._peer_grads.barrier()
                torch.sum(pulled, 0, out=mine).mul_(self.scale)
            elif self.dp == 2 and self.scale == 0.5:
                tmp.copy_(self._peer_grads.peer(peers[0])[lo:hi])
                mine.lerp_(tmp, 0.5)  # (mine + tmp) / 2 in one pass
            else:
                for r in peers:
                    tmp.copy_(self._peer_grads.peer(r)[lo:hi])
                    mine.add_(tmp)
                mine.mul_(self.scale)

    def wait_grad_reduce(self, bucket: Bucket) -> None:
        if not bucket.started:
            raise RuntimeError(f"internal error: bucket {bucket.index} waited on before its reduction started")
        if self._side is not None:
            torch.cuda.current_stream(self.grad_data.device).wait_stream(self._side)
        if bucket.handle is not None:
            bucket.handle.wait()
            bucket.handle = None
        if bucket.scatter_out is not None:
            lo, hi = bucket.shard_range(self.group.rank, self.dp)
            self.grad_data[lo:hi].copy_(bucket.scatter_out)
            bucket.scatter_out = None

    def finish_p2p(self) -> None:
        """After every bucket's reduction was waited on: a barrier, after which no peer reads this rank's gradient
        buffer any more this step, so it may be written again (the sequence-parallel sums over tp write whole
        parameters, zeroing writes everything). It also orders the parameter pulls: a rank's next optimizer update
        comes after its next step's barrier, which every peer reaches only after pulling this step's parameters."""
        if self._peer_grads is not None:
            self._peer_grads.barrier()

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
        if self._peer_params is not None:
            self._peer_params.barrier()  # every rank has written its updated shard
            for b in self.buckets:
                for i in range(1, self.dp):
                    r = (self.group.rank + i) % self.dp
                    lo, hi = b.shard_range(r, self.dp)
                    self.param_data[lo:hi].copy_(self._peer_params.peer(r)[lo:hi])
            return
        handles = []
        for b in self.buckets:
            assert b.param_data is not None
            lo, hi = b.shard_range(self.group.rank, self.dp)
            mine = self.param_data[lo:hi].clone()
            handles.append(_all_gather_single(b.param_data, mine, group=self.group.pg, async_op=True))
        for h in handles:
            h.wait()
