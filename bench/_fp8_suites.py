"""The FP8 suites of ``bench/run.py`` (``model.fp8``, ``mcore_parallel.fp8``): FP8 against bf16 through the real
training loop in the same call, on one GPU (each recipe), on two (tensor parallelism, the FP8 all-gather on and
off), and the loss curves of a 500-step run on text."""

from __future__ import annotations

from typing import Any

from _harness import PY, Context, Step, Suite, table
from _train_suites import _MFU_NOTE, _TRAIN, case_row, run_cases

BEST = [
    "model.fp8=hybrid",
    "model.fp8_recipe=delayed",
    "model.fp8_fused_swiglu=true",
    "model.fp8_first_layers_bf16=0",
    "model.fp8_last_layers_bf16=0",
    "model.fp8_modules=[qkv,proj,fc1,fc2,output]",
]
"""The fastest FP8 switches built: delayed scaling, the fused SwiGLU casts, every layer and the output layer in FP8
(the loss curves of ``train-fp8-curves`` are of this run)."""
VARIANTS = {
    "fp8 hybrid, tensorwise": ["model.fp8=hybrid"],
    "fp8 e4m3, tensorwise": ["model.fp8=e4m3"],
    "fp8 hybrid, delayed, unfused SwiGLU": [
        "model.fp8=hybrid",
        "model.fp8_recipe=delayed",
        "model.fp8_fused_swiglu=false",
    ],
    "fp8 hybrid, delayed, fused SwiGLU casts": [
        "model.fp8=hybrid",
        "model.fp8_recipe=delayed",
        "model.fp8_fused_swiglu=true",
    ],
    "fp8 hybrid, delayed, fused SwiGLU casts, every layer in FP8": [
        "model.fp8=hybrid",
        "model.fp8_recipe=delayed",
        "model.fp8_fused_swiglu=true",
        "model.fp8_first_layers_bf16=0",
        "model.fp8_last_layers_bf16=0",
    ],
    "fp8 hybrid, delayed, fused SwiGLU casts, every layer and the output layer in FP8": BEST,
    "fp8 e4m3, rowwise": ["model.fp8=e4m3", "model.fp8_recipe=rowwise"],
    "fp8 hybrid, bf16 weight gradient": ["model.fp8=hybrid", "model.fp8_wgrad=false"],
}
"""Label -> the overrides added to the bf16 case (each one run of the case)."""
ALLGATHER = {
    "fp8 hybrid, bf16 all-gather then cast": ["model.fp8=hybrid", "model.fp8_allgather=false"],
    "fp8 hybrid, cast then FP8 all-gather": ["model.fp8=hybrid", "model.fp8_allgather=true"],
}
_FLOPS_NOTE = ("model TFLOP/s counts the bf16 model's FLOPs (Megatron's formula) for every row, FP8 or not: "
               "bf16-equivalent, so the column compares like tokens/s does")  # fmt: skip
_FP8_NOTE = ("FP8 runs the attention's QKV and output projections and the MLP's two linears of layers 2..L-1 through "
             "torch._scaled_mm; the first and last layers, attention itself, norms, embedding and output layer stay "
             "bf16 unless a row says otherwise; fp32 master weights")  # fmt: skip


def _against_bf16(ctx: Context, case: str, variants: dict[str, list[str]], *extra: str) -> list[dict[str, Any]]:
    """The bf16 case and each variant of it in one ``train_scaling_bench.py`` call; rows with ``vs_bf16``."""
    flags = [a for v in variants.values() for a in ("--variant", *v)]
    step, results = run_cases(ctx, [case], *extra, *flags)
    base = results.get(case)
    rows = [case_row(ctx, step, f"{case}, bf16", base)]
    for label, overrides in variants.items():
        rows.append(case_row(ctx, step, f"{case}, {label}", results.get(f"{case}+{' '.join(overrides)}")))
    good = base is not None and "error" not in base
    for row in rows:
        if good and row.get("tokens_s_gpu"):
            row["vs_bf16"] = row["tokens_s_gpu"] / base["tokens_per_s_per_gpu"]  # type: ignore[index]
    return rows


