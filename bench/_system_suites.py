"""The serving, kernel, data, checkpoint and GPU-test suites of ``bench/run.py``."""

from __future__ import annotations

import ast
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

from _harness import PY, Context, Suite, table


def serve(ctx: Context) -> list[dict[str, Any]]:
    out = ctx.path("serve.json")
    conc, hf_batches = ("1,64", "1,64") if ctx.quick else ("1,8,32,64,256", "1,8,32,64")
    http = ctx.dry_run or ctx.importable("fastapi", "uvicorn", "httpx")
    step = ctx.run([PY, "bench/serve_bench.py", "--compile", "--lookahead", "--concurrency", conc, "--engine-stream",
                    "--http-concurrency", "1,64,256" if http else "", "--http-paths", "workers,process,inprocess", "--hf",
                    "--hf-batches", hf_batches, "--hf-deadline", "140", "--out", out], timeout=720, out=out)  # fmt: skip
    d = step.data or {}
    hf = {r.get("batch"): r for r in d.get("hf_static_compile", []) if isinstance(r, dict)}
    streamed = {r.get("concurrency"): r for r in d.get("engine_stream", [])}
    rows = []
    for c in (int(x) for x in conc.split(",")):
        r = next((e for e in d.get("engine", []) if e.get("concurrency") == c), {})
        h = hf.get(c, {})
        tok_s, hf_tok_s = r.get("output_tok_s"), h.get("output_tok_s")
        rows.append(ctx.row(step, measured=bool(r), concurrency=c, tok_s=tok_s, ttft_p50=r.get("ttft_ms_p50"),
                            ttft_p99=r.get("ttft_ms_p99"), tpot_p50=r.get("tpot_ms_p50"), tpot_p99=r.get("tpot_ms_p99"),
                            stream_tok_s=streamed.get(c, {}).get("output_tok_s"), hf_tok_s=hf_tok_s,
                            hf_ms=h.get("ms_per_token"),
                            vs_hf=tok_s / hf_tok_s if tok_s and hf_tok_s else None))  # fmt: skip
    cols = [("concurrency", "concurrent requests", "d"), ("tok_s", "output tok/s", ",.0f"),
            ("ttft_p50", "TTFT p50 ms", ".1f"), ("ttft_p99", "TTFT p99 ms", ".1f"),
            ("tpot_p50", "per-token p50 ms", ".3f"), ("tpot_p99", "per-token p99 ms", ".3f"),
            ("stream_tok_s", "streamed tok/s", ",.0f"), ("hf_tok_s", "HF generate tok/s", ",.0f"),
            ("hf_ms", "HF ms/token", ".2f"), ("vs_hf", "vs HF", ".1f")]  # fmt: skip
    notes = ["llama-1b, random weights, bf16, prompt 128 + 128 output tokens, greedy; the engine's GPU defaults "
             "(compiled layers, CUDA graphs, lookahead, the one-row decode kernels); median of 3 runs",
             "streamed: every request streamed, its text left to the caller (as the engine process runs it)",
             "HF: transformers generate() with a static cache and torch.compile, same model shape, same call"]  # fmt: skip
    if d.get("decode_plan"):
        on = [k for k, v in d["decode_plan"].items() if v is True]
        notes.append(f"decode plan (--decode-kernels auto) resolved to: {', '.join(on)}")
    tables = [table("the engine (mcore-infer), one GPU", cols, rows, notes)]
    engine = {e.get("concurrency"): e for e in d.get("engine", [])}
    http_rows = []
    layouts = (("http_workers", "engine process, 4 front-end workers"), ("http_process", "engine process (default)"),
               ("http_inprocess", "engine in the server"))  # fmt: skip
    for key, label in layouts:
        part = d.get(key) or {}
        for r in part.get("rows", []) or [{}]:
            e = engine.get(r.get("concurrency"), {})
            ratio = r["output_tok_s"] / e["output_tok_s"] if r.get("output_tok_s") and e.get("output_tok_s") else None
            ttft = r["ttft_ms_p50"] / e["ttft_ms_p50"] if r.get("ttft_ms_p50") and e.get("ttft_ms_p50") else None
            http_rows.append(ctx.row(step, measured="output_tok_s" in r, name=label, concurrency=r.get("concurrency"),
                                     tok_s=r.get("output_tok_s"), ttft_p50=r.get("ttft_ms_p50"),
                                     tpot_p50=r.get("tpot_ms_p50"), events=r.get("events_per_request"),
                                     engine=e.get("output_tok_s"), ratio=ratio, ttft_ratio=ttft))  # fmt: skip
            if part.get("error"):
                http_rows[-1]["error"] = part["error"]
    http_notes = ["streaming /v1/completions; the clients in 8 other processes; median of 3 runs after one more",
                  "engine process: mcore-infer serve's layout (the engine in a process of its own, uvicorn and the "
                  "detokenization in the front end); 4 front-end workers: serve --api-workers 4; engine in the "
                  "server: uvicorn in the engine's process"]  # fmt: skip
    if not http:
        http_notes.append("not run: fastapi, uvicorn or httpx is not importable (pip install 'mcore-infer[server]' "
                          "httpx, or carry their wheels: --wheels DIR)")  # fmt: skip
    tables.append(table("through the HTTP server", [
        ("name", "layout", ""), ("concurrency", "concurrent requests", "d"), ("tok_s", "output tok/s", ",.0f"),
        ("ttft_p50", "TTFT p50 ms", ".1f"), ("tpot_p50", "per-token p50 ms", ".3f"),
        ("events", "events per request", ".0f"), ("engine", "engine alone, same call", ",.0f"),
        ("ratio", "vs engine", ".3f"), ("ttft_ratio", "TTFT vs engine", ".2f")], http_rows, http_notes))  # fmt: skip
    out = ctx.path("host.json")
    step = ctx.run([PY, "bench/engine_host_bench.py", "--requests", "64", "--out", out], timeout=300, out=out)
    host = [
        ctx.row(step, name=k.removesuffix("_us_per_step").replace("_", " "), us=v)
        for k, v in (step.data or {}).items()
        if k.endswith("_us_per_step")
    ] or [ctx.row(step, name="greedy")]
    tables.append(table("host time of one engine step, 64 running requests", [("name", "sampling", ""),
                  ("us", "µs per step", ".0f")], host,
                  ["the model replaced by a stand-in: scheduling, packing, sampling, detokenization alone"]))  # fmt: skip
    return tables


