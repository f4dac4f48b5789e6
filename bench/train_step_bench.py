"""One-GPU training-step benchmark of a GPTModel preset (not a test).

Measures, in one process on one GPU: the bf16 matmul ceiling (8192^3, the MFU denominator), then for each
micro-batch size the time of a full training step (forward, backward, optimizer step) on random tokens, and reports
tokens/s, model TFLOP/s (Megatron's formula, causal attention counted half: ``mcore_models.training_flops_per_token``),
MFU and peak memory. Results go to stdout as a table and to ``--json``.

    python bench/train_step_bench.py --preset llama-1b --seq 4096 --micro-batch 2 4
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from typing import Any

import torch

from mcore_models import GPTModel, preset, training_flops_per_token


def matmul_ceiling(n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12


def bench_one(args: argparse.Namespace, micro_batch: int, peak_tflops: float) -> dict[str, Any]:
    config = preset(args.preset, params_dtype="bfloat16", recompute=args.recompute)
    torch.cuda.reset_peak_memory_stats()
    model = GPTModel(config, device="cuda").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (micro_batch, args.seq + 1), device="cuda", generator=gen)
    tokens, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def step() -> torch.Tensor:
        loss = model(tokens, labels=labels).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    first = step().item()
    for _ in range(args.warmup - 1):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / args.steps
    tok_s = micro_batch * args.seq / elapsed
    tflops = tok_s * training_flops_per_token(config, args.seq) / 1e12
    result = {
        "preset": args.preset,
        "seq": args.seq,
        "micro_batch": micro_batch,
        "step_ms": elapsed * 1e3,
        "tokens_per_s": tok_s,
        "model_tflops": tflops,
        "mfu": tflops / peak_tflops,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "first_loss": first,
        "last_loss": loss.item(),
        "recompute": args.recompute,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    peak = matmul_ceiling()
    results = []
    for mb in args.micro_batch:
        results.append(bench_one(args, mb, peak))
        gc.collect()
        torch.cuda.empty_cache()
    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "matmul_bf16_tflops": peak,
        "flops_per_token": training_flops_per_token(preset(args.preset), args.seq),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(f"{env['gpu']}, torch {env['torch']}, bf16 matmul ceiling {peak:.0f} TFLOP/s, "
          f"{env['flops_per_token'] / 1e9:.2f} GFLOP/token")  # fmt: skip
    print("| preset | seq | micro-batch | step ms | tokens/s | model TFLOP/s | MFU | peak GiB | loss first→last |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['preset']} | {r['seq']} | {r['micro_batch']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
              f"{r['model_tflops']:.0f} | {r['mfu']:.1%} | {r['peak_gib']:.1f} | "
              f"{r['first_loss']:.3f}→{r['last_loss']:.3f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
