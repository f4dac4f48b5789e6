"""Serving benchmark: llama-1b (random weights, bf16), prompt 128, 128 output tokens, greedy.

Through the engine at each concurrency (all requests submitted at once, continuous batching): output tokens/s,
time to first token (TTFT) and per-token latency (TPOT: (finish - first token) / (tokens - 1)), p50/p99 over
requests; each concurrency runs ``--repeats`` times and the run of median throughput is reported (with every
run's tokens/s). Once through the HTTP server (uvicorn in this process, streaming completions over httpx) at concurrency
64. Optionally the Hugging Face ``generate`` baseline with a static cache + ``torch.compile`` (CUDA graphs) on the
same model shape, in a subprocess (``--hf``).

``--decode-kernels`` picks ``EngineConfig.decode_kernels``: a preset (``auto``, the default, ``none``, ``attention``,
``row``, ``norm_linear``), or a decode plan as JSON (a file, e.g. the one ``gemv_bench.py --best-plan`` writes, or
inline ``'{"preset": "attention", "swiglu_down": true}'``: ``DecodePlan.from_dict``) to A/B single kernels and
launches. The results hold the plan that applied (``decode_plan``) and its row kernels (``row_kernels``).

    PYTHONPATH=packages/mcore-parallel/src:packages/mcore-models/src:packages/mcore-data/src:packages/mcore-infer/src \\
        python bench/serve_bench.py --out results.json [--hf]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import torch

PROMPT, GEN = 128, 128


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def latency_row(conc: int, wall: float, ttft: list[float], tpot: list[float]) -> dict[str, Any]:
    """Throughput and p50/p99 time-to-first-token and per-token latency (ms) of one concurrency level."""
    return {
        "concurrency": conc,
        "output_tok_s": conc * GEN / wall,
        "wall_s": wall,
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "tpot_ms_p50": pct(tpot, 50),
        "tpot_ms_p99": pct(tpot, 99),
    }


def decode_kernels(value: str) -> Any:
    """``--decode-kernels``: a preset name, a JSON file of a decode plan, or the plan's JSON itself."""
    from mcore_infer import DecodePlan

    if value.lstrip().startswith("{"):
        return DecodePlan.from_dict(json.loads(value))
    if value.endswith(".json") or os.path.isfile(value):
        with open(value) as f:
            return DecodePlan.from_dict(json.load(f))
    return value  # a preset name (EngineConfig checks it)


def build_llm(args: argparse.Namespace) -> Any:
    from mcore_infer import LLM, EngineConfig
    from mcore_models import GPTModel, preset

    torch.manual_seed(0)
    small = dict(num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2)
    over: dict[str, Any] = small if args.smoke else {}
    model = GPTModel(preset("llama-1b", params_dtype=args.dtype, **over), device=args.device).eval()
    cfg = EngineConfig(
        block_size=args.block_size,
        max_model_len=1024,
        max_num_seqs=max(args.concurrency),
        max_num_batched_tokens=args.batched_tokens,
        memory_fraction=0.6,
        compile=args.compile,
        lookahead=args.lookahead,
        decode_kernels=decode_kernels(args.decode_kernels),
    )
    t0 = time.perf_counter()
    llm = LLM(model=model, config=cfg, name="llama-1b")
    print(f"engine ready in {time.perf_counter() - t0:.1f}s: graphs {sorted(llm.runner.graphs)}", flush=True)
    return llm


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, PROMPT), generator=g).tolist()


def engine_run(llm: Any, conc: int, seed: int) -> dict[str, Any]:
    from mcore_infer import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    ps = prompts(conc, 32768, seed)
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


