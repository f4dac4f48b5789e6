"""The training suites of ``bench/run.py``: the real ``mcore-train`` loop on one, two and eight GPUs against its
anchors (Hugging Face transformers, the one-GPU case, the bf16 matmul rate), what each speed switch buys, loss
curves, and resharding."""

from __future__ import annotations

from typing import Any

from _harness import PY, Context, Step, Suite, table

# the run's training steps (the last half is the timed window) and each case's time limit
_STEPS, _QUICK_STEPS = "6", "4"
_TRAIN = [("name", "case", ""), ("gpus", "GPUs", "d"), ("tokens_s_gpu", "tokens/s per GPU", ",.0f"),
          ("step_s", "step s", ".3f"), ("tflops", "model TFLOP/s per GPU", ".0f"), ("mfu", "MFU", ".1%"),
          ("peak_gib", "peak GiB", ".1f"), ("vs_1gpu", "vs 1 GPU", ".1%")]  # fmt: skip
_MFU_NOTE = ("MFU: model TFLOP/s (Megatron's formula, causal attention counted half) over the bf16 matmul rate "
             "(8192^3) measured on GPU 0 at the start of the same call")  # fmt: skip


def run_cases(ctx: Context, cases: list[str], *extra: str, case_timeout: int = 300) -> tuple[Step, dict[str, Any]]:
    """One ``train_scaling_bench.py`` call; (the step, its result by case label)."""
    out = ctx.path("cases.json")
    steps = _QUICK_STEPS if ctx.quick else _STEPS
    cmd = [PY, "bench/train_scaling_bench.py", "--measure-peak", "--steps", steps, "--case-timeout",
           str(case_timeout), "--cases", *cases, *extra, "--out", out]  # fmt: skip
    step = ctx.run(cmd, timeout=len(cases) * case_timeout * (1 + extra.count("--variant")) + 180, out=out)
    return step, {r["case"]: r for r in (step.data or {}).get("cases", [])}


def _overrides(r: dict[str, Any], key: str) -> int | None:
    values = [o.split("=", 1)[1] for o in r.get("overrides", []) if o.startswith(key + "=")]
    return int(values[-1]) if values else None


def case_row(ctx: Context, step: Step, label: str, r: dict[str, Any] | None, **more: Any) -> dict[str, Any]:
    if r is None or "error" in r:
        row = ctx.row(step, measured=False, name=label, **more)
        row["error"] = (r or {}).get("error", step.error or "did not run")[-400:]
        return row
    return ctx.row(step, name=label, gpus=r["world"], tokens_s_gpu=r["tokens_per_s_per_gpu"], step_s=r["step_s"],
                   tflops=r["tflops_per_gpu"], mfu=r.get("mfu"), peak_gib=r.get("mem_peak_gib"),
                   micro_batch=_overrides(r, "training.micro_batch_size"),
                   global_batch=_overrides(r, "training.global_batch_size"), vs_1gpu=r.get("scaling_vs_1gpu"),
                   **more)  # fmt: skip


