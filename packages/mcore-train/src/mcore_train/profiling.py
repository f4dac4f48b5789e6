"""Profiling a window of training steps (``logging.profile_steps``) with ``torch.profiler``.

For each profiled rank the window's kernels are summed per kernel and per class (GEMM, attention, Triton-fused,
collectives, optimizer, ...) and written as ``profile-rank<R>.md``; ``logging.profile_trace=true`` also writes the
Chrome/Perfetto trace ``trace-rank<R>.json``. The summary answers "where does the GPU time of a step go" without
opening a trace viewer.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "KERNEL_CLASSES",
    "StepProfiler",
    "classify_kernel",
    "host_during_gaps",
    "idle_gaps",
    "idle_windows",
    "kernel_summary",
    "timeline",
    "window_problem",
]

logger = logging.getLogger(__name__)

COLLECTIVES = "collectives (NCCL)"
KERNEL_CLASSES: list[tuple[str, tuple[str, ...]]] = [  # first match wins (lower-case substrings of kernel names)
    (COLLECTIVES, ("nccl",)),
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "matmul", "aten::mm", "aten::addmm", "aten::bmm")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("triton (fused elementwise, norms, loss)", ("triton",)),
    ("reductions", ("reduce",)),
    ("copies and fills", ("copy", "memcpy", "memset", "fill", "cat", "index")),
    ("elementwise (ATen)", ("elementwise", "vectorized")),
]


def window_problem(steps: list[int]) -> str | None:
    """What is wrong with a ``logging.profile_steps`` window (``None`` when it is empty or valid)."""
    if steps and (len(steps) != 2 or not 1 <= steps[0] < steps[1]):
        return f"profile_steps={steps} must be [first, end) with 1 <= first < end, e.g. [6, 8] profiles steps 6 and 7"
    return None


def classify_kernel(name: str) -> str:
    low = name.lower()
    return next((cls for cls, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other")


def _is_annotation(name: str) -> bool:
    """Ranges that carry their kernels' device time again (``nccl:all_gather``, ``Optimizer.step#AdamW.step``)."""
    return name.startswith("nccl:") or "#" in name


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def timeline(spans: list[tuple[float, float, bool]]) -> dict[str, float]:
    """Busy time, idle time and collective overlap of kernel spans ``(start, end, is_collective)`` (any one unit).

    ``busy``: the union of all spans; ``idle``: the rest of the window from the first start to the last end;
    ``comm``: summed collective durations; ``comm_hidden``: the part of them that ran while a compute kernel ran.
    """
    if not spans:
        return {"window": 0.0, "busy": 0.0, "idle": 0.0, "comm": 0.0, "comm_hidden": 0.0}
    everything = _merge([(a, b) for a, b, _ in spans])
    compute = _merge([(a, b) for a, b, comm in spans if not comm])
    starts = [a for a, _ in compute]
    hidden = 0.0
    for a, b, comm in spans:
        if not comm:
            continue
        i = max(0, bisect.bisect_right(starts, a) - 1)
        while i < len(compute) and compute[i][0] < b:
            hidden += max(0.0, min(b, compute[i][1]) - max(a, compute[i][0]))
            i += 1
    window = everything[-1][1] - everything[0][0]
    busy = sum(b - a for a, b in everything)
    return {
        "window": window,
        "busy": busy,
        "idle": window - busy,
        "comm": sum(b - a for a, b, comm in spans if comm),
        "comm_hidden": hidden,
    }


GAP_BUCKETS_US = (5.0, 50.0, 500.0)


def idle_gaps(kernels: list[tuple[float, float, str]], top: int = 12) -> dict[str, Any]:
    """Where the GPU sat idle: the gaps between the merged kernel spans ``(start, end, name)`` (µs).

    Returns ``buckets`` (gap size class → [count, total µs]: many tiny gaps point at launch overhead, a few long ones
    at host synchronisation or waiting on data) and ``pairs``: the ``top`` (last kernel before, first kernel after)
    pairs by total idle time, each ``(before, after, count, total µs)``, which say where in the step the GPU waited.
    """
    labels = [f"< {GAP_BUCKETS_US[0]:g} µs"]
    labels += [f"{a:g}-{b:g} µs" for a, b in itertools.pairwise(GAP_BUCKETS_US)]
    labels.append(f">= {GAP_BUCKETS_US[-1]:g} µs")
    buckets: dict[str, list[float]] = {k: [0, 0.0] for k in labels}
    pairs: dict[tuple[str, str], list[float]] = {}
    end, last = None, ""
    for a, b, name in sorted(kernels):
        if end is not None and a > end:
            gap = a - end
            bucket = labels[bisect.bisect_right(GAP_BUCKETS_US, gap)]
            buckets[bucket][0] += 1
            buckets[bucket][1] += gap
            entry = pairs.setdefault((last, name), [0, 0.0])
            entry[0] += 1
            entry[1] += gap
        if end is None or b >= end:
            end, last = b, name
    ranked = sorted(pairs.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "buckets": {k: (int(v[0]), v[1]) for k, v in buckets.items()},
        "pairs": [(before, after, int(c), total) for (before, after), (c, total) in ranked],
    }