def http_run(llm: Any, conc: int, clients: str = "process") -> dict[str, Any]:
    """``conc`` streaming clients against uvicorn serving ``llm`` in this process; the clients run in another
    process (``clients="process"``) or in this one (``"inprocess"``: their Python work then shares the server's
    GIL)."""
    import uvicorn

    from mcore_infer.async_engine import AsyncEngine
    from mcore_infer.server import build_app

    app = build_app(AsyncEngine(llm.engine), llm.tokenizer, "llama-1b")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.05)
    ps = prompts(conc, 32768, 99)
    if clients == "process":  # the clients' own Python work runs beside the server's, not under its GIL
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_http_clients_process, args=(port, ps, queue))
        proc.start()
        wall, res = queue.get(timeout=900)
        proc.join(timeout=60)
    else:
        wall, res = asyncio.run(_http_clients(port, ps))
    server.should_exit = True
    th.join(timeout=30)
    ttft = [(f - s) * 1e3 for s, f, _, _ in res]
    tpot = [(e - f) * 1e3 / (GEN - 1) for _, f, e, _ in res]
    via = "http (streaming /v1/completions), clients in " + (
        "another process" if clients == "process" else "the server's"
    )
    return {**latency_row(conc, wall, ttft, tpot), "via": via}


def _http_clients_process(port: int, ps: list[list[int]], queue: Any) -> None:
    queue.put(asyncio.run(_http_clients(port, ps)))


async def _http_clients(port: int, ps: list[list[int]]) -> tuple[float, list[tuple[float, float, float, int]]]:
    """``len(ps)`` concurrent streaming completions (after one warm-up request): wall time and, per request, its
    start, first-token and end times and the number of events."""
    import httpx

    async def one(client: httpx.AsyncClient, p: list[int]) -> tuple[float, float, float, int]:
        body = {
            "model": "llama-1b",
            "prompt": p,
            "max_tokens": GEN,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        t0 = time.perf_counter()
        first, n = None, 0
        async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if first is None:
                        first = time.perf_counter()
                    n += 1
        end = time.perf_counter()
        assert first is not None
        return t0, first, end, n

    limits = httpx.Limits(max_connections=len(ps) + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one(client, ps[0])  # warm-up
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(client, p) for p in ps))
        return time.perf_counter() - t0, list(res)