def train_1gpu(ctx: Context) -> list[dict[str, Any]]:
    short = ["--steps", "4", "--warmup", "2"] if ctx.quick else []
    hf: dict[str, tuple[Step, dict[str, Any]]] = {}
    for label, flags in (("eager", []), ("compiled", ["--compile"])):
        out = ctx.path(f"hf-{label}.json")
        step = ctx.run([PY, "bench/train_step_bench.py", "--reference", "hf", "--micro-batch", "4", *flags, *short,
                        "--json", out], timeout=400, out=out)  # fmt: skip
        hf[label] = (step, (step.data or {"results": [{}]})["results"][0] | {"env": (step.data or {}).get("env", {})})
    cases = ["llama-1b/best", "llama-1b/best-mb4", "llama-1b/eager-mb4"]
    step, results = run_cases(ctx, cases, case_timeout=240)
    anchor = hf["compiled"][1].get("tokens_per_s")
    rows = []
    for label, (s, r) in hf.items():
        name = f"Hugging Face LlamaForCausalLM, {label} layers, pure bf16 AdamW"
        ok = "tokens_per_s" in r
        rows.append(ctx.row(s, measured=ok, name=name, micro_batch=4 if ok else None, global_batch=4 if ok else None,
                            tokens_s=r.get("tokens_per_s"), tflops=r.get("model_tflops"), mfu=r.get("mfu"),
                            peak_gib=r.get("peak_gib")))  # fmt: skip
    for c in cases:
        row = case_row(ctx, step, f"mcore loop, {c}", results.get(c))
        row["tokens_s"] = row.pop("tokens_s_gpu", None)
        rows.append(row)
    for row in rows:
        if anchor and row.get("tokens_s"):
            row["vs_anchor"] = row["tokens_s"] / anchor
    ceiling = [ctx.row(step, name="before the mcore cases (train_scaling_bench --measure-peak)",
                       tflops=(step.data or {}).get("matmul_bf16_tflops"))]  # fmt: skip
    ceiling += [ctx.row(s, name=f"in the Hugging Face {label} process", tflops=r["env"].get("matmul_bf16_tflops"))
                for label, (s, r) in hf.items()]  # fmt: skip
    cols = [("name", "system", ""), ("micro_batch", "micro-batch", "d"), ("global_batch", "global batch", "d"),
            ("tokens_s", "tokens/s", ",.0f"), ("tflops", "model TFLOP/s", ".0f"), ("mfu", "MFU", ".1%"),
            ("peak_gib", "peak GiB", ".1f"), ("vs_anchor", "vs HF compiled", ".2f")]  # fmt: skip
    notes = [_MFU_NOTE + "; the Hugging Face rows against the rate their own process measured",
             "mcore: the full loop (data loader, loss, clipping, scheduler, fp32 master weights and gradient "
             "accumulation); Hugging Face: one optimizer step per micro-batch, bf16 weights and AdamW states",
             "llama-1b, sequence 4096, mock data; tokens/s from the last logging window"]  # fmt: skip
    return [table("llama-1b on one GPU", cols, rows, notes),
            table("bf16 matmul 8192^3 (the MFU denominator)", [("name", "measured", ""), ("tflops", "TFLOP/s", ".0f")],
                  ceiling)]  # fmt: skip


def _scaling_suite(cases: list[str]) -> Any:
    def build(ctx: Context) -> list[dict[str, Any]]:
        step, results = run_cases(ctx, cases)
        rows = [case_row(ctx, step, c, results.get(c)) for c in cases]
        notes = [_MFU_NOTE, "vs 1 GPU: tokens/s per GPU against the one-GPU case of the same model in the same call",
                 "dp and tp exchange peer to peer on one host (parallel.dp_comm / tp_comm=auto); peak GiB leaves out "
                 "those symmetric buffers (dp2 gradients and parameters of llama-1b: 7.3 GB; the tp2 workspace: "
                 "256 MB)", "llama-1b at sequence 4096, llama3-8b at 8192; mock data"]  # fmt: skip
        return [table("the training loop on several GPUs", _TRAIN, rows, notes)]

    return build


SWITCHES = ["model.rope_kernel=torch", "model.swiglu_backward=torch", "parallel.gradient_accumulation_fusion=false",
            "training.compile=none", "model.cross_entropy_fusion=true", "model.attention_backend=flash"]  # fmt: skip


def train_switches(ctx: Context) -> list[dict[str, Any]]:
    variants = [a for s in SWITCHES for a in ("--variant", s)]
    step, results = run_cases(ctx, ["llama-1b/best"], "--extra", "training.global_batch_size=64", *variants)
    base = results.get("llama-1b/best")
    rows = [case_row(ctx, step, "llama-1b/best at global batch 64 (every switch on)", base)]
    if base and "error" not in base:
        rows[0]["vs_all_on"] = 1.0
    for s in SWITCHES:
        rows.append(case_row(ctx, step, f"  with {s}", results.get(f"llama-1b/best+{s}")))
        if base and "error" not in base and "tokens_s_gpu" in rows[-1]:
            rows[-1]["vs_all_on"] = rows[-1]["tokens_s_gpu"] / base["tokens_per_s"]
    cols = [c for c in _TRAIN if c[0] not in ("gpus", "vs_1gpu")] + [("vs_all_on", "vs every switch on", ".1%")]
    return [table("what each speed switch buys (one GPU, micro-batch 8, global batch 64)", cols, rows, [_MFU_NOTE])]


