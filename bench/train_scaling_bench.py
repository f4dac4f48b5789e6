"""Throughput of the real training loop (``mcore-train pretrain``) for named cases (not a test).

Each case is one ``torchrun`` of ``mcore_train.cli pretrain`` on mock data with the case's model, sequence length,
number of GPUs and overrides; tokens/s, model TFLOP/s and peak memory come from the run's own ``metrics.jsonl`` (the
last logging window, after compilation and warm-up). Cases that train the same model on one GPU and on several are
compared per GPU (the scaling efficiency). ``--measure-peak`` measures the bf16 matmul rate first (8192^3, GPU 0) and
the loop reports MFU against it.

A setting's effect is an A/B of override lists, not another case: ``--extra`` adds overrides to every case, each
``--variant`` runs every case once more with its overrides added (labelled ``case+overrides``), and ``--repeat``
runs the whole sequence again, so that A and B alternate::

    python bench/train_scaling_bench.py --measure-peak --cases llama-1b/best llama-1b/best-mb4
    python bench/train_scaling_bench.py --cases llama-1b/best --extra training.global_batch_size=64 \\
        --variant model.rope_kernel=torch --repeat 2
    python bench/train_scaling_bench.py --cases llama-1b/best-mb4 tp2-sp --extra parallel.tp_comm=nccl
    python bench/train_scaling_bench.py --list
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Case:
    world: int
    """GPUs (torchrun processes)."""
    overrides: tuple[str, ...]
    """``mcore-train`` overrides on top of the model's recipe."""
    about: str
    """What the case is, in a line."""
    preset: str = "llama-1b"
    """Model preset; the recipe of the same name supplies the optimizer and schedule."""
    seq: int = 4096
    """Sequence length."""


def _batch(micro: int, global_: int) -> tuple[str, str]:
    return f"training.micro_batch_size={micro}", f"training.global_batch_size={global_}"


# The speed switches, spelt out (on CUDA they are also what `auto`, their default, picks; the Triton SwiGLU backward and
# QKV/RoPE kernels are on by default everywhere).
FAST = ("training.compile=layers", "parallel.gradient_accumulation_fusion=true")
EAGER = ("training.compile=none", "parallel.gradient_accumulation_fusion=false")
_SP = ("parallel.sequence_parallel=true",)
_8B = {"preset": "llama3-8b", "seq": 8192}
_MLP_RECOMPUTE = ("model.recompute=selective", "model.recompute_modules=[mlp]")