def idle_windows(kernels: list[tuple[float, float, str]], min_gap: float) -> list[tuple[float, float]]:
    """The gaps of at least ``min_gap`` between the merged kernel spans ``(start, end, name)``, as (start, end)."""
    out: list[tuple[float, float]] = []
    end = None
    for a, b, _ in sorted(kernels):
        if end is not None and a - end >= min_gap:
            out.append((end, a))
        end = b if end is None else max(end, b)
    return out


def host_during_gaps(events: list[Any], windows: list[tuple[float, float]]) -> dict[str, float]:
    """What the host was running while the GPU sat idle: for each top-level CPU event (no parent; any thread), its
    time overlapping the idle ``windows``, summed by name (µs). A GPU waiting for the host shows up here as the
    operators (compiled regions, eager collectives, Python ranges) that kept the host busy."""
    spans = sorted(windows)
    starts = [a for a, _ in spans]
    out: dict[str, float] = {}
    for evt in events:
        if "CUDA" in str(getattr(evt, "device_type", "")) or getattr(evt, "cpu_parent", None) is not None:
            continue
        a, b = float(evt.time_range.start), float(evt.time_range.end)
        i = max(0, bisect.bisect_right(starts, a) - 1)
        overlap = 0.0
        while i < len(spans) and spans[i][0] < b:
            overlap += max(0.0, min(b, spans[i][1]) - max(a, spans[i][0]))
            i += 1
        if overlap > 0:
            name = str(evt.name)
            out[name] = out.get(name, 0.0) + overlap
    return out


_SYNC_CALLS = ("synchronize", "cudamemcpy")


def host_waits(events: list[Any]) -> dict[str, float]:
    """µs the host spent in blocking CUDA runtime calls (stream/event/device synchronisation, synchronous copies),
    keyed by ``caller > call`` (the nearest operator above the call): the places that drain the GPU's queue."""
    waits: dict[str, float] = {}
    for evt in events:
        name = str(evt.name)
        low = name.lower()
        if not any(k in low for k in _SYNC_CALLS) or "async" in low:
            continue
        parent = getattr(evt, "cpu_parent", None)
        caller = str(parent.name) if parent is not None else "(top level)"
        key = f"{caller} > {name}"
        waits[key] = waits.get(key, 0.0) + float(evt.time_range.end - evt.time_range.start)
    return waits


def _is_kernel(evt: Any, name: str) -> bool:
    """A device kernel's own record (not a CPU op, nor a range that repeats its kernels' time)."""
    on_device = "CUDA" in str(getattr(evt, "device_type", ""))
    return on_device and not getattr(evt, "is_user_annotation", False) and not _is_annotation(name)


def _kernels(events: list[Any]) -> list[tuple[float, float, str]]:
    return [
        (float(evt.time_range.start), float(evt.time_range.end), str(evt.name))
        for evt in events
        if _is_kernel(evt, evt.name)
    ]