def kernels(ctx: Context) -> list[dict[str, Any]]:
    tables = []
    out = ctx.path("attention.json")
    step = ctx.run([PY, "bench/attention_bench.py", "--batch", "4", "--seq", "4096", *(["--iters", "3"] * ctx.quick),
                    "--json", out], timeout=300, out=out)  # fmt: skip
    rows = []
    for backend in ("cudnn", "flash"):
        for gqa in ("native", "repeat"):
            ms = [r["ms"] for r in (step.data or {}).get("rows", [])
                  if (r["backend"], r["gqa"]) == (backend, gqa) and "ms" in r]  # fmt: skip
            rows.append(ctx.row(step, measured=bool(ms), name=f"{backend}, keys/values {gqa}",
                                best=min(ms, default=None), worst=max(ms, default=None),
                                tflops=3 * 4 * 4 * 32 * 4096**2 * 64 / 2 / min(ms) / 1e9 if ms else None))  # fmt: skip
    tables.append(table("causal attention forward + backward (SDPA), 4 x 4096 tokens, 32 / 8 heads, head dim 64",
                        [("name", "backend", ""), ("best", "ms, fastest q/k/v layout", ".2f"),
                         ("worst", "ms, slowest layout", ".2f"), ("tflops", "model TFLOP/s", ".0f")], rows,
                        ["layouts: [s, b, h, d], [b, s, h, d], [b, h, s, d] views; causal attention counted half"]))  # fmt: skip
    out = ctx.path("gemv.json")
    launches = ["--fma-launches", "1,8,1024,4", "2,8,1024,4"] if ctx.quick else []
    step = ctx.run([PY, "bench/gemv_bench.py", "--fma-sweep", "--cold", *launches, "--json", out], timeout=400,
                   out=out)  # fmt: skip
    rows = [ctx.row(step, name=name, base=r.get("baseline_us"), best=r.get("best_us"), launch=r.get("best"),
                    speedup=r["baseline_us"] / r["best_us"] if r.get("best_us") else None)
            for name, r in (step.data or {}).get("rows", {}).items()] or [ctx.row(step, name="decode GEMVs")]  # fmt: skip
    tables.append(table("decode GEMMs at one row (llama-1b shapes, in CUDA graphs, each weight read from HBM)", [
        ("name", "weight", ""), ("base", "cuBLAS (+ compiled SwiGLU) µs", ".2f"), ("best", "row kernel µs", ".2f"),
        ("launch", "its launch (splits, block n, block k, warps)", ""), ("speedup", "speed-up", ".2f")], rows,
        ["the engine uses the row kernel where it wins (EngineConfig's auto decode kernels); fc1 stays on cuBLAS"]))  # fmt: skip
    out = ctx.path("swiglu-gemm.json")
    step = ctx.run([PY, "bench/swiglu_gemm_bench.py", *(["--iters", "10"] * ctx.quick), "--out", out], timeout=500,
                   out=out)  # fmt: skip
    got = {r["case"]: r["ms"] for r in (step.data or {}).get("rows", [])}
    rows = []
    for p, what in (("fwd", "forward: up projection + SwiGLU"), ("bwd", "backward: down projection's dh + SwiGLU")):
        tiles = {k: v for k, v in got.items() if k.startswith(f"{p} fused ") and "autotuned" not in k}
        best = min(tiles, key=tiles.get, default=None)
        rows.append(ctx.row(step, measured=bool(got), name=what, unfused=got.get(f"{p} unfused total"),
                            fused=tiles.get(best), tile=best.removeprefix(f"{p} fused ") if best else None,
                            autotuned=got.get(f"{p} fused autotuned")))  # fmt: skip
    tables.append(table("SwiGLU in the MLP's GEMM epilogue (Triton) against cuBLAS + a separate kernel, 32,768 tokens",
                        [("name", "pass", ""), ("unfused", "unfused ms", ".3f"), ("fused", "fused ms, best tile", ".3f"),
                         ("tile", "tile", ""), ("autotuned", "fused ms, autotuned", ".3f")], rows,
                        ["the training MLP keeps cuBLAS: Triton's Hopper mainloop is slower than cuBLAS's"]))  # fmt: skip
    out = ctx.path("rope.json")
    step = ctx.run([PY, "bench/rope_bench.py", *(["--iters", "10"] * ctx.quick), "--json", out], timeout=300, out=out)
    rows = [ctx.row(step, name=r["impl"], fwd=r["fwd_ms"], bwd=r["bwd_ms"], total=r["fwd_bwd_ms"], gbs=r["fwd_gb_s"])
            for r in (step.data or {}).get("rows", [])] or [ctx.row(step, name="triton"), ctx.row(step, name="torch")]  # fmt: skip
    tables.append(table("QKV split + RoPE, one llama-1b micro-batch (8 x 4096 tokens)", [
        ("name", "implementation", ""), ("fwd", "forward ms", ".3f"), ("bwd", "backward ms", ".3f"),
        ("total", "forward + backward ms", ".3f"), ("gbs", "forward GB/s (bytes it must move)", ".0f")], rows,
        ["triton: model.rope_kernel=triton (the default); torch: PyTorch's ops under torch.compile"]))  # fmt: skip
    out = ctx.path("matmul.json")
    step = ctx.run([PY, "bench/matmul_sustained.py", "--seconds", "5" if ctx.quick else "20", "--json", out],
                   timeout=120, out=out)  # fmt: skip
    d = step.data or {}
    tables.append(table("bf16 matmul 8192^3, back to back", [("name", "window", ""), ("tflops", "TFLOP/s", ".0f")],
                        [ctx.row(step, name="first second", tflops=d.get("first")),
                         ctx.row(step, name="second half of the run (sustained)", tflops=d.get("last_half_mean"))],
                        ["a short burst runs at the boost clock; under a sustained load the GPU sits at its power cap"]))  # fmt: skip
    if ctx.gpus > 1:
        out = ctx.path("nccl.json")
        step = ctx.run([PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ctx.gpus}",
                        "bench/nccl_bench.py", "--sizes-mb", "8", "64", "--json", out], timeout=300, out=out)  # fmt: skip
        rows = [ctx.row(step, name=f"{r['op']}, {r['mb_per_rank']:g} MB per rank", ms=r["ms"], algbw=r["algbw_gb_s"],
                        busbw=r["busbw_gb_s"], gemm=r["gemm_alone_ms"], both=r["with_gemm_ms"])
                for r in (step.data or {}).get("rows", [])] or [ctx.row(step, name="collectives")]  # fmt: skip
        tables.append(table(f"NCCL collectives, {ctx.gpus} GPUs (bf16)", [
            ("name", "collective", ""), ("ms", "ms", ".3f"), ("algbw", "algorithm GB/s", ".0f"),
            ("busbw", "bus GB/s", ".0f"), ("gemm", "4 GEMMs alone ms", ".2f"), ("both", "GEMMs + collective ms", ".2f")],
            rows, ["the last two columns: the collective beside 8192^3 GEMMs on another stream (hidden if equal)"]))  # fmt: skip
    return tables