CASES: dict[str, Case] = {
    "llama-1b/best": Case(1, (*_batch(8, 256), *FAST),
                          "compiled layers, weight-gradient fusion, micro-batch 8, global batch 256 (1M tokens)"),
    "llama-1b/best-mb4": Case(1, (*_batch(4, 16), *FAST),
                              "the same switches at micro-batch 4, global batch 16: the memory point, and the "
                              "one-GPU reference of dp2 and tp2-sp"),
    "llama-1b/eager-mb4": Case(1, (*_batch(4, 16), *EAGER), "eager layers, no weight-gradient fusion, micro-batch 4"),
    "llama-1b/fp8": Case(1, (*_batch(8, 256), *FAST, "model.fp8=hybrid"),
                         "llama-1b/best with FP8 linears (hybrid: E4M3 forward, E5M2 gradients; tensorwise scaling)"),
    "dp2": Case(2, (*_batch(4, 32), *FAST), "data parallel on 2 GPUs, ZeRO-1, overlapped gradient reduction"),
    "dp4": Case(4, (*_batch(4, 64), *FAST), "data parallel on 4 GPUs"),
    "dp8": Case(8, (*_batch(4, 128), *FAST), "data parallel on 8 GPUs"),
    "tp2-sp": Case(2, ("parallel.tp=2", *_SP, *_batch(8, 32), *FAST),
                   "tensor parallel 2 with sequence parallelism, micro-batch 8"),
    "llama3-8b/tp2-sp": Case(2, ("parallel.tp=2", *_SP, *_batch(1, 8), *FAST),
                             "llama3-8b, tensor parallel 2 + sequence parallelism", **_8B),
    "llama3-8b/tp2-sp-fp8": Case(2, ("parallel.tp=2", *_SP, *_batch(1, 8), *FAST, "model.fp8=hybrid"),
                                 "llama3-8b/tp2-sp with FP8 linears (hybrid, tensorwise)", **_8B),
    "llama3-8b/pp2": Case(2, ("parallel.tp=1", "parallel.sequence_parallel=false", "parallel.pp=2",
                              *_batch(1, 16), *FAST), "llama3-8b, pipeline parallel 2 (1F1B), no tensor parallelism",
                          **_8B),
    "llama3-8b/tp2-dp4": Case(8, ("parallel.tp=2", *_SP, *_batch(1, 32), *FAST), "llama3-8b on 8 GPUs", **_8B),
    "llama3-8b/tp4-dp2": Case(8, ("parallel.tp=4", *_SP, *_batch(1, 16), *FAST), "llama3-8b on 8 GPUs", **_8B),
    "llama3-8b/tp2-pp2-dp2": Case(8, ("parallel.tp=2", *_SP, "parallel.pp=2", *_batch(1, 32), *FAST),
                                  "llama3-8b on 8 GPUs", **_8B),
    "moe-8x4k/mb4": Case(1, (*_batch(4, 64), *FAST), "moe-8x4k (8 experts of ffn 4096, top-2: llama-1b's active "
                         "FLOPs, 3.5 B parameters), compiled layers, micro-batch 4", preset="moe-8x4k"),
    "moe-8x4k/mb8": Case(1, (*_batch(8, 64), *FAST), "moe-8x4k at micro-batch 8", preset="moe-8x4k"),
    "moe-8x4k/8-layers": Case(1, (*_batch(8, 64), *FAST, "model.num_layers=8"), "moe-8x4k cut to 8 layers (2.2 B "
                              "parameters: its state fits an 80 GB GPU), micro-batch 8", preset="moe-8x4k"),
    "moe-32x1k/mb4": Case(1, (*_batch(4, 64), *FAST), "moe-32x1k (32 experts of ffn 1024, top-8), compiled layers, "
                          "micro-batch 4", preset="moe-32x1k"),
    "moe-32x1k/mb8": Case(1, (*_batch(8, 64), *FAST), "moe-32x1k at micro-batch 8", preset="moe-32x1k"),
    # long context (train-long): micro-batch 1, 131,072 tokens a step; at 128k the fused loss keeps float32 logits
    # of the whole sequence from existing and the MLPs of 8 layers are recomputed (what does not fit otherwise)
    "llama-1b/16k": Case(1, (*_batch(1, 8), *FAST), "llama-1b at sequence 16,384", seq=16384),
    "llama-1b/32k": Case(1, (*_batch(1, 4), *FAST), "llama-1b at sequence 32,768", seq=32768),
    "llama-1b/64k": Case(1, (*_batch(1, 2), *FAST), "llama-1b at sequence 65,536", seq=65536),
    "llama-1b/128k": Case(1, (*_batch(1, 1), *FAST, "model.cross_entropy_fusion=true", *_MLP_RECOMPUTE,
                              "model.recompute_num_layers=8"),
                          "llama-1b at sequence 131,072, fused loss, the MLPs of 8 layers recomputed", seq=131072),
    "llama-1b/64k-full": Case(1, (*_batch(1, 2), *FAST, "model.recompute=full"), "llama-1b at 65,536, full "
                              "recompute", seq=65536),
    "llama-1b/128k-full": Case(1, (*_batch(1, 1), *FAST, "model.recompute=full"), "llama-1b at 131,072, full "
                               "recompute", seq=131072),
    # context parallelism on two GPUs: each GPU holds half of every sequence (against one GPU at that half)
    "llama-1b/128k-cp2": Case(2, ("parallel.cp=2", "parallel.cp_comm=p2p", *_batch(1, 2), *FAST),
                              "llama-1b at 131,072 over cp 2 (65,536 per GPU), ring attention", seq=131072),
    "llama-1b/256k-cp2": Case(2, ("parallel.cp=2", "parallel.cp_comm=p2p", *_batch(1, 1), *FAST,
                                  "model.cross_entropy_fusion=true", *_MLP_RECOMPUTE, "model.recompute_num_layers=8"),
                              "llama-1b at 262,144 over cp 2 (131,072 per GPU), as llama-1b/128k", seq=262144),
    # Mamba-2 and hybrid (train-mamba): the chunk length of the SSD scan is a variant (model.mamba.chunk_size)
    "mamba2-1.3b/mb4": Case(1, (*_batch(4, 16), *FAST), "mamba2-1.3b (48 Mamba-2 layers of width 2048) at sequence "
                            "4,096, micro-batch 4", preset="mamba2-1.3b"),
    "mamba2-1.3b/16k": Case(1, (*_batch(1, 8), *FAST), "mamba2-1.3b at sequence 16,384, as llama-1b/16k",
                            preset="mamba2-1.3b", seq=16384),
    "hybrid-1b/4k": Case(1, (*_batch(4, 16), *FAST), "hybrid-1b at sequence 4,096, micro-batch 4, as "
                         "llama-1b/best-mb4", preset="hybrid-1b"),
    "hybrid-1b/16k": Case(1, (*_batch(1, 8), *FAST), "hybrid-1b (14 Mamba-2, 2 attention, 16 MLP layers) at sequence "
                          "16,384, as llama-1b/16k", preset="hybrid-1b", seq=16384),
    "moe-8x4k/ep2": Case(2, ("parallel.ep=2", *_batch(4, 128), *FAST), "moe-8x4k, expert parallel 2 (dp 2)",
                         preset="moe-8x4k"),
}  # fmt: skip


