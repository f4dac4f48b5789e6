"""Small-batch GEMMs of decoding (``y = x Wᵀ`` with few rows in ``x``): what each implementation reaches (not a test).

A batch-1 decode step of ``llama-1b`` spends most of its time in five weight-bound GEMMs per layer. cuBLAS runs the
QKV and output projections at ~5.9 µs on an H200 where reading their weights takes ~1-1.5 µs (the profile of one
batch-1 request, ``serve_bench.py --profile``), so this bench times, per shape and row count, inside a CUDA graph of
back-to-back calls (as in a decode graph):

- ``cublas``: ``F.linear``;
- ``inductor``: ``torch.compile(F.linear, mode="max-autotune-no-cudagraphs")`` (autotuned Triton templates);
- ``triton``: the weight-streaming kernel below (one program per block of output features, all rows at once);
- ``splitk{2,4,8}``: the same kernel split over K into float32 partials (more programs for narrow outputs such as
  the 2048-wide output projection and fc2: 64 programs otherwise), timed alone (the sum left to the consumer, e.g.
  the residual add + norm after these projections) and with the sum as a kernel of its own (``_sum``).

and reports µs per call and the weight bytes per second. ``--check`` compares the Triton kernel with ``F.linear``
(also on the CPU under ``TRITON_INTERPRET=1``).

    python bench/gemv_bench.py --rows 1 8 32 64 --json out.json

``--norm-linear`` times the fused residual add + RMSNorm + linear (+ SwiGLU) kernel of
``mcore_infer.kernels.norm_linear`` against the unfused ops at the QKV, fc1 and LM-head shapes, at its default
launch and at each launch of ``--launches`` (passed as ``launch=``; one JSON line per shape with every timing and the
best launch, then a summary line); ``--best-plan FILE`` writes the ``norm_linear`` decode plan as JSON, with the
launch of least total time where it beat the default, for a serving run::

    python bench/gemv_bench.py --norm-linear --rows 1 --json nl.json --best-plan nl-plan.json
    python bench/serve_bench.py --compile --decode-kernels nl-plan.json

``--swiglu-fc2`` times the MLP's SwiGLU folded into the loads of a split-K down-projection GEMV (one kernel fewer
per layer and decode step) against the compiled SwiGLU + cuBLAS. ``--fma-sweep`` times the one-row kernel (products
accumulated elementwise, no MMA) at each launch of ``--fma-launches`` for the output projection, fc2, SwiGLU + fc2,
QKV and fc1 against cuBLAS / compiled SwiGLU + cuBLAS, and ``--best-plan FILE`` then writes a decode plan (JSON, as
``DecodePlan.from_dict`` reads it) with each row kernel whose best launch beat its baseline, at that launch::

    python bench/gemv_bench.py --fma-sweep --json fma.json --best-plan fma-plan.json
    python bench/serve_bench.py --compile --decode-kernels fma-plan.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = {  # llama-1b: (out_features, in_features)
    "qkv": (3072, 2048),
    "proj": (2048, 2048),
    "fc1": (16384, 2048),
    "fc2": (2048, 8192),
    "lm_head": (32768, 2048),
}


def triton_linear(x: torch.Tensor, w: torch.Tensor, block_n: int = 32, block_k: int = 256) -> torch.Tensor:
    """``F.linear(x, w)`` for ``x`` ``[M, K]`` with small ``M`` (at most 64), ``w`` ``[N, K]`` contiguous: the
    weight-streaming kernel of :mod:`mcore_infer.kernels.small_gemv`, one split."""
    from mcore_infer.kernels.small_gemv import gemv_partials

    return gemv_partials(x, w, 1, block_n, block_k, out_dtype=x.dtype)[0]


def triton_linear_partials(x: torch.Tensor, w: torch.Tensor, splits: int, block_n: int = 32,
                           block_k: int = 256) -> torch.Tensor:  # fmt: skip
    """Split-K: ``[splits, M, N]`` float32 partial products whose sum over dim 0 is ``F.linear(x, w)``. More
    programs than output blocks (a 2048-wide output is 64 programs at ``block_n`` 32, half an H200); the sum can
    be left to the consumer (a residual add + norm that reads the partials instead of one output)."""
    from mcore_infer.kernels.small_gemv import gemv_partials

    return gemv_partials(x, w, splits, block_n, block_k)


def swiglu_linear_partials(a: torch.Tensor, w: torch.Tensor, splits: int, block_n: int = 32,
                           block_k: int = 256) -> torch.Tensor:  # fmt: skip
    """``[splits, M, N]`` float32 partials of ``F.linear(silu(gate) * up, w)`` for ``a = [gate | up]`` ``[M, 2K]``
    (the SwiGLU of the MLP folded into the loads of the down projection, as ``swiglu_down`` does)."""
    from mcore_infer.kernels.small_gemv import gemv_partials

    return gemv_partials(a, w, splits, block_n, block_k, swiglu=True)


SPLITS = (2, 4, 8)  # split-K factors timed by the bench


def swiglu_fc2_rows(rows: list[int]) -> list[dict[str, Any]]:
    """µs per call (CUDA graph) of SwiGLU + the down projection at llama-1b's fc2 shape: compiled SwiGLU + cuBLAS
    against the one split-K kernel (alone: the sum left to the residual add + norm after it; and with the sum)."""
    n, k = SHAPES["fc2"]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5

    def unfused(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        gate, up = a.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w)

    compiled = torch.compile(unfused, dynamic=False)
    out = []
    for m in rows:
        a = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
        ref = unfused(a.float(), w.float())
        row: dict[str, Any] = {"shape": "swiglu + fc2", "rows": m,
                               "unfused_us": time_in_graph(lambda a=a: compiled(a, w))}  # fmt: skip
        for sp in (1, *SPLITS):
            got = swiglu_linear_partials(a, w, sp).sum(0)
            row[f"max_abs_diff_split{sp}"] = (got - ref).abs().max().item()
            row[f"fused_split{sp}_us"] = time_in_graph(lambda a=a, sp=sp: swiglu_linear_partials(a, w, sp))
            row[f"fused_split{sp}_sum_us"] = time_in_graph(lambda a=a, sp=sp: swiglu_linear_partials(a, w, sp).sum(0))
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


FMA_SWEEP = [f"{sp},{bn},{bk},{w}" for sp in (1, 2, 4) for bn in (8, 16, 32) for bk in (256, 512, 1024)
             for w in (4, 8)]  # fmt: skip


COLD_BYTES = 256 << 20
"""``--cold``: each call reads another copy of the weight, out of this many bytes of copies (5x an H200's 50 MB L2),
so that every call streams its weight from HBM as a decode step does (it reads 2 GB of weights once each)."""


def fma_sweep(launches: list[str], cold: bool = False) -> dict[str, Any]:
    """One row (batch-1 decoding), µs per call in a CUDA graph: the row kernel of ``small_gemv`` at each launch
    (``SPLITS,BLOCK_N,BLOCK_K,WARPS``; the partial sums alone, as the residual add after the output projection and
    fc2 consumes them) against what the engine runs otherwise: cuBLAS (with its own split-K reduction) for the output
    projection and fc2, compiled SwiGLU + cuBLAS for SwiGLU + fc2. Returns every timing, the best launch per shape
    and whether it beat the baseline. ``cold``: the weights are read from HBM (:data:`COLD_BYTES`), not from the L2
    where a weight of up to 50 MB stays between back-to-back calls on it."""
    from mcore_infer.kernels.small_gemv import gemv_partials

    cases = {"proj": (*SHAPES["proj"], False), "fc2": (*SHAPES["fc2"], False), "swiglu + fc2": (*SHAPES["fc2"], True),
             "qkv": (*SHAPES["qkv"], False), "fc1": (*SHAPES["fc1"], False)}  # fmt: skip
    summed = ("qkv", "fc1")  # consumers that need the output summed (row_linear): one split, output in bf16
    out: dict[str, Any] = {}

    def unfused_swiglu(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        gate, up = a.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w)

    compiled = torch.compile(unfused_swiglu, dynamic=False)
    for name, (n, k, swiglu) in cases.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        copies = [w, *(w.clone() for _ in range(math.ceil(COLD_BYTES / w.nbytes) - 1))] if cold else [w]
        x = torch.randn(1, 2 * k if swiglu else k, device="cuda", dtype=torch.bfloat16)
        ref = unfused_swiglu(x.double(), w.double()) if swiglu else F.linear(x.double(), w.double())
        weights = itertools.cycle(copies)  # each captured call takes the next copy
        base = (
            time_in_graph(lambda x=x, ws=weights: compiled(x, next(ws)))
            if swiglu
            else time_in_graph(lambda x=x, ws=weights: F.linear(x, next(ws)))
        )
        row: dict[str, Any] = {"shape": name, "rows": 1, "baseline_us": base, "us_by_launch": {}, "errors": {},
                               "cold": cold, "weight_copies": len(copies)}  # fmt: skip
        for launch in launches:
            sp, bn, bk, warps = (int(v) for v in launch.split(","))
            if name in summed and sp != 1:
                continue
            dtype = x.dtype if name in summed else torch.float32

            def fn(x: torch.Tensor = x, w: torch.Tensor = w, sp: int = sp, bn: int = bn, bk: int = bk,
                   warps: int = warps, swiglu: bool = swiglu, dtype: torch.dtype = dtype) -> torch.Tensor:  # fmt: skip
                return gemv_partials(x, w, sp, bn, bk, swiglu=swiglu, out_dtype=dtype, num_warps=warps)

            try:
                err = (fn().double().sum(0) - ref).abs().max().item()
                if err > 0.05:
                    row["errors"][launch] = f"max |diff| {err:.3g} against float64"
                    continue
                row["us_by_launch"][launch] = time_in_graph(lambda fn=fn, ws=weights: fn(w=next(ws)))
            except Exception as e:  # keep the other launches
                row["errors"][launch] = repr(e)[:200]
        if row["us_by_launch"]:
            best = min(row["us_by_launch"], key=row["us_by_launch"].get)
            row.update(best=best, best_us=row["us_by_launch"][best], beats_baseline=row["us_by_launch"][best] < base)
        out[name] = row
        print(json.dumps({k: v for k, v in row.items() if k != "us_by_launch"}), flush=True)
    return out


def write_fma_plan(path: str, rows: dict[str, Any]) -> None:
    """A decode plan (JSON) with the attention-side fusions and each row kernel whose sweep winner beat what the
    engine runs otherwise, at that launch: ``swiglu_down`` (SwiGLU + fc2), ``proj_partials`` (the output projection)
    and ``row_gemv`` (the QKV projection; fc1 is timed for reference, the engine keeps it on cuBLAS)."""
    plan: dict[str, Any] = {"preset": "attention", "launches": {}}
    for shape, kernel in (("swiglu + fc2", "swiglu_down"), ("proj", "proj_partials"), ("qkv", "row_gemv")):
        row = rows.get(shape, {})
        plan[kernel] = bool(row.get("beats_baseline"))
        if plan[kernel]:
            plan["launches"][kernel] = row["best"]
            print(f"{kernel}: {row['best']} {row['best_us']:.2f} us vs {row['baseline_us']:.2f}")
        else:
            print(f"{kernel}: no launch beat the baseline")
    with open(path, "w") as f:
        json.dump(plan, f, indent=1)
    print(f"wrote {path}")


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def time_in_graph(fn: Any, calls: int = 50, reps: int = 20) -> float:
    """µs per call of ``fn`` replayed ``calls`` times back to back inside one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (reps * calls) * 1e6


def check(device: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    for m in (1, 3, 8, 17):
        for n, k in ((96, 128), (130, 300)):
            x = torch.randn(m, k, device=device, dtype=dtype)
            w = torch.randn(n, k, device=device, dtype=dtype)
            ref = F.linear(x.double(), w.double())
            tol = 1e-4 if dtype == torch.float32 else 5e-2
            outs = {"plain": triton_linear(x, w, block_n=32, block_k=64)}
            for splits in SPLITS:
                outs[f"split-K {splits}"] = triton_linear_partials(x, w, splits, block_n=32, block_k=64).sum(0)
            for name, out in outs.items():
                err = ((out.double() - ref).abs() / (ref.abs() + 1)).max().item()
                assert err < tol, (name, m, n, k, err)
            a = torch.randn(m, 2 * k, device=device, dtype=dtype)
            gate, up = a.double().chunk(2, dim=-1)
            ref = F.linear(F.silu(gate) * up, w.double())
            for splits in (1, *SPLITS):
                out = swiglu_linear_partials(a, w, splits, block_n=32, block_k=64).sum(0).double()
                err = ((out - ref).abs() / (ref.abs() + 1)).max().item()
                assert err < tol, ("swiglu", splits, m, n, k, err)
    print(f"triton_linear, its split-K form and the SwiGLU split-K kernel match on {device} ({dtype})")


# the launches --norm-linear times on every shape (besides the default), "MODE,BLOCK_N,WARPS,STAGES,BLOCK_K" as
# NormLinearLaunch.parse reads them: the two default launches and their neighbours in each NORM_MODE. A wider sweep on an H200
# (rows=1) found modes 1 and 2 within 0.5 µs of each other, mode 0 3-5x slower, 8 warps 1.5-2x slower, BLOCK_K 128
# or 512 and 4 stages no better, BLOCK_N 16 slower and 128 out of shared memory with SwiGLU. About 40 s on an H200.
NORM_LINEAR_SWEEP = [
    *(f"1,{c}" for c in ("32,2,3,256", "64,4,3,256", "32,4,3,256", "64,2,3,256", "32,2,4,256")),
    *(f"2,{c}" for c in ("32,2,3,256", "64,4,3,256")),
    *(f"3,{c}" for c in ("32,2,3,256", "64,4,3,256", "32,4,3,256")),
    "0,64,4,3,256",
]


def norm_linear_rows(rows: list[int], configs: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """µs per call (CUDA graph) of residual add + RMSNorm + linear (+ SwiGLU) at decode shapes: the unfused ops
    (compiled by inductor, as in a compiled layer) against the one ``norm_linear`` kernel at its default launch
    (the heuristic) and at each launch of ``configs``. Returns one row per
    shape and row count, and the summary: the launch of ``configs`` with the least total time over all rows."""
    from mcore_infer.kernels import norm_linear as nl
    from mcore_infer.kernels.norm_linear import Launch, norm_linear

    def unfused(x: torch.Tensor, r: torch.Tensor, g: torch.Tensor, w: torch.Tensor, swiglu: bool) -> torch.Tensor:
        h = x + r
        y = F.linear(F.rms_norm(h, g.shape, g, 1e-5), w)
        if swiglu:
            a, b = y.chunk(2, dim=-1)
            y = F.silu(a) * b
        return y + h[..., :1]  # h is used, like the residual stream

    launches = [Launch.parse(c) for c in configs]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    compiled = torch.compile(unfused, dynamic=False)
    out = []
    totals = dict.fromkeys(map(str, launches), 0.0)
    default_total = unfused_total = 0.0
    for name, swiglu in (("qkv", False), ("fc1", True), ("lm_head", False)):
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        g = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        default = nl.heuristic_launch(n // 2 if swiglu else n, k, swiglu, sms)
        for m in rows:
            x, r = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            y_ref = unfused(x, r, g, w, swiglu)

            def fused(x: torch.Tensor = x, r: torch.Tensor = r, g: torch.Tensor = g, w: torch.Tensor = w,
                      s: bool = swiglu, launch: Launch | None = None) -> torch.Tensor:  # fmt: skip
                y, h = norm_linear(x, r, g, 1e-5, w, s, launch=launch)
                return y + h[..., :1]

            timings: dict[str, float] = {}
            errors: dict[str, str] = {}
            max_diff = 0.0
            for launch in dict.fromkeys([default, *launches]):  # the default first, each launch once
                try:
                    diff = (fused(launch=launch).float() - y_ref.float()).abs().max().item()
                    max_diff = diff if math.isnan(diff) or diff > max_diff else max_diff  # NaN sticks
                    timings[str(launch)] = time_in_graph(lambda launch=launch: fused(launch=launch))
                except Exception as e:  # a launch the GPU cannot run (shared memory): the others still count
                    errors[str(launch)] = repr(e)[:200]
            for key in totals:
                totals[key] += timings.get(key, float("inf"))
            best = min(timings, key=timings.__getitem__)
            unfused_us = time_in_graph(lambda x=x, r=r, g=g, w=w, s=swiglu: compiled(x, r, g, w, s))
            fused_us = timings.get(str(default), float("nan"))
            default_total += fused_us
            unfused_total += unfused_us
            row = {
                "shape": name + (" + swiglu" if swiglu else ""),
                "rows": m,
                "unfused_us": unfused_us,
                "fused_us": fused_us,
                "default": str(default),
                "best": best,
                "best_us": timings[best],
                "max_abs_diff": max_diff,
                "fused_us_by_launch": timings,
                **({"errors": errors} if errors else {}),
            }
            out.append(row)
            print(json.dumps(row), flush=True)
    best = min(totals, key=totals.__getitem__)
    summary = {
        "best_launch": best,
        "best_total_us": totals[best],
        "default_total_us": default_total,
        "unfused_total_us": unfused_total,
        "total_us_by_launch": totals,
    }
    print(json.dumps(summary), flush=True)
    return out, summary


def write_norm_linear_plan(path: str, summary: dict[str, Any]) -> None:
    """The ``norm_linear`` decode plan (JSON) for a serving run: with the sweep's best launch where it beat the
    default launches in total, else with the default (per-shape heuristic) launches."""
    note = (f"gemv_bench --norm-linear on {torch.cuda.get_device_name()}: best launch {summary['best_launch']} "
            f"{summary['best_total_us']:.1f} us in total, default {summary['default_total_us']:.1f}, "
            f"unfused {summary['unfused_total_us']:.1f}")  # fmt: skip
    plan: dict[str, Any] = {"preset": "norm_linear", "launches": {}}
    if summary["best_total_us"] < summary["default_total_us"]:
        plan["launches"]["norm_linear"] = summary["best_launch"]
    with open(path, "w") as f:
        json.dump(plan, f, indent=1)
    print(f"{note}\nwrote {path}: {plan}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--check", action="store_true", help="only compare the Triton kernel with F.linear")
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--norm-linear", action="store_true", help="only time the fused norm + linear kernel")
    ap.add_argument("--launches", nargs="+", default=NORM_LINEAR_SWEEP, metavar="MODE,BLOCK_N,WARPS,STAGES[,BLOCK_K]",
                    help="--norm-linear: the launches to time (default: %(default)s)")  # fmt: skip
    ap.add_argument("--best-plan", default=None, metavar="FILE",
                    help="--norm-linear / --fma-sweep: write the decode plan of the sweep's winners to FILE (JSON, for "
                    "serve_bench.py --decode-kernels FILE)")  # fmt: skip
    ap.add_argument("--swiglu-fc2", action="store_true", help="only time SwiGLU folded into a split-K fc2 GEMV")
    ap.add_argument(
        "--fma-sweep",
        action="store_true",
        help="only time the one-row kernel's launches for the output projection, fc2 and SwiGLU + fc2",
    )
    ap.add_argument("--fma-launches", nargs="+", default=FMA_SWEEP, metavar="SPLITS,BLOCK_N,BLOCK_K,WARPS")
    ap.add_argument("--cold", action="store_true", help="--fma-sweep with the weights read from HBM (COLD_BYTES)")
    return ap


def _write_json(path: str | None, rows: Any, **extra: Any) -> None:
    """The GPU, torch's version, ``rows`` and ``extra`` as JSON at ``path`` (nothing without a path)."""
    if path:
        with open(path, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, **extra}, f,
                      indent=1)  # fmt: skip


def shape_rows(row_counts: list[int], inductor: bool) -> list[dict[str, Any]]:
    """µs per call and weight GB/s of every implementation at each llama-1b shape and row count (bf16)."""
    dtype = torch.bfloat16
    compiled = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False) if inductor else None
    rows: list[dict[str, Any]] = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=dtype)
        for m in row_counts:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            row: dict[str, Any] = {"shape": name, "rows": m, "out": n, "in": k}
            impls: dict[str, Any] = {
                "cublas": lambda x=x, w=w: F.linear(x, w),
                "triton": lambda x=x, w=w: triton_linear(x, w),
            }
            for sp in SPLITS:  # the kernel alone (the sum left to a consumer), and with the sum as its own kernel
                impls[f"splitk{sp}"] = lambda x=x, w=w, sp=sp: triton_linear_partials(x, w, sp)
                impls[f"splitk{sp}_sum"] = lambda x=x, w=w, sp=sp: triton_linear_partials(x, w, sp).sum(0)
            if compiled is not None:
                impls["inductor"] = lambda x=x, w=w: compiled(x, w)
            for impl, fn in impls.items():
                try:
                    us = time_in_graph(fn)
                    row[f"{impl}_us"] = us
                    row[f"{impl}_weight_gb_s"] = n * k * 2 / us / 1e3
                except Exception as e:  # keep the other columns
                    row[f"{impl}_error"] = repr(e)[:200]
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def print_shape_table(rows: list[dict[str, Any]]) -> None:
    print(f"| shape | rows | {' | '.join(f'{i} µs (GB/s)' for i in ('cublas', 'triton', 'inductor'))} |")
    print("|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[f'{i}_us']:.2f} ({r[f'{i}_weight_gb_s']:.0f})" if f"{i}_us" in r else "-"
                 for i in ("cublas", "triton", "inductor")]  # fmt: skip
        print(f"| {r['shape']} {r['out']}x{r['in']} | {r['rows']} | {' | '.join(cells)} |")


def main() -> None:
    args = _parser().parse_args()
    if args.fma_sweep:
        start = time.perf_counter()
        fma_rows = fma_sweep(args.fma_launches, cold=args.cold)
        print(f"row-kernel sweep: {time.perf_counter() - start:.0f} s", flush=True)
        if args.best_plan:
            write_fma_plan(args.best_plan, fma_rows)
        _write_json(args.json, fma_rows)
        return
    if args.swiglu_fc2:
        _write_json(args.json, swiglu_fc2_rows(args.rows))
        return
    if args.norm_linear:
        start = time.perf_counter()
        rows, summary = norm_linear_rows([m for m in args.rows if m <= 16], args.launches)
        print(f"norm-linear sweep: {time.perf_counter() - start:.0f} s", flush=True)
        if args.best_plan:
            write_norm_linear_plan(args.best_plan, summary)
        _write_json(args.json, rows, summary=summary)
        return
    if args.check or not torch.cuda.is_available():
        check("cuda" if torch.cuda.is_available() else "cpu", torch.float32)
        if torch.cuda.is_available():
            check("cuda", torch.bfloat16)
        return
    check("cuda", torch.bfloat16)
    rows = shape_rows(args.rows, inductor=not args.no_inductor)
    print_shape_table(rows)
    _write_json(args.json, rows)


if __name__ == "__main__":
    main()
