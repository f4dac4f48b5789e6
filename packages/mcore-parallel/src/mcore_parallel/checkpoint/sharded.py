"""Sharded, reshardable checkpoints: every tensor one zarr v3 array in its global shape, written by all ranks.

Layout of one checkpoint directory::

    zarr.json                          group; attributes = the caller's metadata + format version
    model/<key>/zarr.json, c/...        one array per model parameter (global, unsharded, unpadded shape)
    optimizer/<key>/<state>/...         fp32 master weights and moments (``master``, ``exp_avg``, ...)
    rank_state/rank_00000.pt            per-rank state (RNG streams), torch.save

Who writes what: a TP-split parameter is written by the TP ranks that own its pieces, each piece one chunk (the
chunk grid follows the saving layout's TP split); a parameter replicated over data-parallel ranks is written by one of
them, chosen by a hash of its name so the write load spreads over the dp ranks; replicas (a last stage's copy of a
tied embedding) are not written. Under the distributed optimizer each dp rank holds a flat slice of a parameter's
optimizer state; the slices are summed (``reduce``) onto that parameter's writer first.

Expert-parallel parameters are global arrays ``[num_experts, ...]``: each expert-parallel rank writes the chunks of
its experts (and expert-TP piece), and among the ``expert_dp`` ranks holding identical copies the one chosen by the
same hash writes them (the optimizer slices are reduced over ``expert_dp``), so every element is written once.

Loading reads, for each piece a rank holds in the new layout, only the chunks that overlap it, so any TP/PP/DP
layout loads any other. Writes go to a temporary directory published by :mod:`mcore_parallel.checkpoint.manager`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mcore_parallel.checkpoint.zarr_io import (
    ArraySpec,
    CheckpointFormatError,
    Verify,
    check_chunk_file,
    chunk_path,
    read_array_spec,
    read_region,
    write_array_metadata,
    write_chunk,
    write_group_metadata,
)
from mcore_parallel.sharding import ShardedTensor, data_parallel_group
from mcore_parallel.state import Group, ParallelState

__all__ = [
    "StagingBuffer",
    "WriteJob",
    "plan_model_writes",
    "plan_optimizer_writes",
    "write_jobs",
    "load_model",
    "load_optimizer",
    "check_arrays",
    "model_arrays",
    "optimizer_arrays",
]

logger = logging.getLogger(__name__)
FORMAT_VERSION = 2  # 2: every chunk ends in a CRC-32C (the crc32c codec)
WRITE_THREADS = 4


@dataclass
class WriteJob:
    """Chunks of one array that this rank writes (tensors already on the CPU, so writing needs no GPU)."""

    path: str
    spec: ArraySpec
    write_metadata: bool
    chunks: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.chunks)


def writer_index(key: str, group: Group) -> int:
    """Which member of ``group`` (e.g. the data-parallel ranks holding identical copies) writes ``key``."""
    return zlib.crc32(key.encode()) % group.size


def _chunk_index(global_idx: tuple[slice, ...], chunk_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple((s.start or 0) // c for s, c in zip(global_idx, chunk_shape))


def _host(t: torch.Tensor, to_host: bool) -> torch.Tensor:
    """``t`` on the CPU (a copy of a GPU tensor, CPU tensors as they are), or ``t`` itself wherever it lives when
    ``to_host`` is False (an async save then copies every chunk into its :class:`StagingBuffer`)."""
    if not to_host or t.device.type == "cpu":
        return t.detach()
    return t.detach().cpu()


class StagingBuffer:
    """Host memory that every async save copies its chunks into, kept from one save to the next.

    One flat buffer of exactly the bytes a save needs (pinned when the tensors are on a GPU, so the copies are
    asynchronous DMA), allocated on the first save and grown only if a later save needs more: saves after the first
    neither allocate nor touch fresh pages, which is most of a snapshot's cost. The caller must not stage a new save
    while a writer still reads the previous one (:class:`CheckpointManager` waits first).
    """

    ALIGN = 256

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._pinned = False
        self._reserving: threading.Thread | None = None
        self._reserve_error: BaseException | None = None

    @property
    def nbytes(self) -> int:
        self._join()
        return 0 if self._buffer is None else self._buffer.numel()

    def _aligned(self, n: int) -> int:
        return (n + self.ALIGN - 1) // self.ALIGN * self.ALIGN

    def _needs(self, jobs: list[WriteJob]) -> tuple[int, bool]:
        tensors = [t for job in jobs for _, t in job.chunks]
        return sum(self._aligned(t.numel() * t.element_size()) for t in tensors), any(t.is_cuda for t in tensors)

    def _fits(self, total: int, pin: bool) -> bool:
        return self._buffer is not None and self._buffer.numel() >= total and self._pinned == pin

    def _allocate(self, total: int, pin: bool, touch: bool) -> None:
        self._buffer = None  # release the old buffer before taking the new one
        buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
        if touch and not pin:  # fault every page in now (pinned pages are resident already)
            buffer.zero_()
        self._buffer, self._pinned = buffer, pin
        logger.info("checkpoint staging buffer: %.2f GB of %s host memory", total / 1e9,
                    "pinned" if pin else "pageable")  # fmt: skip

    def _join(self) -> None:
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None
            if self._reserve_error is not None:
                error, self._reserve_error = self._reserve_error, None
                raise RuntimeError("allocating the checkpoint staging buffer failed") from error

    def reserve(self, jobs: list[WriteJob]) -> None:
        """Allocate (in a background thread) the buffer a later :meth:`stage` of jobs like these needs, so that the
        first async save of a run does not pay for it: pinning the host memory of a large training state takes
        seconds. The next :meth:`stage` waits for the allocation if it is still running."""
        total, pin = self._needs(jobs)
        self._join()
        if self._fits(total, pin):
            return

        def allocate() -> None:
            try:
                self._allocate(total, pin, touch=True)
            except BaseException as e:  # re-raised by the next stage()
                self._reserve_error = e

        self._reserving = threading.Thread(target=allocate, name="mcore-ckpt-staging", daemon=True)
        self._reserving.start()

    def stage(self, jobs: list[WriteJob]) -> None:
        """Replace every chunk of ``jobs`` by its copy in the buffer (returns once the copies have landed)."""
        self._join()
        total, pin = self._needs(jobs)
        if not self._fits(total, pin):
            self._allocate(total, pin, touch=False)
        assert self._buffer is not None
        offset = 0
        for job in jobs:
            for i, (index, t) in enumerate(job.chunks):
                n = t.numel() * t.element_size()
                dst = self._buffer[offset : offset + n].view(t.dtype).view(t.shape)
                dst.copy_(t, non_blocking=pin and t.is_cuda)
                job.chunks[i] = (index, dst)
                offset += self._aligned(n)
        if pin:
            torch.cuda.synchronize()  # every device-to-host copy has landed


def _jobs_for(
    path: str,
    info: ShardedTensor,
    local: torch.Tensor,
    write: bool,
    attributes: dict[str, Any] | None = None,
    to_host: bool = True,
) -> WriteJob | None:
    """The chunks of ``local`` (laid out like ``info.local``) that this rank writes into array ``path``."""
    if not write or info.replica:
        return None
    chunk_shape = info.chunk_shape or info.global_shape
    spec = ArraySpec(info.global_shape, local.dtype, tuple(max(c, 1) for c in chunk_shape))
    job = WriteJob(path, spec, write_metadata=False, attributes=attributes or {})
    for local_idx, global_idx in info.pieces:
        index = _chunk_index(global_idx, spec.chunk_shape)
        job.chunks.append((index, _host(local[local_idx], to_host)))
        job.write_metadata |= all(i == 0 for i in index)
    return job if job.chunks else None


def plan_model_writes(items: Mapping[str, ShardedTensor], state: ParallelState, to_host: bool = True) -> list[WriteJob]:
    """This rank's share of writing the model parameters ``items`` (from ``model.sharded_state_dict()``).

    ``to_host=False`` leaves the chunks where they are (views of the live tensors) for a :class:`StagingBuffer`.
    """
    jobs = []
    for info in items.values():
        group = data_parallel_group(info, state)
        write = group.rank == writer_index(info.key, group)
        job = _jobs_for(f"model/{info.key}", info, info.local, write, {"kind": "parameter"}, to_host)
        if job is not None:
            jobs.append(job)
    return jobs


def _optimizer_state_keys(optimizer: Any) -> list[str]:
    kind = getattr(getattr(optimizer, "config", None), "optimizer", "adam")
    return ["master", "momentum_buffer"] if kind == "sgd" else ["master", "exp_avg", "exp_avg_sq"]


def _params_by_identity(items: Mapping[str, ShardedTensor]) -> dict[int, ShardedTensor]:
    return {id(info.local): info for info in items.values()}


def plan_optimizer_writes(
    optimizer: Any, items: Mapping[str, ShardedTensor], state: ParallelState, to_host: bool = True
) -> list[WriteJob]:
    """This rank's share of writing master weights and moments of ``optimizer`` (a mcore_parallel optimizer).

    Collective over the data-parallel groups (``dp_cp``; ``expert_dp`` for expert parameters) when the optimizer is
    distributed: every rank must call it.
    """
    from mcore_parallel.optim import DistributedOptimizer

    by_id = _params_by_identity(items)
    entries = {id(e.param): e for e in optimizer.sharded_state()}
    keys = _optimizer_state_keys(optimizer)
    jobs = []
    for _, param in _optimizer_params(optimizer):
        info = by_id.get(id(param))
        if info is None:
            raise CheckpointFormatError("an optimizer parameter is missing from the model's sharded_state_dict()")
        group = data_parallel_group(info, state)
        writer = writer_index(info.key, group)
        entry = entries.get(id(param))
        if isinstance(optimizer, DistributedOptimizer) and group.size > 1:
            stacked = torch.zeros((len(keys), param.numel()), dtype=torch.float32, device=param.device)
            if entry is not None and entry.tensors:
                lo, hi = entry.flat_range
                for i, k in enumerate(keys):
                    if k in entry.tensors:
                        stacked[i, lo:hi] = entry.tensors[k].float()
            dist.reduce(stacked, dst=group.ranks[writer], group=group.pg)
            if group.rank != writer or info.replica:
                continue
            full = {k: stacked[i].view(param.shape) for i, k in enumerate(keys)}
        else:
            if group.rank != writer or info.replica or entry is None:
                continue
            full = {k: entry.tensors[k].view(param.shape) for k in keys if k in entry.tensors}
        for k, tensor in full.items():
            job = _jobs_for(f"optimizer/{info.key}/{k}", info, tensor, True, {"kind": k}, to_host)
            if job is not None:
                jobs.append(job)
    return jobs


def _optimizer_params(optimizer: Any) -> list[tuple[str, torch.nn.Parameter]]:
    from mcore_parallel.optim import named_trainable_params

    return named_trainable_params(optimizer.chunks)


def write_jobs(root: Path, jobs: list[WriteJob], threads: int = WRITE_THREADS) -> int:
    """Write the chunks (and, where this rank owns chunk 0, the array metadata). Returns bytes written.

    Chunks are written by a small thread pool (file writes release the GIL), which keeps several writes in flight.
    """
    groups: set[Path] = set()
    work: list[tuple[Path, ArraySpec, tuple[int, ...], torch.Tensor]] = []
    for job in jobs:
        array_dir = root / job.path
        if job.write_metadata:
            write_array_metadata(array_dir, job.spec, job.attributes)
            if job.path.startswith("optimizer/"):
                groups.add(array_dir.parent)
        work.extend((array_dir, job.spec, index, tensor) for index, tensor in job.chunks)
    work.sort(key=lambda w: -w[3].numel())  # big chunks first: better balance across threads

    def write_one(w: tuple[Path, ArraySpec, tuple[int, ...], torch.Tensor]) -> int:
        return write_chunk(*w)

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        total = sum(list(pool.map(write_one, work)))
    for g in groups:
        if not (g / "zarr.json").exists():
            write_group_metadata(g)
    return total


class BackgroundWriter:
    """Writes jobs on a thread (files only: no collectives), so training continues during an async save."""

    def __init__(self, root: Path, jobs: list[WriteJob]) -> None:
        self.root, self.jobs = root, jobs
        self.error: BaseException | None = None
        self.bytes = 0
        self._thread = threading.Thread(target=self._run, name="mcore-checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.bytes = write_jobs(self.root, self.jobs)
        except BaseException as e:  # reported to the caller by wait()
            self.error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> int:
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.bytes


# ------------------------------------------------------------------------------------------------------ load
def _shape_problem(array_dir: Path, spec: ArraySpec, info: ShardedTensor) -> str | None:
    if spec.shape == info.global_shape:
        return None
    return (
        f"{array_dir}: saved shape {spec.shape} does not match the model's global shape {info.global_shape} "
        f"for {info.key!r} (a different architecture?)"
    )


def _chunks_read(spec: ArraySpec, info: ShardedTensor) -> list[tuple[int, ...]]:
    """The chunks of an array that loading ``info``'s pieces reads (each rank stats only its own)."""
    found: set[tuple[int, ...]] = set()
    for _, global_idx in info.pieces:
        ranges = []
        for d, (sl, c) in enumerate(zip(global_idx, spec.chunk_shape)):
            a, b = sl.start or 0, spec.shape[d] if sl.stop is None else sl.stop
            ranges.append(range(a // c, -(-b // c)) if b > a else range(0))
        found.update(itertools.product(*ranges))
    return sorted(found)


def check_arrays(
    root: Path, arrays: Mapping[str, ShardedTensor], allow_missing: bool = False
) -> tuple[dict[str, ArraySpec], list[str]]:
    """Read the metadata of every array in ``arrays`` (path inside ``root`` -> the tensor it loads into) and stat
    each chunk the load reads; raises one :class:`CheckpointFormatError` listing every missing or bad array and chunk file.

    Returns the specs and, with ``allow_missing``, the arrays that have no ``zarr.json`` (instead of raising)."""
    specs: dict[str, ArraySpec] = {}
    missing: list[str] = []
    problems: list[str] = []
    for name, info in arrays.items():
        array_dir = root / name
        if not (array_dir / "zarr.json").exists():
            missing.append(name)
            if not (allow_missing or info.optional):
                problems.append(f"{array_dir / 'zarr.json'}: missing (no saved tensor for {info.key!r})")
            continue
        try:
            spec = read_array_spec(array_dir)
        except CheckpointFormatError as e:
            problems.append(str(e))
            continue
        shape = _shape_problem(array_dir, spec, info)
        if shape is not None:
            problems.append(shape)
            continue
        chunk_problems = [check_chunk_file(chunk_path(array_dir, i), spec) for i in _chunks_read(spec, info)]
        problems += [c for c in chunk_problems if c is not None]
        specs[name] = spec
    if problems:
        if len(problems) == 1:
            raise CheckpointFormatError(problems[0])
        raise CheckpointFormatError.collected(f"{root}: damaged or incomplete checkpoint", problems)
    return specs, missing


def _read_piece(
    array_dir: Path, info: ShardedTensor, dest: torch.Tensor, spec: ArraySpec | None = None, verify: Verify = True
) -> None:
    spec = spec or read_array_spec(array_dir)
    shape = _shape_problem(array_dir, spec, info)
    if shape is not None:
        raise CheckpointFormatError(shape)
    with torch.no_grad():
        for local_idx, global_idx in info.pieces:
            dest[local_idx].copy_(read_region(array_dir, global_idx, spec, verify).to(dest.dtype))


def model_arrays(items: Mapping[str, ShardedTensor]) -> dict[str, ShardedTensor]:
    return {f"model/{info.key}": info for info in items.values()}


def load_model(
    root: Path,
    items: Mapping[str, ShardedTensor],
    strict: bool = True,
    verify: Verify = True,
    checked: Mapping[str, ArraySpec] | None = None,
) -> list[str]:
    """Fill every parameter in ``items`` from checkpoint ``root`` (any saving layout). Returns missing keys (an
    ``optional`` item the checkpoint lacks is left as it is and not reported).

    Every array's metadata and chunk files are checked before any tensor is touched (``checked``: the specs that a
    :func:`check_arrays` of these arrays returned already)."""
    arrays = model_arrays(items)
    if checked is None:
        specs, missing_arrays = check_arrays(root, arrays, allow_missing=True)
    else:
        specs = {n: checked[n] for n in arrays if n in checked}
        missing_arrays = [n for n in arrays if n not in checked]
    missing = sorted({arrays[m].key for m in missing_arrays if not arrays[m].optional})
    if strict and missing:
        raise CheckpointFormatError(f"{root}: no saved tensor for {missing}")
    for name, spec in specs.items():
        info = arrays[name]
        _read_piece(root / name, info, info.local, spec, verify)
    return missing


def optimizer_arrays(root: Path, optimizer: Any, items: Mapping[str, ShardedTensor]) -> dict[str, ShardedTensor]:
    """The optimizer arrays a load of ``optimizer`` reads: for every parameter it trains, ``master`` and every
    state (``exp_avg``, ...) that any parameter of the checkpoint has."""
    by_id = _params_by_identity(items)
    infos = {}
    for entry in optimizer.sharded_state():
        info = by_id.get(id(entry.param))
        if info is None:
            raise CheckpointFormatError(
                f"optimizer parameter {entry.name!r} is missing from the model's sharded_state_dict()"
            )
        infos[info.key] = info
    states = {"master"}
    for key in infos:
        group = root / "optimizer" / key
        if group.is_dir():
            states |= {p.name for p in group.iterdir() if p.is_dir()}
    return {f"optimizer/{key}/{k}": info for key, info in infos.items() for k in sorted(states)}


def _read_local(
    root: Path, array: str, info: ShardedTensor, local_shape: tuple[int, ...], spec: ArraySpec, verify: Verify
) -> torch.Tensor:
    """This rank's TP piece (shaped like the local parameter) of a saved global array; only its chunks are read."""
    array_dir = root / array
    if len(info.pieces) == 1 and all(s.stop - s.start == n for s, n in zip(info.pieces[0][0], local_shape)):
        return read_region(array_dir, info.pieces[0][1], spec, verify)  # the piece is the whole local tensor
    local = torch.zeros(local_shape, dtype=spec.dtype)
    view = ShardedTensor(info.key, local, info.global_shape, info.pieces)
    _read_piece(array_dir, view, local, spec, verify)
    return local


def load_optimizer(
    root: Path,
    optimizer: Any,
    items: Mapping[str, ShardedTensor],
    step: int,
    verify: Verify = True,
    checked: Mapping[str, ArraySpec] | None = None,
    agree: Callable[[BaseException | None], None] | None = None,
) -> None:
    """Load master weights and moments saved under any layout into ``optimizer`` (which also updates the model).

    Each rank reads only the chunks overlapping its tensor-parallel piece of each parameter and keeps its flat range.
    Every array's metadata and chunk files are checked before any tensor is touched. ``agree(error)`` is called on
    every rank once its reads are done (``error``: what this rank's reads raised, or None), before the optimizer's
    own collectives; it raises to stop every rank when any failed (``CheckpointManager.load``'s)."""
    by_id = _params_by_identity(items)
    arrays = optimizer_arrays(root, optimizer, items)
    specs = {n: checked[n] for n in arrays} if checked is not None else check_arrays(root, arrays)[0]

    def pieces(entry: Any) -> dict[str, torch.Tensor]:
        info = by_id[id(entry.param)]
        lo, hi = entry.flat_range
        out = {}
        prefix = f"optimizer/{info.key}/"
        for name in (n for n in specs if n.startswith(prefix) and "/" not in n[len(prefix) :]):
            local = _read_local(root, name, info, entry.local_shape, specs[name], verify)
            out[name[len(prefix) :]] = local.reshape(-1)[lo:hi]
        return out

    optimizer.load_flat_state(pieces, step, agree=agree)
