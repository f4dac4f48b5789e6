"""Serving benchmark: llama-1b (random weights, bf16), prompt 128 (``--context``: also longer ones, one request at a
time), 128 output tokens, greedy.

Through the engine at each concurrency (all requests submitted at once, continuous batching): output tokens/s,
time to first token (TTFT) and per-token latency (TPOT: (finish - first token) / (tokens - 1)), p50/p99 over
requests; each concurrency runs ``--repeats`` times and the run of median throughput is reported (with every
run's tokens/s). Through the HTTP server (streaming ``/v1/completions``, uvicorn with the server's own config) at each
``--http-concurrency``, the clients spread over ``--client-processes`` processes, in two layouts (``--http-paths``):
``inprocess``, uvicorn in the engine's process (``mcore-infer serve``), and ``process``, the engine in a process of its
own and this process the front end (``mcore-infer serve --engine-process``; run first, in a subprocess, so that the
GPU memory is its engine's). Optionally the Hugging Face ``generate`` baseline with a static cache + ``torch.compile`` (CUDA graphs) on the
same model shape, in a subprocess (``--hf``).

``--decode-kernels`` picks ``EngineConfig.decode_kernels``: a preset (``auto``, the default, ``none``, ``attention``,
``row``, ``norm_linear``), or a decode plan as JSON (a file, e.g. the one ``gemv_bench.py --best-plan`` writes, or
inline ``'{"preset": "attention", "swiglu_down": true}'``: ``DecodePlan.from_dict``) to A/B single kernels and
launches. The results hold the plan that applied (``decode_plan``) and its row kernels (``row_kernels``).

``--mamba-decode`` picks the Mamba layers' ``mamba.decode_kernel`` (``auto``, the default: the Triton decode step on
CUDA; ``torch``: PyTorch ops; ``triton``); a list such as ``auto,torch`` measures the engine once per value (the model
and engine rebuilt for each; the first value's rows under ``engine``, the others' under ``engine_mamba_decode_<value>``;
HTTP runs use the first value only), e.g. ``--preset mamba2-1.3b --concurrency 1,64 --http-concurrency ""
--mamba-decode auto,torch``.

    PYTHONPATH=packages/mcore-parallel/src:packages/mcore-models/src:packages/mcore-data/src:packages/mcore-infer/src \\
        python bench/serve_bench.py --out results.json [--hf]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import _engine_trace
import torch
from _serve_hf import hf_baseline
from _serve_http import GEN, PROMPT, HTTPServer, http_run, latency_row, prompts, py_spy
from _serve_profile import prefill_profile, profile_run


def decode_kernels(value: str) -> Any:
    """``--decode-kernels``: a preset name, a JSON file of a decode plan, or the plan's JSON itself."""
    from mcore_infer.decode import parse_decode_kernels

    return parse_decode_kernels(value)


def build_llm(args: argparse.Namespace, mamba_decode: str | None = None, ssm_dtype: str | None = None) -> Any:
    """The engine over the preset's model; ``mamba_decode``: its ``mamba.decode_kernel`` (default: the first of
    ``--mamba-decode``); ``ssm_dtype``: ``EngineConfig.mamba_ssm_dtype`` (default: the first of
    ``--mamba-ssm-dtype``)."""
    from mcore_infer import LLM, EngineConfig
    from mcore_models import GPTModel, preset

    torch.manual_seed(0)
    small = dict(num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2)
    over: dict[str, Any] = dict(small) if args.smoke else {}
    if preset(args.preset).hybrid_pattern is not None:
        over["mamba"] = dict(decode_kernel=mamba_decode or args.mamba_decode[0])
        if args.smoke:  # the toy keeps the pattern's first layers
            over.update(hybrid_pattern="M*-"[: over["num_layers"]])
            over["mamba"].update(d_state=16, head_dim=16, chunk_size=16)
    max_len = max([1024, *(c + GEN for c in args.context)])
    if max_len > preset(args.preset).max_position_embeddings:  # (--context: random weights, any length will do)
        over["max_position_embeddings"] = max_len
    model = GPTModel(preset(args.preset, params_dtype=args.dtype, **over), device=args.device).eval()
    cfg = EngineConfig(
        block_size=args.block_size,
        max_model_len=max_len,
        max_num_seqs=args.max_seqs,
        max_num_batched_tokens=args.batched_tokens,
        memory_fraction=0.6,
        compile=args.compile,
        lookahead=args.lookahead,
        side_stream_copies=args.side_stream_copies,
        l2_prefetch=args.l2_prefetch,
        l2_prefetch_up_mb=args.l2_prefetch_up_mb,
        decode_kernels=decode_kernels(args.decode_kernels),
        mamba_ssm_dtype=ssm_dtype or args.mamba_ssm_dtype[0],
    )
    t0 = time.perf_counter()
    llm = LLM(model=model, config=cfg, name="llama-1b")  # (the HTTP clients' model name, whatever the preset)
    print(f"engine ready in {time.perf_counter() - t0:.1f}s: graphs {sorted(llm.runner.graphs)}", flush=True)
    return llm