_COLS = [c for c in _TRAIN if c[0] != "vs_1gpu"] + [("vs_bf16", "vs bf16", ".3f")]


_LINEAR_COLS = [("linear", "linear", ""), ("in", "in", "d"), ("out", "out", "d"), ("bf16_ms", "bf16 ms", ".2f"),
                ("bf16_tflops", "bf16 TFLOP/s", ".0f"), ("hybrid_ms", "hybrid ms", ".2f"),
                ("hybrid_tflops", "hybrid TFLOP/s", ".0f"), ("hybrid_vs_bf16", "hybrid vs bf16", ".2f"),
                ("hybrid-delayed_vs_bf16", "delayed vs bf16", ".2f"), ("e4m3-rowwise_vs_bf16", "rowwise vs bf16", ".2f"),
                ("casts_ms", "hybrid casts alone ms", ".2f"),
                ("casts_torch_ms", "compiled casts ms", ".2f")]  # fmt: skip


def _linear_table(ctx: Context) -> dict[str, Any]:
    out = ctx.path("fp8-linear.json")
    step = ctx.run([PY, "bench/fp8_linear_bench.py", "--iters", "2" if ctx.quick else "5", "--out", out],
                   timeout=900, out=out)  # fmt: skip
    rows = [ctx.row(step, **r) for r in (step.data or {}).get("rows", [])] or [ctx.row(step, linear="all")]
    notes = ["one micro-batch of 8 x 4096 tokens, forward + backward (6 x tokens x in x out FLOPs), the weight cast "
             "once per step of 4 micro-batches; casts: the input's E4M3 and the output gradient's E5M2 cast, each "
             "with its transpose (the part of the FP8 linear that is not a GEMM)"]  # fmt: skip
    return table("one linear of llama-1b, FP8 against bf16 (bench/fp8_linear_bench.py)", _LINEAR_COLS, rows, notes)


_MLP_COLS = [("mlp", "MLP", ""), ("ms", "ms", ".2f"), ("tflops", "TFLOP/s", ".0f"), ("vs_bf16", "vs bf16", ".2f"),
             ("fused_calls", "fused forwards", "d")]  # fmt: skip


def _mlp_table(ctx: Context) -> dict[str, Any]:
    out = ctx.path("fp8-mlp.json")
    step = ctx.run([PY, "bench/fp8_linear_bench.py", "--mlp", "--iters", "2" if ctx.quick else "5", "--out", out],
                   timeout=600, out=out)  # fmt: skip
    rows = [ctx.row(step, **r) for r in (step.data or {}).get("mlp", [])] or [ctx.row(step, mlp="all")]
    notes = ["llama-1b's MLP (fc1 2048 -> 2 x 8192, SwiGLU, fc2 8192 -> 2048), one micro-batch of 8 x 4096 tokens, "
             "forward + backward, 4 micro-batches a step; fused: model.fp8_fused_swiglu=true (the SwiGLU kernels "
             "write fc2's FP8 input and fc1's FP8 output gradient)"]  # fmt: skip
    return table("llama-1b's MLP: bf16, FP8 (delayed), FP8 with the SwiGLU casts fused (bench/fp8_linear_bench.py "
                 "--mlp)", _MLP_COLS, rows, notes)  # fmt: skip


def train_fp8(ctx: Context) -> list[dict[str, Any]]:
    variants = {k: v for k, v in VARIANTS.items() if not ctx.quick or k == "fp8 hybrid, tensorwise"}
    rows = _against_bf16(ctx, "llama-1b/best", variants, "--extra", "training.global_batch_size=64")
    notes = [_MFU_NOTE, _FLOPS_NOTE, _FP8_NOTE,
             "llama-1b/best (compiled layers, weight-gradient fusion, micro-batch 8) at global batch 64, sequence "
             "4096, mock data; target of issue 28: 1.35x bf16's tokens/s",
             "tp > 1 (the FP8 all-gather): suite train-fp8-tp2"]  # fmt: skip
    return [
        table("FP8 against bf16 on one GPU (llama-1b, seq 4096)", _COLS, rows, notes),
        _linear_table(ctx),
        _mlp_table(ctx),
    ]


