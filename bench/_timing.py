"""Wall-clock timing of GPU work for the benchmarks (shared by the bench scripts)."""

from __future__ import annotations

import time
from collections.abc import Callable
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