def engine_run(llm: Any, conc: int, seed: int, prompt: int = PROMPT) -> dict[str, Any]:
    from mcore_infer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    ps = prompts(conc, 32768, seed, prompt)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = llm.generate(ps, params)
    wall = time.perf_counter() - t0
    outs = [g.outputs[0] for g in res]
    assert all(len(o.token_ids) == GEN for o in outs)
    ttft = [(o.metrics["first_token"] - o.metrics["arrival"]) * 1e3 for o in outs]
    tpot = [(o.metrics["finished"] - o.metrics["first_token"]) * 1e3 / (GEN - 1) for o in outs]
    return {**latency_row(conc, wall, ttft, tpot), "preemptions": llm.engine.scheduler.num_preemptions}


def engine_stream_run(llm: Any, conc: int, seed: int) -> dict[str, Any]:
    """As :func:`engine_run` with every request streamed (an output per request and step, as a server asks) and its
    text left to the caller (``detokenize=False``), as the engine process runs it for the HTTP front end."""
    from mcore_infer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    eng = llm.engine
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    rids = [eng.add_request(p, params, stream=True, detokenize=False) for p in prompts(conc, 32768, seed)]
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    while eng.has_work():
        outs = eng.step()
        now = time.perf_counter()
        for o in outs:
            first.setdefault(o.request_id, now)
            if o.finished:
                done[o.request_id] = now
    wall = time.perf_counter() - t0
    ttft = [(first[r] - t0) * 1e3 for r in rids]
    tpot = [(done[r] - first[r]) * 1e3 / (GEN - 1) for r in rids]
    return latency_row(conc, wall, ttft, tpot)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-1b", help="the model (random weights): llama-1b, mamba2-1.3b, ...")
    ap.add_argument("--concurrency", default="1,8,32,64,256")
    ap.add_argument("--http-concurrency", default="1,64,256", help="through HTTP (empty: no HTTP runs)")
    ap.add_argument("--http-paths", default="inprocess,process",
                    help="inprocess: uvicorn in the engine's process; process: the engine in its own process "
                    "(serve --engine-process); process-h11: the same with uvicorn's h11/asyncio fallback; workers: "
                    "--api-workers front-end processes over one engine process (serve --api-workers N)")  # fmt: skip
    ap.add_argument("--http-repeats", type=int, default=3, help="HTTP runs per concurrency; the median is reported")
    ap.add_argument("--http-client", default="httpx",
                    help="the HTTP clients (a list: each level runs with each): httpx (httpx.AsyncClient) or raw (a "
                    "prepared request on an asyncio connection: the least client time)")  # fmt: skip
    ap.add_argument("--client-processes", type=int, default=8, help="processes the HTTP clients are spread over")
    ap.add_argument("--engine-process-timeout", type=float, default=600.0)
    ap.add_argument("--engine-process-only", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workers-only", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--api-workers", default="4", help="front-end processes of the 'workers' HTTP path (a list: "
                    "one run of the path per count, the results of N under http_workers_N, the last also under "
                    "http_workers)")  # fmt: skip
    ap.add_argument("--engine-stream", action="store_true", help="also the engine with every request streamed")
    ap.add_argument("--py-spy", default=None, metavar="DIR",
                    help="sample the engine and front-end processes with py-spy during the HTTP runs at 64 (raw "
                    "collapsed stacks into DIR)")  # fmt: skip
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="write each engine's timeline of adds and steps, with a summary per run, into DIR "
                    "(engine.json, process.json, workersN.json)")  # fmt: skip
    ap.add_argument("--plain-http", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=3, help="engine runs per concurrency; the median is reported")
    ap.add_argument("--context", default="", metavar="N[,N...]",
                    help="also one request at a time after prompts of these lengths (e.g. 128,4096,16384): the "
                         "per-token time a Mamba model keeps flat and attention does not")  # fmt: skip
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--batched-tokens", type=int, default=8192)
    ap.add_argument("--out", default="/tmp/serve_bench.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compile", action="store_true", help="EngineConfig.compile: torch.compile each layer")
    ap.add_argument("--lookahead", action=argparse.BooleanOptionalAction, default=True,
                    help="EngineConfig.lookahead (default on): overlap host and GPU steps")  # fmt: skip
    ap.add_argument("--side-stream-copies", action=argparse.BooleanOptionalAction, default=True,
                    help="EngineConfig.side_stream_copies (default on): two decode input sets, the copies off the "
                    "step's stream")  # fmt: skip
    ap.add_argument("--l2-prefetch", action="store_true",
                    help="EngineConfig.l2_prefetch: the attention pulls the output projection's weight into L2")  # fmt: skip
    ap.add_argument("--l2-prefetch-up-mb", type=float, default=0.0,
                    help="EngineConfig.l2_prefetch_up_mb: also the first MB of the up projection's weight")  # fmt: skip
    ap.add_argument("--decode-kernels", default="auto", metavar="PRESET|PLAN.json|JSON",
                    help="EngineConfig.decode_kernels: auto (default), none, attention, row, norm_linear, or a decode "
                    "plan as JSON (a file or inline)")  # fmt: skip
    ap.add_argument("--mamba-decode", default="auto", metavar="auto|torch|triton[,...]",
                    help="mamba.decode_kernel of a Mamba or hybrid preset (a list: the engine measured once per "
                    "value)")  # fmt: skip
    ap.add_argument("--mamba-ssm-dtype", default="float32", metavar="float32|bfloat16|float16[,...]",
                    help="EngineConfig.mamba_ssm_dtype; several: the engine rows again for each other value")  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="a one-layer toy model (checks the script on CPU)")
    ap.add_argument("--hf", action="store_true", help="also run the HF static-cache baseline (subprocess)")
    ap.add_argument("--hf-only", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--hf-batches", default="1,8,32,64")
    ap.add_argument("--hf-deadline", type=float, default=150.0)
    ap.add_argument(
        "--profile",
        default=None,
        help="write a torch.profiler table of one batch-1 request here, and prefill-only step times with a "
        "profile of one prefill of 6 requests to PATH.prefill",
    )
    return ap


def _dump(results: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def engine_results(llm: Any, args: argparse.Namespace, results: dict[str, Any], key: str = "engine") -> None:
    """After a warm-up, the engine at each ``--concurrency``: the run of median throughput of ``--repeats``, appended
    to ``results[key]`` (written to ``--out`` after each concurrency)."""
    for c in (1, 8, 64):  # warm-up: Triton specialisations of each prefill shape, allocator
        engine_run(llm, c, 1)
    trace = _engine_trace.StepTrace(llm.engine) if args.trace else None
    for c in args.concurrency:
        # the median of a few runs by throughput (one batch-1 run is 128 decode steps, ~0.15 s: noisy alone)
        runs = sorted((engine_run(llm, c, 2 + c + 1000 * i) for i in range(args.repeats)),
                      key=lambda x: x["output_tok_s"])  # fmt: skip
        r = {**runs[len(runs) // 2], "runs_output_tok_s": [x["output_tok_s"] for x in runs]}
        print(json.dumps(r) if key == "engine" else f"{key} {json.dumps(r)}", flush=True)
        results.setdefault(key, []).append(r)
        if args.engine_stream:
            runs = sorted((engine_stream_run(llm, c, 5 + c + 1000 * i) for i in range(args.repeats)),
                          key=lambda x: x["output_tok_s"])  # fmt: skip
            r = {**runs[len(runs) // 2], "runs_output_tok_s": [x["output_tok_s"] for x in runs]}
            print("stream", json.dumps(r), flush=True)
            results.setdefault("engine_stream", []).append(r)
        _dump(results, args.out)
    if trace is not None:
        trace.dump(os.path.join(args.trace, "engine.json"))


def http_levels(
    port: int, args: argparse.Namespace, levels: list[int], pids: dict[str, int] | None = None
) -> list[dict[str, Any]]:
    """At each concurrency of ``levels`` and with each ``--http-client``: one run whose prefill shapes may still
    compile kernels (its tokens/s kept as ``first_run_output_tok_s``), then the run of median throughput of
    ``--http-repeats``."""
    rows = []
    for c in levels:
        for client in args.http_client:
            first = http_run(port, c, args.client_processes, seed=50 + c, client=client)
            spies = py_spy(args, pids or {}, f"c{c}_{client}") if c == 64 else []
            runs = sorted((http_run(port, c, args.client_processes, seed=60 + c + 1000 * i, client=client)
                           for i in range(args.http_repeats)), key=lambda x: x["output_tok_s"])  # fmt: skip
            for sp in spies:
                sp.wait(timeout=60)
            r = {**runs[len(runs) // 2], "client": client, "runs_output_tok_s": [x["output_tok_s"] for x in runs],
                 "first_run_output_tok_s": first["output_tok_s"]}  # fmt: skip
            print(json.dumps(r), flush=True)
            rows.append(r)
    return rows


def front_end_info() -> dict[str, Any]:
    """Which HTTP parser and event loop uvicorn's ``auto`` picks here."""
    import importlib.util

    return {
        "http": "httptools" if importlib.util.find_spec("httptools") else "h11",
        "loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
    }


def http_inprocess(llm: Any, args: argparse.Namespace, results: dict[str, Any]) -> None:
    """``results["http_inprocess"]``: the server and the engine in this process (``mcore-infer serve``'s layout
    without ``--engine-process``)."""
    from mcore_infer.async_engine import AsyncEngine

    try:
        srv = HTTPServer(AsyncEngine(llm.engine), llm.tokenizer)
        try:
            rows = http_levels(srv.port, args, args.http_concurrency, {"inprocess": os.getpid()})
        finally:
            srv.stop()
        results["http_inprocess"] = {"front_end": front_end_info(), "rows": rows}
    except Exception as e:  # keep the engine numbers if the HTTP stack is missing
        results["http_inprocess"] = {"error": repr(e)}
        print("http failed:", repr(e), flush=True)
    _dump(results, args.out)


def warm_llm(args: argparse.Namespace) -> Any:
    """The engine process's LLM (``EngineSpec`` factory): built as in this process, then warmed up the same way."""
    llm = build_llm(args)
    for c in (1, 8, 64):
        engine_run(llm, c, 1)
    if args.trace:  # written when the engine process shuts its LLM down
        tag = f"workers{args.api_workers}" if args.workers_only else "process"
        _engine_trace.install(llm, os.path.join(args.trace, f"{tag}.json"))
    return llm


def _serve_default_main(args: argparse.Namespace, port: int) -> None:
    """``mcore-infer serve``'s default layout at ``--tp 1``, in this (child) process: the engine in a process of its
    own (``EngineClient``), this process's main thread the HTTP front end (uvicorn), until SIGTERM."""
    if args.plain_http:
        sys.modules["httptools"] = None  # type: ignore[assignment]
        sys.modules["uvloop"] = None  # type: ignore[assignment]
    from mcore_infer.engine_process import EngineClient, EngineSpec, WorkerHeader
    from mcore_infer.server import build_app, serve

    client = EngineClient(EngineSpec(warm_llm, (args,))).launch()
    try:
        serve(WorkerHeader(build_app(client, client.tokenizer, "llama-1b", 5.0), 0), "127.0.0.1", port, "warning")
    finally:
        client.shutdown(0.0)


def engine_process_only(args: argparse.Namespace) -> None:
    """``--engine-process-only OUT``: ``mcore-infer serve``'s default layout (:func:`_serve_default_main` in a child
    process: the engine in a process of its own, the front end in the child's main thread), measured from this
    process at each ``--http-concurrency``; ``--plain-http`` hides httptools and uvloop so uvicorn falls back to h11
    and asyncio."""
    out: dict[str, Any] = {"front_end": {"http": "h11", "loop": "asyncio"} if args.plain_http else front_end_info()}
    _measure_server(args, out, _serve_default_main)
    with open(args.engine_process_only, "w") as f:
        json.dump(out, f, indent=1)


def _measure_server(args: argparse.Namespace, out: dict[str, Any], main: Any) -> None:
    """Start ``main(args, port)`` in a child process, wait for its ``/health``, measure it into ``out["rows"]`` (its
    error into ``out["error"]``), stop it with SIGTERM."""
    import multiprocessing as mp
    import signal

    from _serve_http import free_port

    from mcore_infer.engine_process import wait_until_serving

    port = free_port()
    proc = mp.get_context("spawn").Process(target=main, args=(args, port))
    proc.start()
    try:
        t0 = time.perf_counter()
        wait_until_serving(f"http://127.0.0.1:{port}/health", timeout=args.engine_process_timeout)
        out["engine_ready_s"] = time.perf_counter() - t0
        out["rows"] = http_levels(port, args, args.http_concurrency, {"server": proc.pid or 0})
    except Exception as e:
        out["error"] = repr(e)
        print("http failed:", repr(e), flush=True)
    finally:
        if proc.pid is not None and proc.is_alive():
            os.kill(proc.pid, signal.SIGTERM)
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()


def _serve_workers_main(args: argparse.Namespace, port: int) -> None:
    from mcore_infer.engine_process import EngineSpec, serve_workers

    serve_workers(EngineSpec(warm_llm, (args,)), args.api_workers, "127.0.0.1", port, shutdown_timeout=5.0)


def workers_only(args: argparse.Namespace) -> None:
    """``--workers-only OUT``: ``mcore-infer serve --api-workers N``'s layout (``serve_workers`` in a child process:
    the engine process and N front-end processes on one socket), measured at each ``--http-concurrency``."""
    out: dict[str, Any] = {"front_end": front_end_info(), "api_workers": args.api_workers}
    _measure_server(args, out, _serve_workers_main)
    with open(args.workers_only, "w") as f:
        json.dump(out, f, indent=1)


def _subprocess_into(results: dict[str, Any], key: str, args: argparse.Namespace, flags: list[str],
                     timeout: float) -> None:  # fmt: skip
    """Run this script again with ``flags`` (a ``--...-only OUT`` mode, OUT being ``{--out}.{key}.json``) and put
    what it wrote into ``results[key]`` (its error if it wrote nothing)."""
    path = f"{args.out}.{key}.json"
    try:
        cmd = [sys.executable, __file__, flags[0], path, *flags[1:]]
        subprocess.run(cmd, check=False, timeout=timeout, env=os.environ.copy())
        with open(path) as f:
            results[key] = json.load(f)
    except Exception as e:
        results[key] = {"error": repr(e)}
    _dump(results, args.out)


def http_workers(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """``results["http_workers_N"]`` for each ``--api-workers`` count N: :func:`workers_only` in a subprocess (before
    this process builds its engine); the last count's also as ``results["http_workers"]``."""
    for n in args.api_workers:
        key = f"http_workers_{n}"
        _subprocess_into(results, key, args, ["--workers-only", *sys.argv[1:], "--api-workers", str(n)],
                         args.engine_process_timeout + 300)  # fmt: skip
        results["http_workers"] = results[key]


def http_engine_process(args: argparse.Namespace, results: dict[str, Any], plain: bool) -> None:
    """The engine-process layout in a subprocess (before this process builds its engine: the GPU memory is the
    other engine's then), into ``results["http_process"]`` (``"http_process_h11"`` with ``plain``)."""
    flags = ["--engine-process-only", *sys.argv[1:], *(["--plain-http"] if plain else [])]
    _subprocess_into(results, "http_process_h11" if plain else "http_process", args, flags, args.engine_process_timeout)


def hf_results(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The HF baseline in a subprocess of this script (``--hf-only``), into ``results["hf_static_compile"]``."""
    flags = ["--hf-only", "--hf-batches", args.hf_batches, "--hf-deadline", str(args.hf_deadline)]
    _subprocess_into(results, "hf_static_compile", args, flags, args.hf_deadline + 120)


def context_results(llm: Any, lengths: list[int], repeats: int) -> list[dict[str, Any]]:
    """One request of ``GEN`` tokens after a prompt of each length (the median run by per-token time)."""
    rows = []
    for n in lengths:
        engine_run(llm, 1, 99, n)  # warm-up at this length
        runs = sorted((engine_run(llm, 1, seed, n) for seed in range(repeats)), key=lambda r: r["tpot_ms_p50"])
        row = {"context": n, **runs[len(runs) // 2]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    args = _parser().parse_args()
    if args.hf_only:
        res = hf_baseline([int(b) for b in args.hf_batches.split(",")], args.hf_deadline)
        with open(args.hf_only, "w") as f:
            json.dump(res, f, indent=1)
        return
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.http_concurrency = [int(c) for c in args.http_concurrency.split(",") if c.strip()]
    args.api_workers = [int(n) for n in str(args.api_workers).split(",")]
    args.mamba_decode = [v for v in args.mamba_decode.split(",") if v] or ["auto"]
    args.context = [int(c) for c in args.context.split(",") if c.strip()]
    args.mamba_ssm_dtype = [v for v in args.mamba_ssm_dtype.split(",") if v] or ["float32"]
    args.http_client = [c for c in args.http_client.split(",") if c]
    if bad := [c for c in args.http_client if c not in ("httpx", "raw")]:
        raise SystemExit(f"--http-client: unknown client {bad[0]!r} (httpx or raw)")
    if args.workers_only:
        args.api_workers = args.api_workers[-1]
    args.max_seqs = max(args.concurrency + args.http_concurrency)
    if args.engine_process_only:
        engine_process_only(args)
        return
    if args.workers_only:
        workers_only(args)
        return
    paths = [p for p in args.http_paths.split(",") if p] if args.http_concurrency else []
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    results: dict[str, Any] = {"device": dev, "torch": torch.__version__, "engine": []}
    for plain in (False, True):
        if ("process-h11" if plain else "process") in paths:
            http_engine_process(args, results, plain)
    if "workers" in paths:
        http_workers(args, results)
    llm = build_llm(args)
    plan = llm.runner.plan  # what --decode-kernels resolved to on this device and model
    results["decode_plan"] = plan.to_dict()
    from mcore_infer.decode import ROW_KERNELS

    results["row_kernels"] = {k: getattr(plan, k) for k in (*ROW_KERNELS, "norm_gemv")}
    engine_results(llm, args, results)
    if args.context:
        results["context"] = context_results(llm, args.context, args.repeats)
        _dump(results, args.out)
    if args.profile:
        profile_run(llm, args.profile, engine_run, GEN)
        prefill_profile(llm, args.profile + ".prefill")
    if "inprocess" in paths:
        http_inprocess(llm, args, results)
    for value in args.mamba_decode[1:]:  # the engine again with the Mamba layers' other decode steps
        del llm
        torch.cuda.empty_cache()
        llm = build_llm(args, value)
        engine_results(llm, args, results, key=f"engine_mamba_decode_{value}")
    for value in args.mamba_ssm_dtype[1:]:  # and with the SSM states in another dtype
        del llm
        torch.cuda.empty_cache()
        llm = build_llm(args, ssm_dtype=value)
        engine_results(llm, args, results, key=f"engine_mamba_ssm_{value}")
        if args.context:
            results[f"context_mamba_ssm_{value}"] = context_results(llm, args.context, args.repeats)
            _dump(results, args.out)
    if args.hf:
        del llm  # the GPU memory goes to the baseline's process
        torch.cuda.empty_cache()
        hf_results(args, results)
    print(json.dumps({k: v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
