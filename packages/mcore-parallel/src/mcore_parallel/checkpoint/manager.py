"""Publishing checkpoints atomically, keeping the last N, and saving asynchronously.

A save writes into ``<root>/.tmp.<name>``; once every rank has finished, rank 0 renames it to ``<root>/<name>``
and only then rewrites ``<root>/latest`` (itself via a temporary file and rename). A crash or ``kill -9`` at any
moment therefore leaves ``latest`` pointing at the previous complete checkpoint; a stale temporary directory is
removed by the next save. With ``async_save`` the tensors are copied during ``save`` into a host staging buffer that is
kept from save to save (pinned memory for GPU tensors: no allocation and no fresh pages after the first save), and written
by a background thread while training continues; ``poll()`` (call it every step: one tiny all-reduce) publishes the
checkpoint once every rank's writer is done, and ``wait()`` blocks until it is published.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mcore_parallel.checkpoint.sharded import (
    FORMAT_VERSION,
    BackgroundWriter,
    StagingBuffer,
    check_arrays,
    load_model,
    load_optimizer,
    model_arrays,
    optimizer_arrays,
    plan_model_writes,
    plan_optimizer_writes,
    write_jobs,
)
from mcore_parallel.checkpoint.zarr_io import ArraySpec, CheckpointFormatError, Verify, fsync_tree, write_group_metadata
from mcore_parallel.sharding import ShardedTensor
from mcore_parallel.state import ParallelState

__all__ = ["CheckpointManager", "SaveStats", "latest_checkpoint", "read_metadata"]

logger = logging.getLogger(__name__)
LATEST = "latest"


@dataclass
class SaveStats:
    name: str
    bytes_written: int = 0
    blocking_s: float = 0.0  # time the caller was blocked in save()
    total_s: float = 0.0  # from the start of save() until the checkpoint was published


def _is_plain_name(name: str) -> bool:
    return (
        0 < len(name) < 256 and name.isprintable() and "/" not in name and "\\" not in name
        and not name.startswith(".") and name != LATEST
    )  # fmt: skip


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``root/latest`` points at, or None when there is none yet."""
    root = Path(root)
    pointer = root / LATEST
    try:
        raw = pointer.read_bytes()
    except FileNotFoundError:
        return None
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        name = ""
    if not _is_plain_name(name):
        raise CheckpointFormatError(
            f"{pointer}: does not name a checkpoint directory (it holds {raw[:40]!r}); it should hold one name "
            "such as 'step_0000100' (write the name of a complete checkpoint into it, or delete it to start fresh)"
        )
    path = root / name
    if not (path / "zarr.json").exists():
        what = "does not exist" if not path.exists() else f"has no {path / 'zarr.json'}"
        raise CheckpointFormatError(f"{pointer} points at {name!r}, which is not a complete checkpoint ({what})")
    return path


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata (attributes of the root zarr group) of one checkpoint directory (format version checked)."""
    meta_path = Path(path) / "zarr.json"
    try:
        meta = json.loads(meta_path.read_text())
        attrs = meta["attributes"]
    except FileNotFoundError:
        raise CheckpointFormatError(f"{meta_path}: missing; {path} is not an mcore checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointFormatError(f"{meta_path}: not a zarr v3 group's metadata ({e!r})") from None
    if not isinstance(attrs, dict):
        raise CheckpointFormatError(f"{meta_path}: its attributes are not a JSON object")
    version = attrs.get("format_version", 0)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointFormatError(
            f"{meta_path}: checkpoint format version {version!r} is newer than this mcore knows ({FORMAT_VERSION}); "
            "upgrade mcore to load it"
        )
    return attrs


MANIFEST = "manifest.json"
"""Every array of a checkpoint (path, shape, zarr data type), from every rank's writes, written by rank 0 at save:
``mcore-train checkpoint verify`` reports an array that is listed there and missing."""


def _write_manifest(tmp: Path, jobs: list[Any], rank: int) -> None:
    """Gather the arrays every rank writes and write :data:`MANIFEST` (collective)."""
    mine = {job.path: {"shape": list(job.spec.shape), "data_type": job.spec.zarr_dtype} for job in jobs}
    gathered: list[Any] = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    if rank == 0:
        arrays: dict[str, Any] = {}
        for part in gathered:
            arrays.update(part)
        (tmp / MANIFEST).write_text(json.dumps({"arrays": dict(sorted(arrays.items()))}, indent=1) + "\n")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _all_done(done: bool, device: torch.device) -> bool:
    if not (dist.is_available() and dist.is_initialized()):
        return done
    flag = torch.tensor([1 if done else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class CheckpointManager:
    """Saves and loads sharded checkpoints under ``root`` for one parallel layout."""

    def __init__(
        self,
        root: str | Path,
        state: ParallelState,
        *,
        keep_last: int | None = None,
        async_save: bool = False,
        fsync: bool = False,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be at least 1 (or None to keep everything)")
        self.root, self.state = Path(root), state
        self.keep_last, self.async_save, self.fsync = keep_last, async_save, fsync
        self._pending: tuple[BackgroundWriter, str, SaveStats, float] | None = None
        self._staging = StagingBuffer()
        self.last_stats: SaveStats | None = None

    # ------------------------------------------------------------------------------------------------- save
    def save(
        self,
        name: str,
        model_items: Mapping[str, ShardedTensor],
        optimizer: Any = None,
        metadata: dict[str, Any] | None = None,
        rank_state: dict[str, Any] | None = None,
        extra_files: Mapping[str, str | Path] | None = None,
    ) -> None:
        """Save (collective: every rank calls it with its own items). Returns once the data is safe to change.

        ``extra_files`` maps a path inside the checkpoint to a file rank 0 copies there (e.g. the tokenizer).
        """
        if "/" in name or name.startswith(".") or name == LATEST:
            raise ValueError(f"checkpoint name {name!r} must be a plain directory name (e.g. 'step_000100')")
        self.wait()
        start = time.perf_counter()
        tmp = self.root / f".tmp.{name}"
        if self.state.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            attrs = {
                "format": "mcore-checkpoint",
                "format_version": FORMAT_VERSION,
                "name": name,
                "saved_layout": {
                    "world_size": self.state.world_size,
                    "tp": self.state.tp.size,
                    "pp": self.state.pp.size,
                    "dp": self.state.dp_size,
                    "cp": self.state.cp.size,
                    "ep": self.state.ep.size,
                },
                **(metadata or {}),
            }
            write_group_metadata(tmp, attrs)
            write_group_metadata(tmp / "model")
            write_group_metadata(tmp / "optimizer")
            for inside, source in (extra_files or {}).items():
                dest = tmp / inside
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, dest)
        _barrier()
        # async: chunks stay views of the live tensors until staged into the reused host buffer below
        to_host = not self.async_save
        jobs = plan_model_writes(model_items, self.state, to_host)
        if optimizer is not None:
            jobs += plan_optimizer_writes(optimizer, model_items, self.state, to_host)
        _write_manifest(tmp, jobs, self.state.rank)
        if rank_state is not None:
            (tmp / "rank_state").mkdir(exist_ok=True)
            torch.save(rank_state, tmp / "rank_state" / f"rank_{self.state.rank:05d}.pt")
        stats = SaveStats(name)
        if self.async_save:
            self._staging.stage(jobs)  # a snapshot the background writer owns: training may change the tensors
            self._pending = (BackgroundWriter(tmp, jobs), name, stats, start)
            stats.blocking_s = time.perf_counter() - start
        else:
            stats.bytes_written = write_jobs(tmp, jobs)
            stats.blocking_s = time.perf_counter() - start
            self._publish(name, stats, start)

    def reserve(self, model_items: Mapping[str, ShardedTensor], optimizer: Any = None) -> None:
        """Async managers: start allocating the host staging buffer that saves of these items need, in a background
        thread, so that the first save of a run blocks no longer than later ones (pinning the host memory of a
        large training state takes seconds). Collective like :meth:`save` (it plans the same writes); call it once
        the optimizer state exists (after the first step). A no-op for synchronous managers."""
        if not self.async_save:
            return
        jobs = plan_model_writes(model_items, self.state, False)
        if optimizer is not None:
            jobs += plan_optimizer_writes(optimizer, model_items, self.state, False)
        self._staging.reserve(jobs)

    def poll(self) -> bool:
        """Publish a finished async save (collective; cheap). True when nothing is in flight any more."""
        if self._pending is None:
            return True
        writer, name, stats, start = self._pending
        if not _all_done(writer.done(), self.state.device):
            return False
        stats.bytes_written = writer.wait()
        self._pending = None
        self._publish(name, stats, start)
        return True

    def wait(self) -> None:
        """Block until any async save is written and published (collective)."""
        if self._pending is None:
            return
        writer, name, stats, start = self._pending
        blocked = time.perf_counter()
        stats.bytes_written = writer.wait()
        self._pending = None
        self._publish(name, stats, start)
        stats.blocking_s += time.perf_counter() - blocked

    def _publish(self, name: str, stats: SaveStats, start: float) -> None:
        _barrier()  # every rank's files are written
        if self.state.rank == 0:
            tmp, final = self.root / f".tmp.{name}", self.root / name
            if self.fsync:
                fsync_tree(tmp)
            if final.exists():
                trash = self.root / f".old.{name}"
                if trash.exists():
                    shutil.rmtree(trash)
                final.rename(trash)
                tmp.rename(final)
                shutil.rmtree(trash)
            else:
                tmp.rename(final)
            latest_tmp = self.root / f".{LATEST}.tmp"
            latest_tmp.write_text(name + "\n")
            os.replace(latest_tmp, self.root / LATEST)
            self._prune(name)
        _barrier()
        stats.total_s = time.perf_counter() - start
        self.last_stats = stats
        logger.info(
            "saved checkpoint %s: %.2f GB written by rank %d, blocked %.2f s, total %.2f s",
            name, stats.bytes_written / 1e9, self.state.rank, stats.blocking_s, stats.total_s,
        )  # fmt: skip

    def _prune(self, newest: str) -> None:
        if self.keep_last is None:
            return
        done = sorted(
            (
                p
                for p in self.root.iterdir()
                if p.is_dir() and not p.name.startswith(".") and (p / "zarr.json").exists()
            ),
            key=lambda p: p.stat().st_mtime,
        )
        for old in done[: max(0, len(done) - self.keep_last)]:
            if old.name != newest:
                shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------------------------------------- load
    def load(
        self,
        model_items: Mapping[str, ShardedTensor],
        optimizer: Any = None,
        path: str | Path | None = None,
        *,
        strict: bool = True,
        verify: Verify = True,
    ) -> tuple[Path, dict[str, Any], dict[str, Any] | None]:
        """Load ``path`` (default: ``latest``) into the model (and optimizer); returns (path, metadata, rank state).

        Every array's metadata and chunk files are checked before any tensor is touched; ``verify`` also checks each
        chunk's CRC-32C as it is read. Problems raise :class:`CheckpointFormatError` naming the files."""
        ckpt = Path(path) if path is not None else latest_checkpoint(self.root)
        if ckpt is None:
            raise CheckpointFormatError(f"{self.root}: no checkpoint to load ({self.root / LATEST} does not exist)")
        meta = read_metadata(ckpt)
        model = model_arrays(model_items)
        arrays = model if optimizer is None else {**model, **optimizer_arrays(ckpt, optimizer, model_items)}
        problem: CheckpointFormatError | None = None
        specs: dict[str, ArraySpec] = {}
        try:  # every problem at once, before any tensor is touched
            specs, _ = check_arrays(ckpt, arrays, allow_missing=not strict and optimizer is None)
        except CheckpointFormatError as e:
            problem = e
        if not _all_done(problem is None, self.state.device):  # every rank stops, none waits in a collective
            raise problem or CheckpointFormatError(
                f"{ckpt}: another rank found missing or damaged files in this checkpoint (its error names them)"
            )
        device = self.state.device

        def agree(error: BaseException | None) -> None:
            """Every rank raises when any rank could not read its chunks (a checksum mismatch is seen only by the
            ranks that read that chunk), before any collective the load runs after its reads."""
            if not _all_done(error is None, device):
                if error is not None:
                    raise error
                raise CheckpointFormatError(f"{ckpt}: another rank found a damaged chunk while reading this "
                                            "checkpoint (its error names the file); load another checkpoint")  # fmt: skip

        error: CheckpointFormatError | None = None
        try:
            load_model(ckpt, model_items, strict=strict, verify=verify, checked=specs)
        except CheckpointFormatError as e:
            error = e
        agree(error)
        if optimizer is not None:
            step = int(meta.get("step", 0))
            load_optimizer(ckpt, optimizer, model_items, step, verify=verify, checked=specs, agree=agree)
        rank_file = ckpt / "rank_state" / f"rank_{self.state.rank:05d}.pt"
        try:
            rank_state = torch.load(rank_file, weights_only=False) if rank_file.exists() else None
        except Exception as e:  # a damaged pickle: name the file
            raise CheckpointFormatError(f"{rank_file}: cannot be read ({e})") from None
        return ckpt, meta, rank_state
