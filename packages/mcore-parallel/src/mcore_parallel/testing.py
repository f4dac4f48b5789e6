"""A multi-process test harness: run a function on N ranks (gloo on CPU, or NCCL) and get every rank's result.

Workers are started once per world size (forkserver, torch preloaded) and reused across calls, so a test suite pays
the start-up cost once. The first rank to fail (earliest in time) has its traceback re-raised in the caller; a call
that does not finish within ``timeout`` seconds kills the workers and raises ``TimeoutError``, so a hung collective
never hangs the test run. After any failure the pool is torn down and the next call starts a fresh one.

The function must be importable by reference (defined at module level) and is called as ``fn(*args, **kwargs)`` on
every rank, with ``torch.distributed`` initialised (gloo) and ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set. World size
1 runs the function in the calling process without torch.distributed, exercising the no-launcher path.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["run_distributed", "DistributedFailure", "shutdown_pools"]

_GLOO_TIMEOUT_S = 60


class DistributedFailure(AssertionError):
    """A rank raised: the message holds that rank's traceback."""


def _worker(rank: int, world_size: int, store_path: str, backend: str, conn: Connection) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=_GLOO_TIMEOUT_S)
    )
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            result = fn(*args, **kwargs)
            conn.send(("ok", result, time.time()))
        except BaseException:
            conn.send(("error", traceback.format_exc(), time.time()))
    dist.destroy_process_group()


class _Pool:
    def __init__(self, world_size: int, backend: str) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
        fd, self.store_path = tempfile.mkstemp(prefix="mcore-test-store-")
        os.close(fd)
        os.unlink(self.store_path)
        self.world_size = world_size
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(rank, world_size, self.store_path, backend, child), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        for c in self.conns:
            c.send((fn, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, tuple[float, str]] = {}
        deadline = time.monotonic() + timeout
        pending = {c: r for r, c in enumerate(self.conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        first_error_at: float | None = None
        while pending:
            now = time.monotonic()
            limit = deadline if first_error_at is None else min(deadline, first_error_at + 2.0)
            if now >= limit:
                break
            ready = wait(list(pending) + list(sentinels), timeout=limit - now)
            for obj in ready:
                if obj in pending:
                    r = pending.pop(obj)  # type: ignore[call-overload]
                    try:
                        status, payload, t = obj.recv()  # type: ignore[union-attr]
                    except EOFError:
                        status, payload, t = "error", f"rank {r} closed its pipe (crashed?)", time.time()
                    if status == "ok":
                        results[r] = payload
                    else:
                        errors[r] = (t, payload)
                        first_error_at = first_error_at or time.monotonic()
                elif obj in sentinels:
                    r = sentinels.pop(obj)  # type: ignore[call-overload]
                    if self.conns[r] in pending and not self.conns[r].poll():
                        pending.pop(self.conns[r])
                        code = self.procs[r].exitcode
                        errors[r] = (time.time(), f"rank {r} exited with code {code} before answering")
                        first_error_at = first_error_at or time.monotonic()
        if errors:
            rank, (_, tb) = min(errors.items(), key=lambda kv: kv[1][0])
            others = sorted(set(errors) - {rank})
            note = f" (ranks {others} failed after it)" if others else ""
            raise DistributedFailure(f"rank {rank} of {self.world_size} failed{note}:\n{tb}")
        if pending:
            raise TimeoutError(
                f"ranks {sorted(pending.values())} of {self.world_size} did not finish {fn.__qualname__} "
                f"within {timeout:.0f} s (hung collective?); the workers were killed"
            )
        return [results[r] for r in range(self.world_size)]

    def close(self, graceful: bool = True) -> None:
        for c, p in zip(self.conns, self.procs):
            if graceful and p.is_alive():
                with contextlib.suppress(BrokenPipeError, OSError):
                    c.send(None)
        for p in self.procs:
            p.join(timeout=5 if graceful else 0.1)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for c in self.conns:
            c.close()
        if os.path.exists(self.store_path):
            os.unlink(self.store_path)


_POOLS: dict[tuple[int, str], _Pool] = {}


def shutdown_pools() -> None:
    """Stop every worker pool (called at interpreter exit)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


atexit.register(shutdown_pools)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return the per-rank results (rank order).

    ``backend="nccl"`` runs one rank per GPU (rank r on ``cuda:r``); world size 1 with gloo runs in-process.
    """
    if world_size == 1 and backend == "gloo":
        return [fn(*args, **kwargs)]
    key = (world_size, backend)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = _Pool(world_size, backend)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except BaseException:
        _POOLS.pop(key, None)
        pool.close(graceful=False)
        raise