def _first_traceback(out: str, keep: int = 6000) -> str:
    """The first traceback of ``out`` through its exception line (the middle frames cut to ``keep`` characters), or
    the last ``keep`` characters without one."""
    first = out.find("Traceback (most recent call last)")
    if first < 0:
        return out[-keep:]
    lines = out[first:].splitlines()
    end = next((i for i, line in enumerate(lines[1:], 1) if line and not line[0].isspace()), len(lines) - 1)
    if lines[end].rstrip().endswith(":"):  # a wrapper's message (inductor's SubprocException): its cause follows
        end = min(end + 60, len(lines) - 1)
    text = "\n".join(lines[: end + 1])
    return text if len(text) <= keep else text[: keep // 2] + "\n...\n" + text[-keep // 2 :]


def run_case(label: str, case: Case, extra: list[str], args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    run_dir = workdir / label.replace("/", "_").replace("=", "-")
    iters = args.steps + (args.steps // 2 if args.profile else 0)  # profiling: one more window, the last one clean
    overrides = [*case.overrides, *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={case.world}",
           "-m", "mcore_train.cli", "pretrain", "--recipe", case.preset, f"model.preset={case.preset}",
           "data.mock=true", "data.tokenizer=byte", f"data.seq_length={case.seq}", f"training.train_iters={iters}",
           f"logging.log_interval={args.steps // 2}", "logging.progress_bar=false", "training.eval_iters=0",
           "training.generate_at_end=0", f"logging.dir={run_dir}", "scheduler.warmup_iters=1",
           *overrides, *args.peak]  # fmt: skip
    if args.profile:  # steps 4-5, after compilation; one more logging window, so that the last one is clean
        cmd.append("logging.profile_steps=[4,6]")
    head = {"case": label, "world": case.world, "preset": case.preset, "seq": case.seq, "overrides": overrides}
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "4"},
                              timeout=args.case_timeout)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {**head, "error": f"timed out after {args.case_timeout} s\n{out[-3000:]}"}
    wall = time.perf_counter() - start
    if proc.returncode != 0:  # the first traceback is the training process's own (torchrun's wrapper follows it)
        out = proc.stdout + proc.stderr
        return {**head, "error": _first_traceback(out)}
    if args.profile and (run_dir / "profile-rank0.md").exists():
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        shutil.copy(run_dir / "profile-rank0.md", Path(args.profile) / f"profile-{run_dir.name}.md")
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "tokens_per_s" in r and not r.get("profiled")][-1]
    return {
        **head,
        "tokens_per_s": last["tokens_per_s"],
        "tokens_per_s_per_gpu": last["tokens_per_s"] / case.world,
        "tflops_per_gpu": last["tflops_per_gpu"],
        "mfu": last.get("mfu"),
        "step_s": last["global_batch_size"] * case.seq / last["tokens_per_s"],
        "mem_peak_gib": last.get("mem_peak_gib"),
        "loss": last["loss"],
        "wall_s": wall,
    }