def data(ctx: Context) -> list[dict[str, Any]]:
    out = ctx.path("data.json")
    quick = ["--skip-100m", "--corpus-mb", "8", "--repeats", "1"] if ctx.quick else []
    step = ctx.run([PY, "bench/data_bench.py", "--workdir", ctx.path("data"), *quick, "--out", out], timeout=1800,
                   out=out)  # fmt: skip
    d = step.data or {}
    pre = [ctx.row(step, name=f"{r['tokenizer']}, {r['workers']} worker{'s' * (r['workers'] > 1)}", mb=r["mb"],
                   mb_s=r["mb_s"], wall=r["wall_s"], startup=r["startup_s"], raw=r["raw_mb_s"],
                   vs_raw=r["per_worker_vs_raw"] if r["tokenizer"] != "byte" else None)
           for r in d.get("preprocess", [])]  # fmt: skip
    idx = []
    for r in d.get("index", []):
        meg = next((m for m in d["index"] if m["documents"] == r["documents"] and m["ordering"] == "megatron"), None)
        idx.append(ctx.row(step, name=f"{r['documents'] / 1e6:g} M documents, {r['ordering']} order",
                           build=r["build_s"], rss=r["peak_rss_mb"], reload=r["reload_s"], read=r["read_us"],
                           vs_megatron=meg["build_s"] / r["build_s"] if meg else None))  # fmt: skip
    return [
        table("preprocess (mcore-data preprocess of the demo corpus JSONL)", [
            ("name", "tokenizer, workers", ""), ("mb", "MB", ".1f"), ("mb_s", "MB/s", ".2f"), ("wall", "s", ".2f"),
            ("startup", "start-up s", ".2f"), ("raw", "raw encode MB/s, one thread", ".2f"),
            ("vs_raw", "per worker vs raw encode", ".1%")], pre or [ctx.row(step, name="preprocess")],
            ["anchor: the tokenizer's own single-thread encode loop on the same texts, same call (none for the "
             "byte tokenizer); best of the repeats"]),
        table("GPTDataset index build (sequence 4096, one epoch, fresh process per build)", [
            ("name", "documents, order", ""), ("build", "build s", ".3f"), ("rss", "peak RSS MB", ",.0f"),
            ("reload", "cache reload s", ".4f"), ("read", "read µs per sample", ".0f"),
            ("vs_megatron", "speed-up vs Megatron's order", ".1f")], idx or [ctx.row(step, name="index")],
            ["megatron: Megatron-LM's shuffle and sample index, built by the same code path; fast: the bucketed "
             "shuffle (ordering=fast, the default)"]),
    ]  # fmt: skip


