"""Profiles of ``serve_bench.py --profile``: where a batch-1 request's time goes, and what a prefill step costs."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch
from _serve_http import prompts


def _table(prof: Any, f: Any) -> None:
    ka = prof.key_averages()
    if torch.cuda.is_available():
        f.write(ka.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90))
    f.write("\n\n")
    f.write(ka.table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=90))


def profile_run(llm: Any, path: str, engine_run: Callable[[Any, int, int], dict[str, Any]]) -> None:
    """Where the time of batch-1 decoding goes: kernel time against wall time, hottest GPU and host ops."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        r = engine_run(llm, 1, 7)
    gpu_us = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages())
    with open(path, "w") as f:
        f.write(json.dumps(r) + "\n")
        f.write(f"total self device time {gpu_us / 1e3:.2f} ms over wall {r['wall_s'] * 1e3:.2f} ms\n\n")
        _table(prof, f)
    print(f"profile written to {path}", flush=True)


def _prefill_ms(llm: Any, conc: int, seed: int) -> float:
    """Wall time of prefill-only requests (one output token each) added at once: the prefill step and its sample."""
    from mcore_infer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts(conc, 32768, seed), params)
    return (time.perf_counter() - t0) * 1e3


def prefill_profile(llm: Any, path: str, levels: tuple[int, ...] = (1, 2, 6, 16, 64)) -> None:
    """Prefill-only requests at each of ``levels`` (median of 5 after 2 warm-ups, ms), then a torch.profiler table of
    one prefill of 6 requests."""
    from torch.profiler import ProfilerActivity, profile

    rows = {}
    for c in levels:
        for i in range(2):
            _prefill_ms(llm, c, 100 + i)
        times = sorted(_prefill_ms(llm, c, 200 + i) for i in range(5))
        rows[c] = times[2]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        ms = _prefill_ms(llm, 6, 7)
    with open(path, "w") as f:
        f.write(json.dumps({"prefill_ms_by_requests": rows, "profiled_ms": ms}) + "\n\n")
        _table(prof, f)
    print("prefill ms by requests:", json.dumps(rows), flush=True)