def kernel_summary(prof: Any, wall_s: float, steps: int, top: int = 30) -> tuple[str, dict[str, Any]]:
    """(markdown, numbers) of the device kernels a finished ``torch.profiler.profile`` recorded, per step.

    Without device kernels (a CPU run) the operators' own CPU time is summed instead."""
    events = list(prof.key_averages())
    kernels: dict[str, float] = {}
    for evt in events:
        if not _is_kernel(evt, evt.key):
            continue
        ms = float(getattr(evt, "self_device_time_total", 0.0)) / 1e3 / steps
        if ms > 0:
            kernels[evt.key] = kernels.get(evt.key, 0.0) + ms
    unit = "kernel"
    if not kernels:
        unit = "CPU operator"
        for evt in events:
            ms = float(getattr(evt, "self_cpu_time_total", 0.0)) / 1e3 / steps
            if ms > 0 and evt.key.startswith("aten::"):
                kernels[evt.key] = kernels.get(evt.key, 0.0) + ms
    classes: dict[str, float] = {}
    for name, ms in kernels.items():
        cls = classify_kernel(name)
        classes[cls] = classes.get(cls, 0.0) + ms
    busy = sum(kernels.values())
    wall_ms = wall_s * 1e3 / steps
    records = list(prof.events())  # read once: a window can hold millions of records
    spans = _kernels(records)
    tl = {
        k: v / 1e3 / steps
        for k, v in timeline([(a, b, classify_kernel(n) == COLLECTIVES) for a, b, n in spans]).items()
    }
    lines = [
        f"per step ({steps} profiled): wall {wall_ms:.1f} ms under the profiler, {unit} time {busy:.1f} ms "
        "(kernels on several streams may overlap: kernel time can exceed the wall)",
        f"GPU timeline per step: busy {tl['busy']:.1f} ms (union of kernels), idle {tl['idle']:.1f} ms between the "
        f"first and last kernel; collectives {tl['comm']:.1f} ms, of which {tl['comm_hidden']:.1f} ms ran alongside "
        "compute kernels",
        "",
        f"| {unit} class | ms per step | share of {unit} time |",
        "|---|---|---|",
    ]
    lines += [
        f"| {c} | {ms:.2f} | {ms / max(busy, 1e-9):.1%} |" for c, ms in sorted(classes.items(), key=lambda x: -x[1])
    ]
    lines += ["", f"| top {unit}s | class | ms per step |", "|---|---|---|"]
    for name, ms in sorted(kernels.items(), key=lambda x: -x[1])[:top]:
        lines.append(f"| `{name[:120]}` | {classify_kernel(name)} | {ms:.3f} |")
    if spans:
        gaps = idle_gaps(spans)
        lines += ["", "| idle gaps between kernels | count per step | ms per step |", "|---|---|---|"]
        lines += [f"| {k} | {c / steps:.1f} | {t / 1e3 / steps:.2f} |" for k, (c, t) in gaps["buckets"].items()]
        lines += ["", "| idle after kernel | before kernel | gaps per step | ms per step |", "|---|---|---|---|"]
        lines += [
            f"| `{a[:70]}` | `{b[:70]}` | {c / steps:.1f} | {t / 1e3 / steps:.2f} |" for a, b, c, t in gaps["pairs"]
        ]
        windows = idle_windows(spans, 50.0)
        busy_host = host_during_gaps(records, windows)
        if busy_host:
            lines += [
                "",
                "| host running (top-level operator) while the GPU idled ≥ 50 µs | ms per step |",
                "|---|---|",
            ]
            ranked = sorted(busy_host.items(), key=lambda x: -x[1])[:12]
            lines += [f"| `{k[:110]}` | {t / 1e3 / steps:.2f} |" for k, t in ranked]
        waits = host_waits(records)
        if waits:
            lines += ["", "| host blocked in (caller > CUDA call) | ms per step |", "|---|---|"]
            ranked = sorted(waits.items(), key=lambda x: -x[1])[:10]
            lines += [f"| `{k[:110]}` | {t / 1e3 / steps:.2f} |" for k, t in ranked]
    numbers = {"wall_ms": wall_ms, "busy_ms": busy, "unit": unit, "classes_ms": classes, "timeline_ms": tl}
    return "\n".join(lines) + "\n", numbers


class StepProfiler:
    """Profiles steps ``[start, end)`` (1-based step numbers as logged) on the chosen ranks.

    Call :meth:`before_step` with the number of the step about to run and :meth:`after_step` once it finished.
    """

    def __init__(self, steps: list[int], out_dir: str | Path | None, rank: int, ranks: list[int], trace: bool) -> None:
        problem = window_problem(steps)
        if problem is not None:
            raise ValueError(f"logging.{problem}")
        self.start, self.end = (steps[0], steps[1]) if steps else (0, 0)
        self.enabled = bool(steps) and rank in ranks
        if self.enabled and out_dir is None:
            raise ValueError("logging.profile_steps needs logging.dir or checkpoint.dir for its output")
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.rank, self.trace = rank, trace
        self._prof: Any = None
        self._t0 = 0.0

    def covers(self, step: int) -> bool:
        """Whether ``step`` ran under the profiler or right after it (its host waited for the profile's export)."""
        return self.enabled and self.start <= step <= self.end

    def before_step(self, step: int) -> None:
        if not self.enabled or step != self.start:
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def after_step(self, step: int) -> Path | None:
        """Finish the window after its last step: writes the summary (and the trace) and returns the summary path."""
        if self._prof is None or step != self.end - 1:
            return None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        assert self.out_dir is not None
        self.out_dir.mkdir(parents=True, exist_ok=True)
        text, _ = kernel_summary(prof, wall, self.end - self.start)
        path = self.out_dir / f"profile-rank{self.rank}.md"
        path.write_text(f"# steps {self.start}..{self.end - 1}, rank {self.rank}\n\n{text}")
        if self.trace:
            prof.export_chrome_trace(str(self.out_dir / f"trace-rank{self.rank}.json"))
        logger.info("profile of steps %d..%d written to %s", self.start, self.end - 1, path)
        return path

    def close(self) -> None:
        """Stop a window the run did not finish (it stopped early); nothing is written."""
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None