def train_fp8_tp2(ctx: Context) -> list[dict[str, Any]]:
    case = "tp2-sp" if ctx.quick else "llama3-8b/tp2-sp"
    rows = _against_bf16(ctx, case, ALLGATHER)
    notes = [_MFU_NOTE, _FLOPS_NOTE, _FP8_NOTE,
             "tp2 + sequence parallelism: the column-parallel linears all-gather their input over the sequence; "
             "model.fp8_allgather=true casts it to FP8 first (half the bytes on the wire, one scalar all-reduce of "
             "its maximum) instead of gathering bf16 and casting the gathered input",
             f"{case}; llama3-8b at sequence 8192, micro-batch 1, global batch 8; target of issue 28: 14,000 tokens/s "
             "per GPU for llama3-8b"]  # fmt: skip
    return [table(f"FP8 against bf16 at tp2 + SP ({case})", _COLS, rows, notes)]


MOE_VARIANTS = {
    "fp8 hybrid, delayed, experts bf16": ["model.fp8=hybrid", "model.fp8_recipe=delayed"],
    "fp8 hybrid, delayed, experts FP8 (E4M3 rowwise grouped GEMMs)": [
        "model.fp8=hybrid",
        "model.fp8_recipe=delayed",
        "model.fp8_modules=[qkv,proj,fc1,fc2,experts]",
    ],
}


def train_fp8_moe(ctx: Context) -> list[dict[str, Any]]:
    gib = ctx.gpu_gib
    # moe-8x4k's 3.5 B parameters take 63 GB of weights, gradients and Adam state: out of memory on an 80 GB H100
    case = "moe-8x4k/mb8" if gib is None or gib >= 100 else "moe-8x4k/8-layers"
    rows = _against_bf16(ctx, case, MOE_VARIANTS)
    notes = [_MFU_NOTE, _FLOPS_NOTE, _FP8_NOTE,
             "moe-8x4k (8 experts of ffn 4096, top-2; llama-1b's active FLOPs) at sequence 4096; experts in FP8: "
             "torch._scaled_grouped_mm for the forward and input gradient (E4M3, rowwise scales), the weight "
             f"gradient a bf16 grouped GEMM; case {case} (GPUs under 100 GiB: 8 of the 16 layers)"]  # fmt: skip
    return [table("FP8 MoE against bf16 on one GPU (moe-8x4k, seq 4096)", _COLS, rows, notes)]


CURVE_EXTRA = ["model.preset=llama-1b", "data.seq_length=1024", "training.micro_batch_size=4",
               "training.global_batch_size=8", "scheduler.warmup_iters=50", "training.compile=layers",
               "parallel.gradient_accumulation_fusion=true"]  # fmt: skip


def _tail_mean(losses: list[float], n: int = 20) -> float:
    tail = losses[-n:]
    return sum(tail) / len(tail)


