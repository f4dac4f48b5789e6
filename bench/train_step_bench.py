"""One-GPU training-step benchmark of a GPTModel preset (not a test).

Measures, in one process on one GPU: the bf16 matmul ceiling (8192^3, the MFU denominator), then for each
micro-batch size the time of a full training step (forward, backward, optimizer step) on random tokens, and reports
tokens/s, model TFLOP/s (Megatron's formula, causal attention counted half: ``mcore_models.training_flops_per_token``),
MFU and peak memory. Results go to stdout as a table and to ``--json``.

``--optimizer bf16-adamw`` (default) is plain ``torch.optim.AdamW(fused=True)`` on the bf16 parameters;
``--optimizer mixed`` is what ``mcore-train`` runs: the DDP wrapper's fp32 gradient buffer, fp32 master weights and
moments (mcore's mixed-precision optimizer, fused AdamW) and gradient clipping. ``--compile`` compiles each layer,
``--fused-ce`` turns on ``cross_entropy_fusion``, ``--recompute`` sets activation recompute. A micro-batch that runs
out of memory is reported as such and the next one is tried.

    python bench/train_step_bench.py --preset llama-1b --seq 4096 --micro-batch 2 4
    python bench/train_step_bench.py --preset llama-1b --micro-batch 1 2 4 8 --optimizer mixed --compile --fused-ce
    python bench/train_step_bench.py --smoke     # a toy model on the CPU: checks the script, measures nothing
    python bench/train_step_bench.py --reference hf --micro-batch 4 [--compile]   # the Hugging Face anchor
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import time
from typing import Any

import torch
from _timing import cuda_seconds

from mcore_models import GPTModel, preset, training_flops_per_token
from mcore_models.presets import PRESETS


def matmul_ceiling(n: int = 8192, iters: int = 20) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / cuda_seconds(lambda: a @ b, iters) / 1e12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_hf_step(args: argparse.Namespace, config: Any, micro_batch: int, device: torch.device) -> Any:
    """The anchor of the one-GPU training table: Hugging Face ``LlamaForCausalLM`` built from the same config (random
    weights, nothing downloaded), SDPA attention, pure bf16 weights and fused AdamW states; ``--compile`` compiles
    each decoder layer (regional compile)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mcore_models.hf import llama_config_to_hf

    hf_config = LlamaConfig(**llama_config_to_hf(config), attn_implementation="sdpa")
    hf_config.use_cache = False
    model = LlamaForCausalLM(hf_config).to(device=device, dtype=torch.bfloat16).train()
    if args.compile:
        for layer in model.model.layers:
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (micro_batch, args.seq), device=device, generator=gen)

    def step() -> torch.Tensor:
        for _ in range(args.accum):
            loss = model(input_ids=ids, labels=ids).loss / args.accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def build_step(args: argparse.Namespace, micro_batch: int, device: torch.device) -> tuple[Any, Any]:
    """(config, step function returning the detached loss) for one micro-batch size."""
    over: dict[str, Any] = dict(params_dtype="bfloat16", recompute=args.recompute, cross_entropy_fusion=args.fused_ce)
    if args.smoke:
        over.update(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=512)
        over.pop("num_query_groups", None)
        if args.preset.startswith("llama"):
            over["num_query_groups"] = 2
        pattern = PRESETS[args.preset].get("hybrid_pattern")
        if pattern:  # the toy keeps the pattern's first two layers
            over.update(hybrid_pattern=pattern.replace("|", "")[:2], num_query_groups=2,
                        mamba=dict(d_state=16, head_dim=16, chunk_size=16, n_groups=1))  # fmt: skip
    config = preset(args.preset, **over)
    if args.mamba:  # e.g. conv_kernel=triton
        if config.mamba is None:
            raise SystemExit(f"--mamba: preset {args.preset} has no Mamba layers")
        config = config.replace(mamba=dataclasses.replace(config.mamba, **dict(o.split("=", 1) for o in args.mamba)))
    if args.ssd_dots:
        from mcore_models.ssm import ssd_triton

        ssd_triton.LOW_PRECISION_DOTS = args.ssd_dots == "16bit"
    if args.reference == "hf":
        return config, build_hf_step(args, config, micro_batch, device)
    model = GPTModel(config, device=device).train()
    if args.compile:
        model.compile_layers()
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (micro_batch, args.seq + 1), device=device, generator=gen)
    tokens, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    if args.optimizer == "bf16-adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")

        def step() -> torch.Tensor:
            for _ in range(args.accum):
                loss = model(tokens, labels=labels).mean() / args.accum
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        return config, step

    from mcore_parallel import ParallelState
    from mcore_parallel.ddp import DDPConfig, DistributedDataParallel
    from mcore_parallel.optim import OptimizerConfig, get_optimizer

    state = ParallelState.initialize(device=device)
    ddp = DistributedDataParallel(model, state, DDPConfig(gradient_accumulation_fusion=args.wgrad_fusion))
    mp_opt = get_optimizer(OptimizerConfig(lr=1e-4, weight_decay=0.1, clip_grad=1.0), [ddp], state)

    def mixed_step() -> torch.Tensor:
        mp_opt.zero_grad()
        for _ in range(args.accum):  # gradient accumulation into the fp32 buffer, as the loop does
            loss = ddp(tokens, labels=labels).mean() / args.accum
            loss.backward()
        ddp.finish_grad_sync()
        mp_opt.step(count_zeros=False)  # as mcore-train's loop on the steps it does not log
        return loss.detach()

    return config, mixed_step


