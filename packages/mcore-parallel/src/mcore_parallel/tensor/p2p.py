"""mcore's own sequence-parallel exchange for the GPUs of one host: peer-to-peer copies out of buffers that every rank
of the tensor-parallel group can address, one barrier per exchange.

PyTorch's fused ops (``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``) use one
workspace per group and synchronise each call with three barriers (one before the local shard is copied into the
workspace, one after, one at the end) and copy the local shard twice on the compute stream (into the workspace and
into the gathered output). At tp2 on 2x H200 the barriers and those copies sat on the critical path of every
sequence-parallel linear. Here the workspace has two slots used by alternate exchanges, which makes one barrier per
exchange enough:

* an exchange writes only its own slot of this rank's workspace, and only after the barrier of the previous exchange;
* every read of a peer's slot ends (the compute stream waits for it) before this rank's next barrier;
* so when an exchange writes slot ``k % 2``, every peer has passed the barrier of exchange ``k - 1``, which follows
  its reads of slot ``k % 2`` in exchange ``k - 2``.

All-gather then matmul (``gather_matmul``): copy the local rows into the slot, barrier, then the peers' rows are
pulled on a side stream (copy engines, no SMs) while the local rows are multiplied; each peer's rows are multiplied
as they arrive. The local rows are copied into the gathered output on the side stream, beside the last GEMM.

Matmul then reduce-scatter (``matmul_scatter``): the rows bound for each peer are multiplied straight into the slot,
barrier, then each peer's partial sums for this rank's rows are pulled while this rank's own rows are multiplied,
and added.

The exchange itself only needs addressable buffers and a barrier: on CUDA these are PyTorch's symmetric memory
(``torch.distributed._symmetric_memory``); on CPU (tests, gloo) they are shared-memory files mapped by every rank of
the group and the barrier is the process group's, so the same protocol is tested multi-process without GPUs.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from mcore_parallel.state import Group

__all__ = ["PeerBuffer", "PeerWorkspace", "gather_matmul", "matmul_scatter", "symmetric_bytes"]

_ALIGN = 256  # bytes: every slot starts aligned for any dtype and for vectorised copies


# CUDA device index -> bytes of the live symmetric buffers made here (PyTorch's allocator statistics do not see them)
_SYMMETRIC_BYTES: dict[int, int] = {}


def symmetric_bytes(device: torch.device) -> int:
    """Bytes of this process's live peer buffers and workspaces on CUDA ``device`` (outside PyTorch's caching
    allocator, so not in ``torch.cuda.max_memory_allocated``)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _SYMMETRIC_BYTES.get(index, 0)


def _count(device: torch.device, nbytes: int) -> None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    _SYMMETRIC_BYTES[index] = _SYMMETRIC_BYTES.get(index, 0) + nbytes


def _shared_files(group: Group, nbytes: int) -> list[torch.Tensor]:
    """Every rank's ``nbytes``-byte shared-memory file of a new buffer, mapped in this process (collective; CPU)."""
    pg = group.pg
    token = [uuid.uuid4().hex if group.rank == 0 else ""]
    dist.broadcast_object_list(token, src=group.ranks[0], group=pg)
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    paths = [os.path.join(root, f"mcore-p2p-{token[0]}-{r}") for r in range(group.size)]
    mine = torch.from_file(paths[group.rank], shared=True, size=nbytes, dtype=torch.uint8)
    dist.barrier(group=pg)  # every file exists
    files = [mine if r == group.rank else torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8)
             for r, p in enumerate(paths)]  # fmt: skip
    dist.barrier(group=pg)  # every rank has mapped every file: the names can go
    os.unlink(paths[group.rank])
    return files


