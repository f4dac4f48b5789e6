"""Wall-clock timing of GPU work for the benchmarks (shared by the bench scripts)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any


def cuda_seconds(fn: Callable[[], Any], iters: int, warmup: int = 3, before: Callable[[], Any] | None = None) -> float:
    """Seconds per call of ``fn`` after ``warmup`` calls, between device synchronisations (``before`` runs once
    after the warm-up, e.g. a barrier so that every rank starts together)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if before is not None:
        before()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def bf16_matmul_tflops() -> float:
    """The bf16 matmul rate of the current GPU (8192^3 products, a 20-product burst after 3 warm-ups): the MFU
    denominator of the training benchmarks."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * 20 / (time.perf_counter() - t) / 1e12


def sweep_tiles(
    tiles: dict[str, Any], candidates: dict[str, Iterable[Any]], run: Callable[[], dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each entry of a kernel module's ``tiles`` in turn over its ``candidates``, the other entries at the fastest
    found so far, timed by ``run`` (a row with ``ms``; one that raises is recorded with its error): every row,
    fastest first, each naming the tiles it ran with. ``tiles`` is left as it was."""
    default, rows = dict(tiles), []
    for kernel, values in candidates.items():
        timed = []
        for value in values:
            tiles[kernel] = tuple(value)
            row: dict[str, Any] = {"tiles": {n: list(t) for n, t in tiles.items()}}
            try:
                row.update(run())
            except Exception as e:  # a tile this kernel cannot take
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            timed.append(row)
        best = min(timed, key=lambda r: r.get("ms", float("inf")))
        tiles[kernel] = tuple(best["tiles"][kernel])
        rows.extend(timed)
    tiles.update(default)
    return sorted(rows, key=lambda r: r.get("ms", float("inf")))