def profile_step(step: Any, path: str) -> dict[str, Any]:
    """Profile one step: device time per kernel class and the top kernels (``mcore_train.profiling``) → ``path``."""
    from torch.profiler import ProfilerActivity, profile

    from mcore_train.profiling import kernel_summary

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - start
    text, numbers = kernel_summary(prof, wall, 1)
    with open(path, "w") as f:
        f.write(text)
    print(text.split("\n\n| top")[0], flush=True)
    return numbers


def bench_one(args: argparse.Namespace, micro_batch: int, peak_tflops: float, device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    config, step = build_step(args, micro_batch, device)
    first = step().item()
    for _ in range(args.warmup - 1):
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    _sync(device)
    elapsed = (time.perf_counter() - start) / args.steps
    profiled = None
    if args.profile:
        profiled = profile_step(step, f"{args.profile}-mb{micro_batch}.md")
    tok_s = micro_batch * args.seq * args.accum / elapsed
    tflops = tok_s * training_flops_per_token(config, args.seq) / 1e12
    return {
        "preset": args.preset,
        "seq": args.seq,
        "micro_batch": micro_batch,
        "accum": args.accum,
        "optimizer": args.optimizer,
        "wgrad_fusion": args.wgrad_fusion,
        "reference": args.reference,
        "compile": args.compile,
        "mamba": args.mamba,
        "ssd_dots": args.ssd_dots,
        "fused_ce": args.fused_ce,
        "recompute": args.recompute,
        "step_ms": elapsed * 1e3,
        "tokens_per_s": tok_s,
        "model_tflops": tflops,
        "mfu": tflops / peak_tflops,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0,
        "first_loss": first * args.accum,
        "last_loss": loss.item() * args.accum,
        "profile": profiled,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    parser.add_argument("--optimizer", default="bf16-adamw", choices=["bf16-adamw", "mixed"])
    parser.add_argument("--compile", action="store_true", help="compile each transformer layer")
    parser.add_argument("--fused-ce", action="store_true", help="model.cross_entropy_fusion")
    parser.add_argument("--wgrad-fusion", action="store_true",
                        help="--optimizer mixed: weight gradients added straight into main_grad by their GEMM "
                             "(parallel.gradient_accumulation_fusion, the training loop's default on CUDA)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="toy model on the CPU (checks the script only)")
    parser.add_argument(
        "--accum",
        type=int,
        default=1,
        help="micro-batches per optimizer step (mcore-train's loop at global batch 16, mb 4: 4)",
    )
    parser.add_argument(
        "--reference",
        default=None,
        choices=["hf"],
        help="time Hugging Face LlamaForCausalLM of the same shape instead (pure bf16 AdamW; --compile: per layer)",
    )
    parser.add_argument("--mamba", nargs="+", default=[], metavar="KEY=VALUE",
                        help="MambaConfig fields of a Mamba or hybrid preset (strings), e.g. conv_kernel=triton")  # fmt: skip
    parser.add_argument("--ssd-dots", choices=["16bit", "tf32"], default=None,
                        help="the SSD scan's products: ssd_triton.LOW_PRECISION_DOTS on (16bit, the default) or off")  # fmt: skip
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--profile", default=None, help="profile one more step per row: PROFILE-mb<N>.md (kernel time by class)"
    )
    return parser


def main() -> None:
    args = _parser().parse_args()
    if args.smoke:
        device, peak = torch.device("cpu"), 1.0
        args.seq, args.steps, args.warmup = min(args.seq, 64), min(args.steps, 2), min(args.warmup, 2)
    elif not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (or --smoke)")
    else:
        device, peak = torch.device("cuda"), matmul_ceiling()
    results: list[dict[str, Any]] = []
    for mb in args.micro_batch:
        try:
            results.append(bench_one(args, mb, peak, device))
        except torch.OutOfMemoryError:
            results.append({"preset": args.preset, "seq": args.seq, "micro_batch": mb, "error": "out of memory"})
        torch._dynamo.reset()  # each row compiles from a clean cache, as a fresh training run does
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    env = {
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "matmul_bf16_tflops": peak,
        "flops_per_token": training_flops_per_token(preset(args.preset), args.seq),
        "date": time.strftime("%Y-%m-%d"),
    }
    levers = (
        ([f"reference={args.reference} (pure bf16 AdamW)"] if args.reference else [args.optimizer])
        + [f"recompute={args.recompute}", f"accum={args.accum}"]
        + ["compile"] * args.compile
        + ["fused-ce"] * args.fused_ce
        + ["wgrad-fusion"] * args.wgrad_fusion
    )
    print(f"{env['gpu']}, torch {env['torch']}, bf16 matmul ceiling {peak:.0f} TFLOP/s, "
          f"{env['flops_per_token'] / 1e9:.2f} GFLOP/token; {', '.join(levers)}")  # fmt: skip
    print("| preset | seq | micro-batch | step ms | tokens/s | model TFLOP/s | MFU | peak GiB | loss first→last |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['preset']} | {r['seq']} | {r['micro_batch']} | {r['error']} | | | | | |")
            continue
        print(f"| {r['preset']} | {r['seq']} | {r['micro_batch']} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
              f"{r['model_tflops']:.0f} | {r['mfu']:.1%} | {r['peak_gib']:.1f} | "
              f"{r['first_loss']:.3f}→{r['last_loss']:.3f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