class PeerBuffer:
    """``numel`` elements of ``dtype`` on every rank of ``group``, each rank's readable by every other: symmetric
    memory on CUDA (peer-to-peer copies out of it run on the copy engines), shared-memory files on CPU. Allocation is
    collective. ``local`` is this rank's tensor, ``peer(r)`` group rank ``r``'s."""

    def __init__(self, group: Group, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        if group.pg is None or group.size < 2:
            raise ValueError(f"a peer buffer needs a process group of at least 2 ranks (the {group.kind} group)")
        self.group = group
        self._handle: Any = None
        if device.type == "cuda":
            from torch.distributed import _symmetric_memory as symm

            name = group.pg.group_name
            symm.enable_symm_mem_for_group(name)
            with torch.cuda.device(device):
                local = symm._SymmetricMemory.empty_strided_p2p((numel,), [1], dtype, device, name)
                self._handle = symm._SymmetricMemory.rendezvous(local)
            self._peers = [local if r == group.rank else self._handle.get_buffer(r, [numel], dtype, 0)
                           for r in range(group.size)]  # fmt: skip
            nbytes = numel * local.element_size()
            _count(device, nbytes)
            weakref.finalize(self, _count, device, -nbytes)
        else:
            elt = torch.empty((), dtype=dtype).element_size()
            self._peers = [f.view(dtype)[:numel] for f in _shared_files(group, max(numel, 1) * elt)]
        self.local = self._peers[group.rank]

    def peer(self, rank: int) -> torch.Tensor:
        return self._peers[rank]

    def barrier(self) -> None:
        """Every rank of the group has reached this point of its current stream (CUDA) or program (CPU)."""
        if self._handle is not None:
            self._handle.barrier(channel=0)
        else:
            dist.barrier(group=self.group.pg)


class PeerWorkspace:
    """Two equal slots of this rank's exchange buffer, readable by every rank of ``group``.

    ``chunks``: each peer's rows are pulled in this many pieces, so that the GEMM (or the add) of one piece runs while
    the next arrives. Every rank must make the same calls in the same order (they are collective where the buffer grows); the
    sequence-parallel linears do, since every rank of a tensor-parallel group runs the same layers.
    """

    def __init__(self, group: Group, chunks: int = 2) -> None:
        if group.pg is None or group.size < 2:
            raise ValueError(f"a peer workspace needs a process group of at least 2 ranks (the {group.kind} group)")
        self.group = group
        self.rank = group.rank
        self.size = group.size
        self.slot_bytes = 0
        self.exchanges = 0  # exchanges so far: the next one uses slot ``exchanges % 2``
        self.chunks = chunks
        self._views: dict[tuple[Any, ...], torch.Tensor] = {}
        self._buffer: PeerBuffer | None = None  # both slots, as bytes
        self._side: torch.cuda.Stream | None = None

    # -- the buffer -------------------------------------------------------------------------------------------------
    def reserve(self, nbytes: int, device: torch.device) -> None:
        """Make each slot at least ``nbytes`` long (collective when it grows)."""
        if nbytes <= self.slot_bytes:
            return
        slot = -(-nbytes // _ALIGN) * _ALIGN
        if device.type == "cuda":
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"the peer workspace of the {self.group.kind} group must grow to {2 * slot} bytes during CUDA "
                    "graph capture; run one step before capturing"
                )
            # the old buffer may still be read by in-flight exchanges (the side stream's work is ordered before the
            # compute stream's through the wait at the end of every exchange)
            torch.cuda.current_stream(device).synchronize()
        self._views.clear()
        self._buffer = None  # freed before the larger one is made
        self._buffer = PeerBuffer(self.group, 2 * slot, torch.uint8, device)
        self.slot_bytes = slot

    def view(self, rank: int, slot: int, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """``shape`` elements of ``dtype`` at element ``offset`` of ``rank``'s slot ``slot`` (cached views)."""
        key = (rank, slot, offset, tuple(shape), dtype)
        t = self._views.get(key)
        if t is None:
            assert self._buffer is not None, "reserve() first"
            elt = torch.empty((), dtype=dtype).element_size()
            n = 1
            for d in shape:
                n *= d
            if (offset + n) * elt > self.slot_bytes:
                raise AssertionError(f"view of {n} x {dtype} at {offset} overruns a slot of {self.slot_bytes} bytes")
            start = slot * self.slot_bytes + offset * elt  # slots are _ALIGN-aligned: a multiple of any element size
            t = self._buffer.peer(rank)[start : start + n * elt].view(dtype).view(shape)
            self._views[key] = t
        return t

    def next_slot(self) -> int:
        slot = self.exchanges % 2
        self.exchanges += 1
        return slot

    def barrier(self) -> None:
        """Every rank has enqueued (CUDA: executed) everything before this point on its compute stream."""
        assert self._buffer is not None, "reserve() first"
        self._buffer.barrier()

    # -- streams ----------------------------------------------------------------------------------------------------
    def side_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(device=device)
        return self._side


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """``torch.cuda.stream(stream)``, or nothing for ``None`` (CPU)."""
    if stream is None:
        yield
    else:
        with torch.cuda.stream(stream):
            yield


def _wait(waiter: torch.cuda.Stream | None, stream: torch.cuda.Stream | None) -> None:
    if waiter is not None and stream is not None:
        waiter.wait_stream(stream)


def _pieces(m: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` row ranges covering ``range(m)`` (fewer when ``m`` is small)."""
    bounds = sorted({m * i // chunks for i in range(chunks + 1)})
    return list(itertools.pairwise(bounds))


def gather_matmul(ws: PeerWorkspace, x: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(full, full @ b)`` with ``full`` the group's rows of ``x`` gathered in rank order: ``x`` is this rank's
    ``[m, k]`` rows (contiguous), ``b`` a ``[k, n]`` matrix (any strides ``torch.mm`` takes). Each peer's rows
    arrive in ``ws.chunks`` pieces, each multiplied as soon as it is here."""
    n_ranks, me, m = ws.size, ws.rank, x.shape[0]
    ws.reserve(x.numel() * x.element_size(), x.device)
    slot = ws.next_slot()
    ws.view(me, slot, 0, x.shape, x.dtype).copy_(x)
    ws.barrier()
    full = torch.empty((n_ranks * m, x.shape[1]), dtype=x.dtype, device=x.device)
    y = torch.empty((n_ranks * m, b.shape[1]), dtype=x.dtype, device=x.device)
    current = torch.cuda.current_stream(x.device) if x.device.type == "cuda" else None
    side = ws.side_stream(x.device)
    _wait(side, current)
    rows = [(r * m + lo, r * m + hi) for r in ((me + i) % n_ranks for i in range(1, n_ranks))
            for lo, hi in _pieces(m, ws.chunks)]  # fmt: skip
    arrived = []
    with on_stream(side):
        for lo, hi in rows:
            r = lo // m
            full[lo:hi].copy_(ws.view(r, slot, (lo - r * m) * x.shape[1], torch.Size((hi - lo, x.shape[1])), x.dtype))
            if side is not None:
                arrived.append(side.record_event())
    torch.mm(x, b, out=y[me * m : (me + 1) * m])
    for i, (lo, hi) in enumerate(rows):
        if current is not None:
            current.wait_event(arrived[i])
        torch.mm(full[lo:hi], b, out=y[lo:hi])
    with on_stream(side):
        full[me * m : (me + 1) * m].copy_(x)  # for the weight gradient, beside the last GEMMs
    _wait(current, side)  # the peers' slots are read and x is copied before anything else on this stream
    return full, y


def matmul_scatter(ws: PeerWorkspace, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``sum over ranks (a @ b)``: ``a`` is ``[size * m, k]`` (contiguous), every rank's
    ``m`` rows in rank order; the result is ``[m, n]``. Each peer's partial sums arrive in ``ws.chunks`` pieces,
    each added as soon as it is here."""
    n_ranks, me = ws.size, ws.rank
    if a.shape[0] % n_ranks:
        raise ValueError(f"dimension 0 of size {a.shape[0]} is not divisible by the group size {n_ranks}")
    m, n = a.shape[0] // n_ranks, b.shape[1]
    shape = torch.Size((m, n))
    ws.reserve(n_ranks * m * n * a.element_size(), a.device)
    slot = ws.next_slot()
    peers = [(me + step) % n_ranks for step in range(1, n_ranks)]
    for r in peers:  # the partial sums bound for each peer, straight into this rank's slot
        torch.mm(a[r * m : (r + 1) * m], b, out=ws.view(me, slot, r * m * n, shape, a.dtype))
    ws.barrier()
    current = torch.cuda.current_stream(a.device) if a.device.type == "cuda" else None
    side = ws.side_stream(a.device)
    pulled = torch.empty((len(peers), m, n), dtype=a.dtype, device=a.device)
    pieces = [(i, lo, hi) for i in range(len(peers)) for lo, hi in _pieces(m, ws.chunks)]
    arrived = []
    _wait(side, current)
    with on_stream(side):
        for i, lo, hi in pieces:
            src = ws.view(peers[i], slot, (me * m + lo) * n, torch.Size((hi - lo, n)), a.dtype)
            pulled[i, lo:hi].copy_(src)
            if side is not None:
                arrived.append(side.record_event())
    y = torch.mm(a[me * m : (me + 1) * m], b)
    for k, (i, lo, hi) in enumerate(pieces):
        if current is not None:
            current.wait_event(arrived[k])
        y[lo:hi].add_(pulled[i, lo:hi])
    _wait(current, side)
    return y