# ------------------------------------------------------------------------------------------------ HF baseline
def hf_baseline(batch_sizes: list[int], deadline_s: float) -> list[dict[str, Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32768,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    # a static cache makes generate() compile the decoding forward itself (CUDA graphs, "reduce-overhead")
    model.generation_config.cache_implementation = "static"
    start = time.perf_counter()
    out = []
    for bs in batch_sizes:
        if time.perf_counter() - start > deadline_s:
            out.append({"batch": bs, "skipped": "time budget"})
            continue
        ids = torch.randint(0, 32768, (bs, PROMPT), device="cuda")
        kw = dict(max_new_tokens=GEN, min_new_tokens=GEN, do_sample=False, pad_token_id=0)
        t_c = time.perf_counter()
        for _ in range(2):  # compile + capture, then a warm run
            model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        compile_s = time.perf_counter() - t_c
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        n = (g.shape[1] - PROMPT) * bs
        out.append(
            {
                "batch": bs,
                "output_tok_s": n / wall,
                "ms_per_token": wall * 1e3 / (g.shape[1] - PROMPT),
                "warmup_s": compile_s,
            }
        )
        print("hf", out[-1], flush=True)
    return out


def profile_run(llm: Any, path: str) -> None:
    """Where the time of batch-1 decoding goes: kernel time against wall time, hottest GPU and host ops."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        r = engine_run(llm, 1, 7)
    ka = prof.key_averages()
    gpu_us = sum(getattr(e, "self_device_time_total", 0.0) for e in ka)
    with open(path, "w") as f:
        f.write(json.dumps(r) + "\n")
        f.write(f"total self device time {gpu_us / 1e3:.2f} ms over wall {r['wall_s'] * 1e3:.2f} ms\n\n")
        if torch.cuda.is_available():
            f.write(ka.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90))
        f.write("\n\n")
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=60, max_name_column_width=90))
    print(f"profile written to {path}", flush=True)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,8,32,64,256")
    ap.add_argument("--http-concurrency", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="engine runs per concurrency; the median is reported")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--batched-tokens", type=int, default=8192)
    ap.add_argument("--out", default="serve_bench.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compile", action="store_true", help="EngineConfig.compile: torch.compile each layer")
    ap.add_argument("--lookahead", action=argparse.BooleanOptionalAction, default=True,
                    help="EngineConfig.lookahead (default on): overlap host and GPU steps")  # fmt: skip
    ap.add_argument("--decode-kernels", default="auto", metavar="PRESET|PLAN.json|JSON",
                    help="EngineConfig.decode_kernels: auto (default), none, attention, row, norm_linear, or a decode "
                    "plan as JSON (a file or inline)")  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="a one-layer toy model (checks the script on CPU)")
    ap.add_argument("--hf", action="store_true", help="also run the HF static-cache baseline (subprocess)")
    ap.add_argument("--hf-only", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--hf-batches", default="1,8,32,64")
    ap.add_argument("--hf-deadline", type=float, default=150.0)
    ap.add_argument(
        "--http-clients",
        choices=["process", "inprocess"],
        default="process",
        help="run the HTTP clients in another process (default) or in the server's",
    )
    ap.add_argument("--profile", default=None, help="write a torch.profiler table of one batch-1 request here")
    return ap


def _dump(results: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def engine_results(llm: Any, args: argparse.Namespace, results: dict[str, Any]) -> None:
    """After a warm-up, the engine at each ``--concurrency``: the run of median throughput of ``--repeats``, appended
    to ``results["engine"]`` (written to ``--out`` after each concurrency)."""
    for c in (1, 8, 64):  # warm-up: Triton specialisations of each prefill shape, allocator
        engine_run(llm, c, 1)
    for c in args.concurrency:
        # the median of a few runs by throughput (one batch-1 run is 128 decode steps, ~0.15 s: noisy alone)
        runs = sorted((engine_run(llm, c, 2 + c + 1000 * i) for i in range(args.repeats)),
                      key=lambda x: x["output_tok_s"])  # fmt: skip
        r = {**runs[len(runs) // 2], "runs_output_tok_s": [x["output_tok_s"] for x in runs]}
        print(json.dumps(r), flush=True)
        results["engine"].append(r)
        _dump(results, args.out)


def http_results(llm: Any, args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Two HTTP runs at ``--http-concurrency`` into ``results``: ``http_cold`` against a fresh server (its prefill
    shapes were not all seen by the engine runs, and their kernels compile during it), then ``http``."""
    for key in ("http_cold", "http"):
        try:
            r = http_run(llm, args.http_concurrency, args.http_clients)
            print(key, json.dumps(r), flush=True)
        except Exception as e:  # keep the engine numbers if the HTTP stack is missing
            r = {"error": repr(e), "cause": repr(e.__cause__)}
            print("http failed:", repr(e), flush=True)
        results[key] = r
        _dump(results, args.out)


def hf_results(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """The HF baseline in a subprocess of this script (``--hf-only``), into ``results["hf_static_compile"]``."""
    hf_out = args.out + ".hf.json"
    cmd = [
        sys.executable,
        __file__,
        "--hf-only",
        hf_out,
        "--hf-batches",
        args.hf_batches,
        "--hf-deadline",
        str(args.hf_deadline),
    ]
    try:
        subprocess.run(cmd, check=False, timeout=args.hf_deadline + 120, env=os.environ.copy())
        with open(hf_out) as f:
            results["hf_static_compile"] = json.load(f)
    except Exception as e:
        results["hf_static_compile"] = {"error": repr(e)}
    _dump(results, args.out)


def main() -> None:
    args = _parser().parse_args()
    if args.hf_only:
        res = hf_baseline([int(b) for b in args.hf_batches.split(",")], args.hf_deadline)
        with open(args.hf_only, "w") as f:
            json.dump(res, f, indent=1)
        return
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    results: dict[str, Any] = {"device": dev, "torch": torch.__version__, "engine": []}
    llm = build_llm(args)
    plan = llm.runner.plan  # what --decode-kernels resolved to on this device and model
    results["decode_plan"] = plan.to_dict()
    results["row_kernels"] = {k: getattr(plan, k) for k in ("swiglu_down", "proj_partials", "row_gemv")}
    engine_results(llm, args, results)
    if args.profile:
        profile_run(llm, args.profile)
    if args.http_concurrency:
        http_results(llm, args, results)
    if args.hf:
        del llm  # the GPU memory goes to the baseline's process
        torch.cuda.empty_cache()
        hf_results(args, results)
    print(json.dumps({k: v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()
