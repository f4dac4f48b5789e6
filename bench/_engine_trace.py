"""A timeline of an engine's admissions and steps (``serve_bench.py --trace DIR``): where a served run's time goes.

:func:`install` wraps one ``LLMEngine``'s ``add_request`` and ``step`` (on the instance; the engine is unchanged) and
records when each request was added and, per step, when it started and ended, how many outputs it made and how many of
them were first tokens (prefills ending) or finished requests. :func:`summarize` splits the timeline into busy periods
(from the first add after the engine was empty to the step that empties it again: one benchmark run, or one
warm-up) and reports per period its wall
time, how the adds were spread, how many steps ran and how much of the wall they covered.
"""

from __future__ import annotations

import json
import time
from typing import Any


class StepTrace:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.adds: list[float] = []
        self.steps: list[tuple[float, float, int, int, int, int, int]] = []
        add, step = engine.add_request, engine.step

        def traced_add(*a: Any, **k: Any) -> Any:
            self.adds.append(time.perf_counter())
            return add(*a, **k)

        def traced_step() -> Any:
            t0 = time.perf_counter()
            outs = step()
            t1 = time.perf_counter()
            first = sum(1 for o in outs if o.num_output_tokens == len(o.new_token_ids) and o.new_token_ids)
            done = sum(1 for o in outs if o.finished)
            self.steps.append((t0, t1, len(outs), first, done, engine.num_running, engine.num_waiting))
            return outs

        engine.add_request, engine.step = traced_add, traced_step

    def dump(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"adds": self.adds, "steps": self.steps, "summary": summarize(self.adds, self.steps)}, f)


def install(llm: Any, path: str) -> StepTrace:
    """Trace ``llm.engine``; the timeline (and its summary) is written to ``path`` when ``llm.shutdown()`` runs."""
    trace = StepTrace(llm.engine)
    shutdown = llm.shutdown

    def traced_shutdown(*a: Any, **k: Any) -> Any:
        trace.dump(path)
        return shutdown(*a, **k)

    llm.shutdown = traced_shutdown
    return trace


def _periods(adds: list[float], steps: list[Any]) -> list[tuple[list[float], list[Any]]]:
    """The busy periods: the steps up to one that leaves the engine empty (nothing running or waiting), with the adds
    made since the previous period ended."""
    out: list[tuple[list[float], list[Any]]] = []
    group: list[Any] = []
    lo = float("-inf")
    for s in steps:
        if not s[2] and not s[5] and not s[6] and not group:
            continue  # an idle step
        group.append(s)
        if not s[5] and not s[6]:
            out.append(([a for a in adds if lo < a <= s[1]], group))
            lo, group = s[1], []
    return out


def summarize(adds: list[float], steps: list[Any]) -> list[dict[str, Any]]:
    """Per busy period: requests, wall (first add to last output), the adds' spread, steps (and of them steps that
    ended a prefill), time inside steps and between them, and the median decode step of a full batch."""
    rows = []
    for a, g in _periods(adds, steps):
        if not a:
            continue
        start, end = min(a), g[-1][1]
        inside = sum(s[1] - s[0] for s in g)
        full = max(s[5] for s in g)
        decode = sorted(s[1] - s[0] for s in g if s[5] == full and not s[3])
        rows.append({
            "requests": len(a),
            "wall_ms": (end - start) * 1e3,
            "adds_spread_ms": (max(a) - start) * 1e3,
            "first_step_after_ms": (g[0][0] - start) * 1e3,
            "steps": len(g),
            "prefill_steps": sum(1 for s in g if s[3]),
            "in_steps_ms": inside * 1e3,
            "between_steps_ms": (g[-1][1] - g[0][0] - inside) * 1e3,
            "full_batch": full,
            "full_decode_step_ms_p50": decode[len(decode) // 2] * 1e3 if decode else None,
        })  # fmt: skip
    return rows


def main() -> None:
    """``python bench/_engine_trace.py TRACE.json [--steps N]``: each busy period's summary, and the steps of the last
    period of the most requests (start offset, duration, outputs, first tokens, finished, running, waiting)."""
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--steps", type=int, default=40, help="steps of the largest period to list (0: none)")
    args = ap.parse_args()
    for path in args.traces:
        with open(path) as f:
            d = json.load(f)
        print(f"== {path}")
        periods = _periods(d["adds"], d["steps"])
        for row in summarize(d["adds"], d["steps"]):
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}))
        if args.steps and periods:
            most = max(len(a) for a, _ in periods)
            adds, steps = [p for p in periods if len(p[0]) == most][-1]
            t = min(adds)
            print("adds (ms):", [round((a - t) * 1e3, 2) for a in adds])
            for s in steps[: args.steps]:
                print(f"  {(s[0] - t) * 1e3:8.2f} +{(s[1] - s[0]) * 1e3:6.2f}  out {s[2]:3d} first {s[3]:3d} "
                      f"done {s[4]:3d} running {s[5]:3d} waiting {s[6]:3d}")  # fmt: skip


if __name__ == "__main__":
    main()
