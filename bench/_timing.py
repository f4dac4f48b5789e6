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