def train_curves(ctx: Context) -> list[dict[str, Any]]:
    out = ctx.path("curves.json")
    a = ["model.swiglu_backward=torch", "model.rope_kernel=torch"]
    b = ["training.compile=layers", "parallel.gradient_accumulation_fusion=true"]
    extra = ["model.preset=llama-1b", "data.seq_length=1024", "training.micro_batch_size=4",
             "training.global_batch_size=8", "scheduler.warmup_iters=20"]  # fmt: skip
    steps = "40" if ctx.quick else "200"
    step = ctx.run([PY, "bench/compare_runs.py", "--steps", steps, "--a", *a, "--b", *b, "--extra", *extra,
                    "--out", out], timeout=1200, out=out)  # fmt: skip
    d = step.data or {}
    rows = [ctx.row(step, name="eager PyTorch-only layers (A) against the fastest path (B)", steps=int(steps),
                    max_diff=d.get("max_abs_diff"), mean_diff_last=d.get("mean_abs_diff_last_20"),
                    final_a=d.get("final_a"), final_b=d.get("final_b"))]  # fmt: skip
    cols = [("name", "runs", ""), ("steps", "steps", "d"), ("max_diff", "largest |A - B|", ".2e"),
            ("mean_diff_last", "mean |A - B|, last 20 steps", ".1e"), ("final_a", "final loss A", ".4f"),
            ("final_b", "final loss B", ".4f")]  # fmt: skip
    notes = [
        "llama-1b, sequence 1024, micro-batch 4, global batch 8, same seed, data and initialisation",
        "A: " + " ".join(a),
        "B: " + " ".join(b),
    ]
    return [table("loss curves of the fastest path against the plain one", cols, rows, notes)]


def reshard(ctx: Context) -> list[dict[str, Any]]:
    out = ctx.path("reshard.json")
    first, second = (["parallel.tp=2", "parallel.pp=2"], ["parallel.tp=4"]) if ctx.gpus >= 8 else (
        ["parallel.pp=2"], ["parallel.tp=2"])  # fmt: skip
    second += ["parallel.sequence_parallel=true"]
    steps = "10" if ctx.quick else "30"
    step = ctx.run([PY, "bench/reshard_continue.py", "--world", str(ctx.gpus), "--first", *first, "--second", *second,
                    "--steps", steps, "--extra", "training.micro_batch_size=4", "training.global_batch_size=16",
                    "--out", out], timeout=1500, out=out)  # fmt: skip
    d = step.data or {}
    rows = [ctx.row(step, name=f"{' '.join(first)} -> {' '.join(second)}", gpus=ctx.gpus, steps=int(steps),
                    resumed_from=d.get("resumed_from_step"), max_diff=d.get("max_abs_diff"),
                    max_rel=d.get("max_rel_diff"))]  # fmt: skip
    cols = [("name", "saved at -> resumed at", ""), ("gpus", "GPUs", "d"), ("steps", "steps", "d"),
            ("resumed_from", "saved at step", "d"), ("max_diff", "largest |loss difference|", ".1e"),
            ("max_rel", "relative", ".1e")]  # fmt: skip
    notes = ["llama-1b, sequence 4096, global batch 16: the resumed run against one that never stopped"]
    return [table("save under one layout, resume under another", cols, rows, notes)]


MOE_CASES = ["moe-8x4k/mb8", "moe-32x1k/mb4"]


