"""Throughput of the real training loop (``mcore-train pretrain``) under several layouts (not a test).

Each case is a separate ``torchrun`` of ``mcore_train.cli pretrain`` on mock data; tokens/s come from the run's own
``metrics.jsonl`` (the last logging window, after warm-up). Reports tokens/s per GPU, model TFLOP/s per GPU and the
scaling efficiency against the one-GPU case of the same call.

    python bench/train_scaling_bench.py --preset llama-1b --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# tp2 + SP at micro-batch 8; through NCCL (pinned: the default tp_comm=auto picks symmetric memory on one host)
_TP2_MB8 = ["parallel.tp=2", "parallel.sequence_parallel=true", "training.micro_batch_size=8",
            "training.global_batch_size=32"]  # fmt: skip
_TP2_NCCL = [*_TP2_MB8, "parallel.tp_comm=nccl"]
CASES: dict[str, tuple[int, list[str]]] = {
    "1gpu": (1, ["training.micro_batch_size=4", "training.global_batch_size=16"]),
    "dp2": (2, ["training.micro_batch_size=4", "training.global_batch_size=32"]),
    "dp2-no-overlap": (
        2,
        ["training.micro_batch_size=4", "training.global_batch_size=32", "parallel.overlap_grad_reduce=false"],
    ),
    "tp2-sp": (2, _TP2_NCCL),
}
# One-GPU optimisation ladder (issue 9): each lever on top of the eager baseline, then together, then per micro-batch.
_MB4 = ["training.micro_batch_size=4", "training.global_batch_size=16"]
_COMPILE, _FUSED_CE = "training.compile=layers", "model.cross_entropy_fusion=true"
_MB8_GBS64 = ["training.micro_batch_size=8", "training.global_batch_size=64"]
# levers of the fourth session, not yet measured: SwiGLU backward kernel, gradient-accumulation fusion, contiguous SDPA
_SWIGLU, _GAF = "model.swiglu_backward=triton", "parallel.gradient_accumulation_fusion=true"
_CONTIG = "model.attention_contiguous=true"
# Eight GPUs (issue 10): data-parallel scaling with the distributed optimizer and overlapped gradient reduce, and
# llama3-8b layouts (run with --preset llama3-8b --recipe llama3-8b).
_DIST = ["optimizer.use_distributed_optimizer=true", "parallel.overlap_grad_reduce=true"]
for _dp in (1, 2, 4, 8):  # NCCL pinned, and mcore's peer-to-peer exchange (auto picks it at dp2 only)
    CASES[f"dp{_dp}-distopt"] = (_dp, ["training.micro_batch_size=4", f"training.global_batch_size={16 * _dp}", *_DIST,
                                       "parallel.dp_comm=nccl"])  # fmt: skip
    CASES[f"dp{_dp}-distopt-p2p"] = (_dp, [*CASES[f"dp{_dp}-distopt"][1][:-1], "parallel.dp_comm=p2p"])
for _name, _layout in {
    "8gpu-tp2-dp4": ["parallel.tp=2"],
    "8gpu-tp4-dp2": ["parallel.tp=4"],
    "8gpu-tp2-pp2-dp2": ["parallel.tp=2", "parallel.pp=2"],
    "8gpu-tp8": ["parallel.tp=8"],
}.items():
    # NCCL pinned: symmetric memory is tested on GPUs at tp2 only so far (the default auto would pick it at tp4/tp8)
    CASES[_name] = (8, [*_layout, "parallel.sequence_parallel=true", "parallel.tp_comm=nccl",
                        "training.micro_batch_size=1", "training.global_batch_size=64", *_DIST])  # fmt: skip
CASES.update(
    {
        "1gpu-compile": (1, [*_MB4, _COMPILE]),
        "1gpu-compile-cudnn": (1, [*_MB4, _COMPILE, "model.attention_backend=cudnn"]),
        "1gpu-compile-flash": (1, [*_MB4, _COMPILE, "model.attention_backend=flash"]),
        "1gpu-compile-mb8": (1, ["training.micro_batch_size=8", "training.global_batch_size=16", _COMPILE]),
        # a pretraining-sized batch (64 x 4096 = 262k tokens a step; real runs use 1-4M): the optimizer step and the
        # per-step host syncs are paid once per 8 (or 16) micro-batches instead of once per 2 (or 4)
        "1gpu-compile-mb4-gbs64": (1, ["training.micro_batch_size=4", "training.global_batch_size=64", _COMPILE]),
        "1gpu-compile-mb8-gbs64": (1, [*_MB8_GBS64, _COMPILE]),
        "1gpu-compile-swiglu": (1, [*_MB4, _COMPILE, _SWIGLU]),
        "1gpu-compile-contig": (1, [*_MB4, _COMPILE, _CONTIG]),
        "1gpu-compile-mb8-gbs64-swiglu": (1, [*_MB8_GBS64, _COMPILE, _SWIGLU]),
        "1gpu-compile-mb8-gbs64-gaf": (1, [*_MB8_GBS64, _COMPILE, _GAF]),
        "1gpu-compile-mb8-gbs64-contig": (1, [*_MB8_GBS64, _COMPILE, _CONTIG]),
        "1gpu-compile-mb8-gbs64-all": (1, [*_MB8_GBS64, _COMPILE, _SWIGLU, _GAF, _CONTIG]),
        "1gpu-compile-all": (1, [*_MB4, _COMPILE, _SWIGLU, _GAF, _CONTIG]),
        "tp2-sp-compile": (2, [*_TP2_NCCL, _COMPILE]),
        "tp2-sp-compile-symm": (2, [*_TP2_MB8, _COMPILE, "parallel.tp_comm=symmetric_memory"]),
        "1gpu-compile-mb16-gbs64-all": (
            1,
            ["training.micro_batch_size=16", "training.global_batch_size=64", _COMPILE, _SWIGLU, _GAF, _CONTIG],
        ),
        "1gpu-fused-ce": (1, [*_MB4, _FUSED_CE]),
        "1gpu-opt": (1, [*_MB4, _COMPILE, _FUSED_CE]),
        "1gpu-opt-mb2": (1, ["training.micro_batch_size=2", "training.global_batch_size=16", _COMPILE, _FUSED_CE]),
        "1gpu-opt-mb8": (1, ["training.micro_batch_size=8", "training.global_batch_size=16", _COMPILE, _FUSED_CE]),
        "1gpu-opt-recompute": (1, [*_MB4, _COMPILE, _FUSED_CE, "model.recompute=full"]),
        "dp2-opt": (2, ["training.micro_batch_size=4", "training.global_batch_size=32", _COMPILE, _FUSED_CE]),
        "tp2-sp-opt": (2, [*_TP2_NCCL, _COMPILE, _FUSED_CE]),
    }
)
# tp2 + SP through symmetric memory with the one-GPU levers (compare with 1gpu-compile-all / -mb8-gbs64-all)
_TP2_SYMM = ["parallel.tp=2", "parallel.sequence_parallel=true", _COMPILE, "parallel.tp_comm=symmetric_memory"]
CASES["tp2-sp-compile-symm-all"] = (2, [*_TP2_SYMM, "training.micro_batch_size=8", "training.global_batch_size=32",
                                        _SWIGLU, _GAF, _CONTIG])  # fmt: skip
# experimental: the symmetric-memory linears traced into the compiled layers (no weight-gradient fusion with it)
CASES["tp2-sp-compile-symm-ingraph"] = (2, [*_TP2_SYMM, "training.micro_batch_size=8", "training.global_batch_size=32",
                                            _SWIGLU, _CONTIG, "parallel.tp_comm_in_graph=true"])  # fmt: skip
# twice the micro-batch: half the host work per token (tp2 + SP is host-bound between the compiled pieces); the
# one-GPU case with the same work per GPU and micro-batch is 1gpu-compile-mb8-gbs64-all
CASES["tp2-sp-compile-symm-all-mb16"] = (2, [*_TP2_SYMM, "training.micro_batch_size=16", "training.global_batch_size=64",
                                             _SWIGLU, _GAF, _CONTIG])  # fmt: skip
# inductor's autotuned GEMM templates with fused epilogues (no weight-gradient fusion: its linears leave the graph)
CASES["1gpu-compile-mb8-gbs64-autotune"] = (1, [*_MB8_GBS64, _COMPILE, _SWIGLU, _CONTIG,
                                                "training.compile_mode=max-autotune-no-cudagraphs"])  # fmt: skip
# the loop reading each step's loss before its update (a host sync per step, as before the sixth session), to
# measure the deferred read; and the best case without the contiguous attention copies (neutral-to-negative alone)
_SYNC = "training.read_loss_every_step=true"
CASES["1gpu-compile-mb8-gbs64-all-sync"] = (1, [*_MB8_GBS64, _COMPILE, _SWIGLU, _GAF, _CONTIG, _SYNC])
CASES["1gpu-compile-mb8-gbs64-swiglu-gaf"] = (1, [*_MB8_GBS64, _COMPILE, _SWIGLU, _GAF])
CASES["1gpu-compile-mb16-gbs64-all"] = (1, ["training.micro_batch_size=16", "training.global_batch_size=64", _COMPILE,
                                             _SWIGLU, _GAF, _CONTIG])  # fmt: skip
CASES["1gpu-compile-all-sync"] = (1, [*_MB4, _COMPILE, _SWIGLU, _GAF, _CONTIG, _SYNC])
CASES["tp2-sp-compile-symm-all-sync"] = (2, [*_TP2_SYMM, "training.micro_batch_size=8", "training.global_batch_size=32",
                                             _SWIGLU, _GAF, _CONTIG, _SYNC])  # fmt: skip
# the levers without the contiguous q/k/v copies (model.attention_contiguous), at micro-batch 4 and at tp2 + SP: the
# seventh session's only measurement of it was one of the invalid host-timed rows
CASES["1gpu-compile-swiglu-gaf"] = (1, [*_MB4, _COMPILE, _SWIGLU, _GAF])
CASES["tp2-sp-compile-symm-swiglu-gaf"] = (2, [*_TP2_SYMM, "training.micro_batch_size=8", "training.global_batch_size=32",
                                               _SWIGLU, _GAF])  # fmt: skip
# a pretraining-sized global batch (256 x 4096 = 1M tokens a step) with the eighth session's best levers (no
# contiguous q/k/v copies): the optimizer step, clipping and the step boundary paid once per 32 micro-batches
CASES["1gpu-compile-mb8-gbs256-swiglu-gaf"] = (1, ["training.micro_batch_size=8", "training.global_batch_size=256",
                                                   _COMPILE, _SWIGLU, _GAF])  # fmt: skip
CASES["1gpu-compile-mb8-gbs128-swiglu-gaf"] = (1, ["training.micro_batch_size=8", "training.global_batch_size=128",
                                                   _COMPILE, _SWIGLU, _GAF])  # fmt: skip
CASES["tp2-sp-compile-symm-all-gbs128"] = (2, [*_TP2_SYMM, "training.micro_batch_size=8",
                                               "training.global_batch_size=128", _SWIGLU, _GAF, _CONTIG])  # fmt: skip

# mcore's own exchange over symmetric memory (one barrier per exchange, no local-shard copy on the compute stream),
# next to PyTorch's fused ops in tp2-sp-compile-symm-swiglu-gaf
CASES["tp2-sp-compile-p2p-swiglu-gaf"] = (2, ["parallel.tp=2", "parallel.sequence_parallel=true", _COMPILE,
                                              "parallel.tp_comm=p2p", "training.micro_batch_size=8",
                                              "training.global_batch_size=32", _SWIGLU, _GAF])  # fmt: skip
# data parallelism (ZeRO-1, the recipe's default) with the one-GPU levers, with and without the overlapped reduce-scatter
CASES["dp2-compile-swiglu-gaf"] = (2, ["training.micro_batch_size=4", "training.global_batch_size=32", _COMPILE,
                                       _SWIGLU, _GAF])  # fmt: skip
CASES["dp2-compile-swiglu-gaf-no-overlap"] = (2, [*CASES["dp2-compile-swiglu-gaf"][1],
                                                  "parallel.overlap_grad_reduce=false"])  # fmt: skip
# (since the ninth session parallel.dp_comm=auto exchanges peer to peer on GPUs of one host; these pin NCCL)
CASES["dp2-compile-swiglu-gaf-nccl"] = (2, [*CASES["dp2-compile-swiglu-gaf"][1], "parallel.dp_comm=nccl"])
CASES["dp2-compile-swiglu-gaf-nccl-no-overlap"] = (2, [*CASES["dp2-compile-swiglu-gaf-no-overlap"][1],
                                                       "parallel.dp_comm=nccl"])  # fmt: skip
# the same with each peer's rows pulled in one piece (as first measured) instead of parallel.tp_comm_chunks=2
CASES["tp2-sp-compile-p2p-c1-swiglu-gaf"] = (2, [*CASES["tp2-sp-compile-p2p-swiglu-gaf"][1],
                                                 "parallel.tp_comm_chunks=1"])  # fmt: skip

# the best case with RoPE and the QKV split through PyTorch's ops (inductor's kernels) instead of mcore's Triton kernel
# (model.rope_kernel=triton, the default since the tenth session)
CASES["1gpu-compile-mb8-gbs64-swiglu-gaf-rope-torch"] = (1, [*_MB8_GBS64, _COMPILE, _SWIGLU, _GAF,
                                                             "model.rope_kernel=torch"])  # fmt: skip

# llama3-8b on the two GPUs of an nvidia-h200-x2 (issue 10's large model, until 8 GPUs are lent; run with --preset
# llama3-8b --recipe llama3-8b --seq 8192): tp2 + SP through mcore's exchange, and pp2 (1F1B) without tensor parallelism
_8B = [_COMPILE, _SWIGLU, _GAF, "training.micro_batch_size=1"]
CASES["2gpu-8b-tp2"] = (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "training.global_batch_size=8", *_8B])
CASES["2gpu-8b-pp2"] = (2, ["parallel.tp=1", "parallel.sequence_parallel=false", "parallel.pp=2",
                            "training.global_batch_size=16", *_8B])  # fmt: skip


def run_case(name: str, world: int, overrides: list[str], args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    run_dir = workdir / name
    iters = args.steps + (args.steps // 2 if args.profile else 0)  # profiling: one more window, the last one clean
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "mcore_train.cli", "pretrain", "--recipe", args.recipe, f"model.preset={args.preset}",
           "data.mock=true", "data.tokenizer=byte", f"data.seq_length={args.seq}", f"training.train_iters={iters}",
           f"logging.log_interval={args.steps // 2}", "logging.progress_bar=false", "training.eval_iters=0",
           "training.generate_at_end=0", f"logging.dir={run_dir}", "scheduler.warmup_iters=1",
           *overrides, *args.extra]  # fmt: skip
    if args.profile:  # steps 4-5, after compilation; one more logging window, so that the last one is clean
        cmd.append("logging.profile_steps=[4,6]")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "4"},
                              timeout=args.case_timeout)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"case": name, "world": world, "error": f"timed out after {args.case_timeout} s\n{out[-3000:]}"}
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"case": name, "world": world, "error": (proc.stdout + proc.stderr)[-3000:]}
    if args.profile and (run_dir / "profile-rank0.md").exists():
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        shutil.copy(run_dir / "profile-rank0.md", Path(args.profile) / f"profile-{name}.md")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "tokens_per_s" in r and not r.get("profiled")][-1]
    return {
        "case": name,
        "world": world,
        "overrides": overrides,
        "tokens_per_s": last["tokens_per_s"],
        "tokens_per_s_per_gpu": last["tokens_per_s"] / world,
        "tflops_per_gpu": last["tflops_per_gpu"],
        "mfu": last.get("mfu"),
        "step_s": last["global_batch_size"] * args.seq / last["tokens_per_s"],
        "mem_peak_gib": last.get("mem_peak_gib"),
        "loss": last["loss"],
        "wall_s": wall,
    }


MATMUL = r"""
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ b
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(20):
    a @ b