def checkpoint(ctx: Context) -> list[dict[str, Any]]:
    preset = "llama-1b" if ctx.gpus and not ctx.quick else "gpt2-124m"
    out = ctx.path("ckpt.json")
    step = ctx.run([PY, "bench/checkpoint_bench.py", "--preset", preset, "--dir", ctx.path("ckpt"), "--json", out],
                   timeout=900, out=out)  # fmt: skip
    d = step.data or {}
    rows = []
    for key, label in (("mcore", "mcore (sharded zarr)"), ("torch", "torch.save / torch.load"),
                       ("dcp", "torch.distributed.checkpoint")):  # fmt: skip
        save, load = d.get(f"{key}_save_s"), d.get(f"{key}_load_s")
        gb = d.get("state_gb")
        rows.append(ctx.row(step, name=label, save=save, save_gbs=gb / save if gb and save else None, load=load,
                            load_gbs=gb / load if gb and load else None,
                            first=d.get(f"{key}_async_blocking_first_s"), later=d.get(f"{key}_async_blocking_s"),
                            published=d.get(f"{key}_async_total_s")))  # fmt: skip
    cols = [("name", "method", ""), ("save", "save s", ".2f"), ("save_gbs", "GB/s", ".2f"), ("load", "load s", ".2f"),
            ("load_gbs", "GB/s", ".2f"), ("first", "async: caller blocked, first save s", ".2f"),
            ("later", "later saves s", ".2f"), ("published", "until published s", ".2f")]  # fmt: skip
    size = f"{d['state_gb']:.2f} GB in {d['tensors']} tensors" if d.get("state_gb") else "the training state"
    tables = [table(f"{preset} training state ({size}: bf16 weights, fp32 master weights, Adam moments)", cols, rows,
                    ["anchors: torch.save and DCP on the same tensors, same process"])]  # fmt: skip
    out = ctx.path("ckpt-first.json")
    step = ctx.run([PY, "bench/checkpoint_bench.py", "--preset", preset, "--dir", ctx.path("ckpt-first"),
                    "--first-save-only", "reserved", "--json", out], timeout=600, out=out)  # fmt: skip
    d = step.data or {}
    tables.append(table("the first async save of a fresh process, after CheckpointManager.reserve()", [
        ("name", "", ""), ("call", "reserve() returns s", ".3f"), ("background", "background allocation s", ".2f"),
        ("blocked", "first save: caller blocked s", ".2f"), ("published", "until published s", ".2f")],
        [ctx.row(step, name=preset, call=d.get("mcore_reserve_call_s"), background=d.get("mcore_reserve_background_s"),
                 blocked=d.get("mcore_async_blocking_reserved_first_s"),
                 published=d.get("mcore_async_total_reserved_first_s"))],
        ["the training loop calls reserve() after its first step: the pinned staging buffer is allocated while it "
         "trains"]))  # fmt: skip
    return tables


