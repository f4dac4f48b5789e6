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


_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_timeline(events: list[dict[str, Any]], per_token: int) -> dict[str, Any]:
    """Where the GPU's wall time goes, from a chrome trace's GPU events (kernels of graph replays included).

    Events in start order; each one's time is split into the gap before it (the GPU idle since every earlier event
    ended) and its exposed part (the part of it that no earlier event covers; with programmatic dependent launches
    kernels overlap, so self times add up to more than the wall). Gaps and exposed time add up to the span. Per
    event name: calls, mean duration, and exposed and gap time per ``per_token`` (the number of decode steps)."""
    evs = sorted((e for e in events if e.get("cat") in _GPU_CATS and "dur" in e), key=lambda e: float(e["ts"]))
    if not evs:
        return {}
    cur_end = float(evs[0]["ts"])
    by: dict[str, dict[str, float]] = {}
    for e in evs:
        start, dur = float(e["ts"]), float(e["dur"])
        row = by.setdefault(str(e["name"])[:90], {"calls": 0, "dur_us": 0.0, "exposed_us": 0.0, "gap_us": 0.0})
        row["calls"] += 1
        row["dur_us"] += dur
        row["gap_us"] += max(0.0, start - cur_end)
        row["exposed_us"] += max(0.0, start + dur - max(start, cur_end))
        cur_end = max(cur_end, start + dur)
    span = cur_end - float(evs[0]["ts"])
    n = max(1, per_token)
    rows = {
        k: {"calls": v["calls"], "mean_us": v["dur_us"] / v["calls"], "exposed_us_per_token": v["exposed_us"] / n,
            "gap_us_per_token": v["gap_us"] / n}
        for k, v in sorted(by.items(), key=lambda kv: -(kv[1]["exposed_us"] + kv[1]["gap_us"]))
    }  # fmt: skip
    return {
        "span_us_per_token": span / n,
        "idle_us_per_token": sum(v["gap_us"] for v in by.values()) / n,
        "by_name": rows,
    }


def _write_timeline(prof: Any, f: Any, tokens: int) -> None:
    import os
    import tempfile

    fd, tmp = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        with open(tmp) as t:
            events = json.load(t).get("traceEvents", [])
    finally:
        os.unlink(tmp)
    tl = gpu_timeline(events, tokens)
    if not tl:
        return
    f.write(f"GPU span {tl['span_us_per_token']:.1f} us per token, idle {tl['idle_us_per_token']:.1f} us\n\n")
    f.write("| kernel | calls | mean us | exposed us/token | idle before us/token |\n|---|---|---|---|---|\n")
    for name, r in list(tl["by_name"].items())[:40]:
        f.write(f"| {name} | {r['calls']} | {r['mean_us']:.2f} | {r['exposed_us_per_token']:.2f} | "
                f"{r['gap_us_per_token']:.2f} |\n")  # fmt: skip
    f.write("\n")


def profile_run(llm: Any, path: str, engine_run: Callable[[Any, int, int], dict[str, Any]], tokens: int) -> None:
    """Where the time of batch-1 decoding goes (a request of ``tokens`` output tokens): kernel time against wall
    time, the GPU timeline per token, hottest GPU and host ops."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        r = engine_run(llm, 1, 7)
    gpu_us = sum(getattr(e, "self_device_time_total", 0.0) for e in prof.key_averages())
    with open(path, "w") as f:
        f.write(json.dumps(r) + "\n")
        f.write(f"total self device time {gpu_us / 1e3:.2f} ms over wall {r['wall_s'] * 1e3:.2f} ms\n\n")
        if torch.cuda.is_available():
            _write_timeline(prof, f, tokens)
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