def train_moe(ctx: Context) -> list[dict[str, Any]]:
    """The MoE presets through the loop; Megatron-Core's local-spec MoE on the same models when it imports."""
    step, results = run_cases(ctx, MOE_CASES, case_timeout=200)
    rows = [case_row(ctx, step, f"mcore loop, {c}", results.get(c)) for c in MOE_CASES]
    if ctx.importable("megatron"):
        for model in ("moe-8x4k", "moe-32x1k"):
            out = ctx.path(f"megatron-{model}.json")
            s = ctx.run([PY, "bench/megatron_bench.py", "--model", model, "--micro-batch", "2", "--steps",
                         "3" if ctx.quick else "4", "--json", out], timeout=300, out=out)  # fmt: skip
            d = s.data or {}
            rows.append(ctx.row(s, name=f"Megatron-Core {d.get('megatron_core', '')}, {model}, local spec "
                                f"(SequentialMLP), alltoall, SDPA", gpus=1, micro_batch=d.get("micro_batch"),
                                global_batch=d.get("global_batch"), tokens_s_gpu=d.get("tokens_per_s"),
                                step_s=d.get("step_s"), tflops=d.get("model_tflops"), mfu=d.get("mfu"),
                                peak_gib=d.get("peak_mem_gib")))  # fmt: skip
    anchors = {m: r.get("tokens_s_gpu") for r in rows for m in ("moe-8x4k", "moe-32x1k")
               if r["name"].startswith("Megatron") and m in r["name"]}  # fmt: skip
    for r in rows:
        model = next((m for m in anchors if f"{m}/" in r["name"]), None)
        if model and anchors[model] and r.get("tokens_s_gpu"):
            r["vs_megatron"] = r["tokens_s_gpu"] / anchors[model]
    cols = [("name", "system", ""), ("micro_batch", "micro-batch", "d"), ("global_batch", "global batch", "d"),
            *[c for c in _TRAIN if c[0] not in ("name", "gpus", "vs_1gpu")],
            ("vs_megatron", "vs Megatron-Core", ".2f")]  # fmt: skip
    notes = [
        _MFU_NOTE + "; Megatron-Core against the rate its own process measured",
        "moe-8x4k: llama-1b's attention with 8 experts of ffn 4096, top-2 (3.5 B parameters); moe-32x1k: 32 of "
        "1024, top-8; sequence 4096, bf16 with fp32 master weights, mock data, dropless",
        "Megatron-Core (bench/megatron_bench.py): no Transformer Engine, so the local spec; its experts run "
        "as a loop (SequentialMLP); torch SDPA in place of its unfused core attention; distributed optimizer",
    ]
    return [table("MoE training on one GPU", cols, rows, notes)]


TRAIN_SUITES = [
    Suite("train-1gpu", "llama-1b through the full training loop on one GPU: the fastest configuration, the same at "
          "micro-batch 4, and the defaults",
          "Hugging Face transformers (eager and per-layer torch.compile) and the bf16 matmul rate, same call",
          5, 1, train_1gpu),
    Suite("train-2gpu", "llama-1b at dp2 and tp2 + SP against one GPU; llama3-8b at tp2 + SP and pp2; moe-8x4k at "
          "ep2 against one GPU",
          "the one-GPU case and the bf16 matmul rate, same call", 10, 2,
          _scaling_suite(["llama-1b/best-mb4", "dp2", "tp2-sp", "llama3-8b/tp2-sp", "llama3-8b/pp2", "moe-8x4k/mb4",
                          "moe-8x4k/ep2"])),
    Suite("train-8gpu", "llama-1b at dp4 and dp8 against one GPU; llama3-8b at tp2-dp4, tp4-dp2, tp2-pp2-dp2",
          "the one-GPU case and the bf16 matmul rate, same call", 10, 8,
          _scaling_suite(["llama-1b/best-mb4", "dp4", "dp8", "llama3-8b/tp2-dp4", "llama3-8b/tp4-dp2",
                          "llama3-8b/tp2-pp2-dp2"])),
    Suite("train-moe", "moe-8x4k and moe-32x1k (llama-1b's active FLOPs as 8 or 32 experts) through the loop on one "
          "GPU", "Megatron-Core's MoE on the same models (when megatron-core imports) and the matmul rate, same call",
          6, 1, train_moe),
    Suite("train-switches", "llama-1b's fastest one-GPU case with each speed switch turned back, one at a time",
          "the case with every switch on, same call", 6, 1, train_switches),
    Suite("train-curves", "200 steps of llama-1b: the fastest path's loss curve against eager PyTorch-only layers",
          "the plain path, same seed and data, same call", 7, 1, train_curves),
    Suite("reshard", "train, save at one parallel layout, resume at another (pp2 -> tp2 + SP; on 8 GPUs "
          "tp2 pp2 -> tp4 + SP), against the run that never stopped",
          "the same run without the stop, same call", 5, 2, reshard, use=lambda v: 8 if v >= 8 else 2),
]  # fmt: skip