MATMUL = f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); " + (
    "from _timing import bf16_matmul_tflops; print(bf16_matmul_tflops())"
)


def measured_peak_tflops() -> float:
    """The bf16 matmul rate of GPU 0, in a subprocess (so this process holds no GPU memory)."""
    out = subprocess.run([sys.executable, "-c", MATMUL], capture_output=True, text=True, check=True, timeout=120)
    return float(out.stdout.strip().splitlines()[-1])


def _cp(r: dict[str, Any]) -> int:
    return int(next((o.split("=", 1)[1] for o in reversed(r["overrides"]) if o.startswith("parallel.cp=")), 1))


def add_scaling(results: list[dict[str, Any]]) -> None:
    """``scaling_vs_1gpu``: tokens/s per GPU against the first one-GPU case of the same model and sequence per GPU
    (a context-parallel case's sequence divided by ``cp``)."""
    for r in results:
        seq = r["seq"] // _cp(r)
        base = next((b for b in results if b["world"] == 1 and "error" not in b
                     and (b["preset"], b["seq"]) == (r["preset"], seq)), None)  # fmt: skip
        if base is not None and "error" not in r:
            r["scaling_vs_1gpu"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["llama-1b/best-mb4", "dp2", "tp2-sp"], choices=list(CASES),
                        metavar="CASE", help="named cases (--list shows them)")  # fmt: skip
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--steps", type=int, default=10, help="training steps per case (even; last half is timed)")
    parser.add_argument("--extra", nargs="*", default=[], help="overrides added to every case")
    parser.add_argument("--variant", nargs="+", action="append", default=[], metavar="OVERRIDE",
                        help="also run each case with these overrides added (repeat the flag for more variants)")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=1, help="run the cases (or A/B pairs) this many times")
    parser.add_argument("--out", default=None, help="write the results here (JSON)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="profile steps 4-5 of each case on rank 0: DIR/profile-<case>.md (kernel time by class)")  # fmt: skip
    parser.add_argument("--case-timeout", type=float, default=300)
    parser.add_argument("--measure-peak", action="store_true",
                        help="measure the bf16 matmul rate first and log MFU against it (logging.peak_tflops)")  # fmt: skip
    args = parser.parse_args()
    if args.list:
        for name, c in CASES.items():
            print(f"{name:24} {c.world} GPU  {c.preset} seq {c.seq}: {c.about}\n{'':24} {' '.join(c.overrides)}")
        return
    if args.steps < 2 or args.steps % 2:
        parser.error("--steps must be even and at least 2 (the second half is the timed window)")
    peak = measured_peak_tflops() if args.measure_peak else None
    if peak is not None:
        print(f"bf16 matmul ceiling (8192^3): {peak:.0f} TFLOP/s, the MFU denominator", flush=True)
    args.peak = [f"logging.peak_tflops={peak:.1f}"] if peak is not None else []
    variants = [("", []), *(("+" + " ".join(v), v) for v in args.variant)]
    workdir = Path(tempfile.mkdtemp(prefix="train_bench_"))
    results = []
    for i in range(args.repeat):
        for name in args.cases:
            for suffix, variant in variants:
                label = name + suffix + (f"#{i + 1}" if args.repeat > 1 else "")
                results.append(run_case(label, CASES[name], [*args.extra, *variant], args, workdir))
                print(json.dumps(results[-1])[:2000], flush=True)
    add_scaling(results)
    print("| case | GPUs | tokens/s per GPU | step s | model TFLOP/s per GPU | MFU | peak GiB | vs 1 GPU |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['case']} | {r['world']} | failed | | | | | |")
            print(r["error"], file=sys.stderr)
            continue
        eff = r.get("scaling_vs_1gpu")
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "-"
        print(f"| {r['case']} | {r['world']} | {r['tokens_per_s_per_gpu']:,.0f} | {r['step_s']:.3f} | "
              f"{r['tflops_per_gpu']:.0f} | {mfu} | {r['mem_peak_gib'] or 0:.1f} | "
              f"{'-' if eff is None else f'{eff:.1%}'} |")  # fmt: skip
    if args.out:
        out = {"matmul_bf16_tflops": peak, "extra": args.extra, "variants": args.variant, "steps": args.steps,
               "cases": results}  # fmt: skip
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