def _imports(node: ast.stmt, path: Path) -> list[tuple[str, Path | None]]:
    """The modules a module-level statement of ``path`` imports: (dotted name, or "" for a relative one; its source
    file when it is this checkout's: ``tests.*`` and relative imports by path, ``mcore_*`` through its spec)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level:
        base = path.parents[node.level - 1].joinpath(*(node.module or "").split("."))
        return [("", f) for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()]
    elif isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    else:
        return []
    out: list[tuple[str, Path | None]] = []
    for name in names:
        source: Path | None = None
        if name.startswith("tests."):
            stem = Path(*name.split("."))
            source = next((f for f in (stem.with_suffix(".py"), stem / "__init__.py") if f.is_file()), None)
        elif name.startswith("mcore_"):
            try:
                spec = importlib.util.find_spec(name)
            except ImportError:
                spec = None
            source = Path(spec.origin) if spec and spec.origin and spec.origin.endswith(".py") else None
        out.append((name, source))
    return out


def _missing_import(path: Path, seen: dict[Path, str | None]) -> str | None:
    """The first package this machine lacks that ``path`` imports at module level, directly or through a module of
    this checkout it imports (a test helper module, ``mcore_infer.server``)."""
    if path not in seen:
        seen[path] = None  # import cycles end here
        for node in ast.parse(path.read_text()).body:
            for name, source in _imports(node, path):
                top = name.split(".")[0]
                gone = top if top and importlib.util.find_spec(top) is None else None
                gone = gone or (_missing_import(source, seen) if source else None)
                if gone:
                    seen[path] = gone
                    return gone
    return seen[path]


def _unimportable_tests(root: str = "tests") -> dict[str, str]:
    """Test files whose module-level imports need a package this machine lacks (the server's fastapi, uvicorn,
    openai on a GPU machine without them), with that package: they hold no GPU test and would only fail to collect."""
    seen: dict[Path, str | None] = {}
    missing = {str(p): _missing_import(p, seen) for p in sorted(Path(root).rglob("test_*.py"))}
    return {p: m for p, m in missing.items() if m}


def gpu_tests(ctx: Context) -> list[dict[str, Any]]:
    skipped_files = _unimportable_tests()
    step = ctx.run([PY, "-m", "pytest", "-q", "-m", "gpu", "tests", "-p", "no:cacheprovider",
                    "-rfE", "--tb=line", "--continue-on-collection-errors", *(f"--ignore={p}" for p in skipped_files)],
                   timeout=900)  # fmt: skip
    summary = [line for line in step.log.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary[-1])} \
        if summary else {}  # fmt: skip
    seconds = re.search(r" in ([\d.]+)s", summary[-1]) if summary else None
    problems = [line for line in step.log.splitlines()
                if line.startswith(("FAILED ", "ERROR ")) or re.match(r"\S+\.py:\d+: \w", line)]  # fmt: skip
    row = ctx.row(step, measured=bool(summary), gpus=ctx.gpus, passed=counts.get("passed", 0 if summary else None),
                  failed=counts.get("failed", 0 if summary else None), skipped=counts.get("skipped"),
                  errors=counts.get("error", counts.get("errors")), seconds=float(seconds[1]) if seconds else None)  # fmt: skip
    cols = [("gpus", "GPUs", "d"), ("passed", "passed", "d"), ("failed", "failed", "d"), ("skipped", "skipped", "d"),
            ("errors", "collection errors", "d"), ("seconds", "seconds", ".0f")]  # fmt: skip
    notes = [f"not collected, {module} is not installed: {path}" for path, module in skipped_files.items()]
    return [table("every test marked gpu", cols, [row], problems[:30] + notes)]


BATCH1_PLANS = {  # the decode plans compared at batch 1: the default first (the anchor), then each fusion left out
    "row (default)": "row",
    "row without norm_gemv": '{"preset": "row", "norm_gemv": false}',
    "row without combine_in_attention": '{"preset": "row", "combine_in_attention": false}',
    "row without row_fc1": '{"preset": "row", "row_fc1": false}',
    "row without embed_rope": '{"preset": "row", "embed_rope": false}',
    "row without argmax_in_graph": '{"preset": "row", "argmax_in_graph": false}',
    "row GEMVs alone (none of the three)": '{"preset": "row", "norm_gemv": false, "combine_in_attention": false, '
    '"row_fc1": false}',
    "row, the copies on the step's stream (side_stream_copies off)": ("row", ["--no-side-stream-copies"]),
    "row, the output projection's weight prefetched into L2 (l2_prefetch)": ("row", ["--l2-prefetch"]),
}


def _per_plan(ctx: Context, plans: dict[str, Any], prefix: str, flags: list[str], timeout: float) -> list[tuple]:
    """Each decode plan of ``plans`` (a plan, or a plan and more ``serve_bench.py`` flags) through ``serve_bench.py``
    (3 runs, one engine each, in turn): ``(name, step, its JSON)``."""
    runs = []
    for i, (name, entry) in enumerate(plans.items()):
        plan, more = entry if isinstance(entry, tuple) else (entry, [])
        out = ctx.path(f"{prefix}-{i}.json")
        step = ctx.run([PY, "bench/serve_bench.py", "--compile", *flags, *more, "--repeats", "3", "--http-concurrency",
                        "", "--decode-kernels", plan, "--out", out], timeout=timeout, out=out)  # fmt: skip
        runs.append((name, step, step.data or {}))
    return runs


def serve_batch1(ctx: Context) -> list[dict[str, Any]]:
    """Batch-1 decode of llama-1b under each plan of :data:`BATCH1_PLANS` (one engine each, in turn), and the MLP
    half of a decode layer through ``mlp_decode_bench.py``."""
    rows, anchor = [], None
    for name, step, data in _per_plan(ctx, BATCH1_PLANS, "batch1", ["--concurrency", "1"], 420):
        r = next(iter(data.get("engine", [])), {})
        anchor = anchor if anchor is not None else r.get("tpot_ms_p50")
        rows.append(ctx.row(step, measured=bool(r), name=name, tpot=r.get("tpot_ms_p50"), tok_s=r.get("output_tok_s"),
                            ratio=anchor / r["tpot_ms_p50"] if anchor and r.get("tpot_ms_p50") else None))  # fmt: skip
    tables = [table("batch-1 decode, llama-1b, one engine per decode plan", [
        ("name", "decode plan", ""), ("tpot", "ms per token (p50)", ".3f"), ("tok_s", "output tok/s", ",.0f"),
        ("ratio", "speed vs row", ".3f")], rows,
        ["random weights, bf16, prompt 128 + 128 output tokens, greedy, compiled layers, CUDA graphs; median of 3 "
         "runs; the plans run one after another in the same call"])]  # fmt: skip
    out = ctx.path("mlp.json")
    step = ctx.run([PY, "bench/mlp_decode_bench.py", "--json", out], timeout=300, out=out)
    mlp = [ctx.row(step, name=k, us=v.get("us_per_layer"), tb_s=v.get("tb_per_s"))
           for k, v in ((step.data or {}).get("paths") or {"(not measured)": {}}).items()]  # fmt: skip
    tables.append(table("the MLP half of a decode layer (add + norm, MLP), 16 layers in one CUDA graph", [
        ("name", "path (launch BLOCK_F,BLOCK_K,BLOCK_H,WARPS)", ""), ("us", "µs per layer", ".2f"),
        ("tb_s", "weight TB/s", ".2f")], mlp, ["cublas+swiglu_down is what the row plan runs"]))  # fmt: skip
    return tables


ATTENTION_LAUNCHES = {  # the paged attention's launches (STEP,MAX_SPLITS,SKIP_EMPTY,WARPS[,MIN_BLOCKS]); the default first
    "default (8,16,1,8,8 for steps of up to 4 tokens, else 1,16,0,4)": None,
    "1,16,0,4": "1,16,0,4",
    "1,16,1,4": "1,16,1,4",
    "2,16,1,4": "2,16,1,4",
    "4,16,1,4": "4,16,1,4",
    "4,64,1,4": "4,64,1,4",
    "8,64,1,8": "8,64,1,8",
    "8,1,0,8": "8,1,0,8",
    "4,16,1,4,4": "4,16,1,4,4",
    "8,16,1,8,8": "8,16,1,8,8",
}


def serve_attention(ctx: Context) -> list[dict[str, Any]]:
    """llama-1b decode at one and 64 requests and one request after a 16k prompt under each paged-attention launch
    of :data:`ATTENTION_LAUNCHES` (the row plan, one engine each, in turn)."""
    plans = {name: "row" if launch is None else json.dumps({"preset": "row", "launches": {"attention": launch}})
             for name, launch in ATTENTION_LAUNCHES.items()}  # fmt: skip
    flags = ["--concurrency", "1,64", "--context", "" if ctx.quick else "16384"]
    rows, anchor = [], None
    for name, step, data in _per_plan(ctx, plans, "attention", flags, 300):
        by = {r.get("concurrency"): r for r in data.get("engine", [])}
        long = next(iter(data.get("context", [])), {})
        one = by.get(1, {}).get("tpot_ms_p50")
        anchor = anchor if anchor is not None else one
        rows.append(ctx.row(step, measured=bool(by), name=name, tpot=one, ratio=anchor / one if anchor and one else None,
                            tok64=by.get(64, {}).get("output_tok_s"), long=long.get("tpot_ms_p50")))  # fmt: skip
    return [table("paged-attention launches, llama-1b decode, one engine per launch", [
        ("name", "launch (blocks a step, split cap, skip empty, warps, fewest blocks a split)", ""), ("tpot", "batch 1 ms/token", ".3f"),
        ("ratio", "batch-1 speed vs default", ".3f"), ("tok64", "64 requests tok/s", ",.0f"),
        ("long", "after a 16k prompt ms/token", ".3f")], rows,
        ["random weights, bf16, prompt 128 + 128 output tokens, greedy, compiled layers, CUDA graphs, the row plan; "
         "median of 3 runs; the launches run one after another in the same call"])]  # fmt: skip


CONTEXTS = "128,4096,16384"
UNGATED_PLAN = '{"preset": "row", "gated_norm_gemv": false}'
"""The row plan without the Mamba layers' gated norm inside their out-projection (serve-mamba times it beside the
default, which has it)."""


def serve_mamba(ctx: Context) -> list[dict[str, Any]]:
    """mamba2-1.3b through the engine at 1 and 64 requests with float32 and bf16 SSM states, and one request after
    prompts of 128 to 16k tokens beside llama-1b's (attention's KV cache grows, Mamba's state does not); one request
    under the attention plan, whose Mamba layers run without the row kernels, and under the row plan with
    the norm as its own kernel (``gated_norm_gemv`` off), beside the default (row) plan."""
    contexts = ["--context", "128" if ctx.quick else CONTEXTS]
    runs = {"mamba2-1.3b": ["--preset", "mamba2-1.3b", "--concurrency", "1,64", "--mamba-ssm-dtype", "float32,bfloat16",
                            *contexts],
            "llama-1b": ["--preset", "llama-1b", "--concurrency", "1", *contexts],
            "mamba2-1.3b-attention-plan": ["--preset", "mamba2-1.3b", "--concurrency", "1", "--decode-kernels",
                                           "attention"],
            "mamba2-1.3b-ungated": ["--preset", "mamba2-1.3b", "--concurrency", "1", "--decode-kernels",
                                    UNGATED_PLAN]}  # fmt: skip
    data: dict[str, Any] = {}
    steps = {}
    for name, flags in runs.items():
        out = ctx.path(f"serve-{name}.json")
        steps[name] = ctx.run([PY, "bench/serve_bench.py", "--compile", *flags, "--repeats", "2", "--http-concurrency",
                               "", "--out", out], timeout=540, out=out)  # fmt: skip
        data[name] = steps[name].data or {}
    engine = []
    for key, label in (("engine", "float32"), ("engine_mamba_ssm_bfloat16", "bfloat16")):
        for r in data["mamba2-1.3b"].get(key, []) or [{}]:
            engine.append(ctx.row(steps["mamba2-1.3b"], measured=bool(r), states=label, concurrency=r.get("concurrency"),
                                  tok_s=r.get("output_tok_s"), ttft=r.get("ttft_ms_p50"), tpot=r.get("tpot_ms_p50")))  # fmt: skip
    context = []
    for name, key, label in (("mamba2-1.3b", "context", "mamba2-1.3b, float32 states"),
                             ("mamba2-1.3b", "context_mamba_ssm_bfloat16", "mamba2-1.3b, bf16 states"),
                             ("llama-1b", "context", "llama-1b (KV cache)")):  # fmt: skip
        for r in data[name].get(key, []) or [{}]:
            context.append(ctx.row(steps[name], measured=bool(r), model=label, context=r.get("context"),
                                   tpot=r.get("tpot_ms_p50"), ttft=r.get("ttft_ms_p50")))  # fmt: skip
    plans = []
    for name, label in (("mamba2-1.3b", "row (the default): the projections as row GEMVs, the norm inside the "
                                        "in-projection's, the gated norm inside the out-projection's"),
                        ("mamba2-1.3b-attention-plan", "attention: cuBLAS projections, the norm and the residual add "
                                                       "compiled"),
                        ("mamba2-1.3b-ungated", "row without gated_norm_gemv: the gated norm a kernel of its "
                                                "own")):  # fmt: skip
        r = next((r for r in data[name].get("engine", []) if r.get("concurrency") == 1), {})
        plans.append(ctx.row(steps[name], measured=bool(r), plan=label, tok_s=r.get("output_tok_s"),
                             tpot=r.get("tpot_ms_p50")))  # fmt: skip
    for row in plans:
        if row.get("tpot") and plans[1].get("tpot"):
            row["vs_attention"] = plans[1]["tpot"] / row["tpot"]
    notes = ["random weights, bf16, 128 output tokens, greedy, compiled layers, CUDA graphs, the Triton decode step; "
             "median of 2 runs"]  # fmt: skip
    return [
        table("serving mamba2-1.3b, one request: the decode plan's fusions on its layers", [
            ("plan", "decode plan", ""), ("tok_s", "output tok/s", ",.0f"), ("tpot", "per token p50 ms", ".3f"),
            ("vs_attention", "vs attention", ".3f")], plans, notes),
        table("serving mamba2-1.3b: SSM states in float32 and bf16", [
            ("states", "SSM states", ""), ("concurrency", "requests", "d"), ("tok_s", "output tok/s", ",.0f"),
            ("ttft", "TTFT p50 ms", ".1f"), ("tpot", "per token p50 ms", ".3f")], engine, notes),
        table("one request after a prompt of N tokens: per-token time", [
            ("model", "model", ""), ("context", "prompt tokens", ",d"), ("tpot", "per token p50 ms", ".3f"),
            ("ttft", "TTFT ms", ".1f")], context, notes),
    ]  # fmt: skip


SYSTEM_SUITES = [
    Suite("serve", "llama-1b serving on one GPU: the engine at 1 to 256 concurrent requests, the HTTP server at 1, 64 "
          "and 256 in both process layouts, "
          "the engine's host time per step", "Hugging Face generate() with a static cache and torch.compile, same "
          "call", 7, 1, serve),
    Suite("serve-batch1", "llama-1b batch-1 decode under the row plan without each of its fusions (norm inside the "
          "QKV GEMV, the attention's combine in its kernel, the up projection as a row GEMV, the three; the embedding "
          "and rotary rows as one kernel, the greedy draw inside the decode graphs), with the "
          "copies on the step's stream (side_stream_copies off), with the output projection's weight prefetched into "
          "L2 by the attention (l2_prefetch), and the MLP half of a decode layer", "the row plan (the default) and the row plan's MLP, same call", 10,
          1, serve_batch1),
    Suite("serve-attention", "llama-1b decode at 1 and 64 requests and after a 16k prompt under paged-attention "
          "launches of several cache blocks a loop step, a higher split cap and empty splits skipped",
          "the default launch, same call", 6, 1, serve_attention),
    Suite("serve-mamba", "mamba2-1.3b serving: 1 and 64 requests with float32 and bf16 SSM states; one request after "
          "prompts of 128 to 16k tokens beside llama-1b; one request under the attention plan (no row kernels) and with "
          "the gated norm as its own kernel",
          "llama-1b's per-token time at the same prompt lengths; the default plan, same call", 10, 1, serve_mamba),
    Suite("kernels", "attention backends, decode GEMVs, SwiGLU GEMM epilogues, the QKV/RoPE kernel, the matmul rate "
          "burst and sustained, NCCL collectives (with more than one GPU)",
          "cuBLAS, PyTorch's ops under torch.compile, the other SDPA backend, same process", 5, 1, kernels,
          use=lambda v: max(v, 1)),
    Suite("data", "mcore-data preprocess throughput and GPTDataset index build, reload and read",
          "the tokenizer's raw encode loop and Megatron's index order, same call", 5, 0, data, use=lambda v: 0),
    Suite("checkpoint", "save, load and async save of a training state (llama-1b on a GPU, gpt2-124m on a CPU)",
          "torch.save and torch.distributed.checkpoint on the same tensors, same process", 5, 0, checkpoint,
          use=lambda v: min(v, 1)),
    Suite("gpu-tests", "every test marked gpu (kernels, NCCL parity, CUDA graphs) on the GPUs it is given",
          "the float64 / CPU references inside the tests", 9, 1, gpu_tests, use=lambda v: max(v, 1)),
]  # fmt: skip