torch.cuda.synchronize()
print(2 * 8192**3 * 20 / (time.perf_counter() - t) / 1e12)
"""


def measured_peak_tflops() -> float:
    """The bf16 matmul rate of GPU 0, in a subprocess (so this process holds no GPU memory)."""
    out = subprocess.run([sys.executable, "-c", MATMUL], capture_output=True, text=True, check=True, timeout=120)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--recipe", default="llama-1b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cases", nargs="+", default=["1gpu", "dp2", "dp2-no-overlap", "tp2-sp"], choices=list(CASES))
    parser.add_argument("--extra", nargs="*", default=[], help="overrides added to every case")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="profile steps 4-5 of each case on rank 0: DIR/profile-<case>.md (kernel time by class)",
    )
    parser.add_argument("--case-timeout", type=float, default=300)
    parser.add_argument("--measure-peak", action="store_true",
                        help="measure the bf16 matmul rate first and log MFU against it (logging.peak_tflops)")  # fmt: skip
    args = parser.parse_args()
    if args.measure_peak:
        peak = measured_peak_tflops()
        print(f"bf16 matmul ceiling (8192^3): {peak:.0f} TFLOP/s, the MFU denominator", flush=True)
        args.extra = [*args.extra, f"logging.peak_tflops={peak:.1f}"]
    workdir = Path(tempfile.mkdtemp(prefix="scaling_"))
    results = []
    for c in args.cases:
        results.append(run_case(c, *CASES[c], args, workdir))
        print(json.dumps(results[-1])[:2000], flush=True)
    base = next((r for r in results if r["world"] == 1 and "error" not in r), None)
    print("| case | GPUs | tokens/s per GPU | step s | model TFLOP/s per GPU | MFU | peak GiB | vs 1 GPU |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['case']} | {r['world']} | failed | | | | | |")
            print(r["error"], file=sys.stderr)
            continue
        eff = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"] if base else None
        r["scaling_vs_1gpu"] = eff
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
        print(f"| {r['case']} | {r['world']} | {r['tokens_per_s_per_gpu']:,.0f} | {r['step_s']:.3f} | "
              f"{r['tflops_per_gpu']:.0f} | {mfu} | {r['mem_peak_gib'] or 0:.1f} | "
              f"{'-' if eff is None else f'{eff:.1%}'} |")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