def _curve_rows(ctx: Context, step: Step, steps: int) -> list[dict[str, Any]]:
    d = step.data or {}
    a, b = d.get("loss_a") or [], d.get("loss_b") or []
    ok = len(a) == len(b) == steps
    end_a, end_b = (_tail_mean(a), _tail_mean(b)) if ok else (None, None)
    rel = abs(end_b - end_a) / end_a if end_a and end_b is not None else None
    summary = ctx.row(step, measured=ok, name="bf16 (A) against FP8 hybrid (B)", steps=steps,
                      end_a=end_a, end_b=end_b, rel=rel, within=None if rel is None else rel <= 0.015,
                      max_diff=d.get("max_abs_diff"), loss_a=a, loss_b=b)  # fmt: skip
    every = max(1, steps // 10)
    points = [ctx.row(step, measured=ok, name=f"step {s}", a=a[s - 1], b=b[s - 1], diff=b[s - 1] - a[s - 1])
              for s in range(every, steps + 1, every)] if ok else []  # fmt: skip
    return [summary, *points]


def train_fp8_curves(ctx: Context) -> list[dict[str, Any]]:
    demo = ctx.path("demo")
    prep = ctx.run([PY, "-m", "mcore_train.cli", "prepare-demo", "--out", demo, "--workers", "8"], timeout=900)
    steps = 60 if ctx.quick else 500
    out = ctx.path("fp8-curves.json")
    data = ["data.mock=false", f"data.path={demo}/stdlib_text", "data.tokenizer=byte"]
    step = ctx.run([PY, "bench/compare_runs.py", "--steps", str(steps), "--timeout", "1200", "--a", "--b", *BEST,
                    "--extra", *CURVE_EXTRA, *data, "--out", out],
                   timeout=2700, out=out) if prep.ok or ctx.dry_run else prep  # fmt: skip
    rows = _curve_rows(ctx, step, steps)
    cols = [("name", "runs", ""), ("steps", "steps", "d"), ("end_a", "bf16 loss, last 20 steps", ".4f"),
            ("end_b", "FP8 loss, last 20 steps", ".4f"), ("rel", "relative difference", ".2%"),
            ("within", "within 1.5%", ""), ("max_diff", "largest |A - B| at a step", ".3f")]  # fmt: skip
    point_cols = [
        ("name", "step", ""),
        ("a", "bf16 loss", ".4f"),
        ("b", "FP8 loss", ".4f"),
        ("diff", "FP8 - bf16", "+.4f"),
    ]
    notes = ["llama-1b, sequence 1024, micro-batch 4, global batch 8 (8,192 tokens a step), warm-up 50 steps then "
             "the recipe's cosine decay; the demo corpus (Python's standard library, byte tokens); same seed, data "
             "and initialisation; compiled layers and weight-gradient fusion in both",
             "B: the fastest FP8 switches (" + " ".join(BEST) + "): E4M3 forward, E5M2 gradients, delayed scaling, "
             "every layer and the output layer in FP8; target of issue 28: within 1.5% at the end",
             "both curves, every step, are in this result's JSON (loss_a, loss_b of the first row)"]  # fmt: skip
    return [
        table("500-step loss curves, FP8 against bf16, on text", cols, rows[:1], notes),
        table("the curves every 50 steps", point_cols, rows[1:]),
    ]


FP8_SUITES = [
    Suite("train-fp8", "llama-1b's fastest one-GPU case (seq 4096) in bf16 and with FP8 linears: hybrid and e4m3, "
          "tensorwise, delayed and rowwise scaling, FP8 or bf16 weight gradients, the fused SwiGLU casts; one linear and the "
          "MLP alone", "the same case in bf16, same call", 8, 1, train_fp8),
    Suite("train-fp8-tp2", "llama3-8b (seq 8192) at tp2 + SP in bf16 and FP8, the FP8 all-gather on and off "
          "(--quick: llama-1b)", "the same case in bf16, same call", 9, 2, train_fp8_tp2),
    Suite("train-fp8-moe", "moe-8x4k (seq 4096) in bf16 and with FP8 linears, its routed experts in bf16 and as FP8 "
          "grouped GEMMs", "the same case in bf16, same call", 6, 1, train_fp8_moe),
    Suite("train-fp8-curves", "500 steps of llama-1b on the demo corpus: the loss curve of the fastest FP8 switches "
          "(delayed, fused SwiGLU casts, every layer and the output layer in FP8) against bf16",
          "the bf16 run, same seed, data and initialisation, same call", 8, 1, train_fp8_curves),
]  # fmt: skip
