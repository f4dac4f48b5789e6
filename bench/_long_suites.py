"""The long-context suites of ``bench/run.py``: ``llama-1b`` at 16k-128k tokens a sequence through the real loop
against Megatron-Core at 16k and 32k, and packed documents against unpacked causal rows of the same corpus."""

from __future__ import annotations

from typing import Any

from _harness import PY, Context, Suite, table
from _train_suites import _MFU_NOTE, _TRAIN, case_row, run_cases

LONG_CASES = ["llama-1b/16k", "llama-1b/32k", "llama-1b/64k", "llama-1b/128k"]
_MEGATRON_SEQS = {16384: 8, 32768: 4}  # sequence: global batch (131,072 tokens a step, as the mcore cases)
_COLS = [("name", "system", ""), ("seq", "sequence", ",d"),
         *[c for c in _TRAIN if c[0] not in ("name", "gpus", "vs_1gpu")],
         ("vs_megatron", "vs Megatron-Core", ".2f")]  # fmt: skip


def _seq(name: str) -> int:
    size = name.split("/")[1].split("+")[0].split("-")[0]
    return {"16k": 16384, "32k": 32768, "64k": 65536, "128k": 131072, "256k": 262144}[size]


def _megatron_rows(ctx: Context) -> list[dict[str, Any]]:
    rows = []
    for seq, global_batch in _MEGATRON_SEQS.items():
        out = ctx.path(f"megatron-{seq}.json")
        s = ctx.run([PY, "bench/megatron_bench.py", "--model", "llama-1b", "--seq", str(seq), "--micro-batch", "1",
                     "--global-batch", str(global_batch), "--steps", "2" if ctx.quick else "3", "--json", out],
                    timeout=300, out=out)  # fmt: skip
        d = s.data or {}
        rows.append(ctx.row(s, name=f"Megatron-Core {d.get('megatron_core', '')}, local spec, SDPA", seq=seq,
                            micro_batch=1, global_batch=global_batch, tokens_s_gpu=d.get("tokens_per_s"),
                            step_s=d.get("step_s"), tflops=d.get("model_tflops"), mfu=d.get("mfu"),
                            peak_gib=d.get("peak_mem_gib")))  # fmt: skip
    return rows


def train_long(ctx: Context) -> list[dict[str, Any]]:
    """``llama-1b`` at 16k, 32k, 64k and 128k through the loop; Megatron-Core at 16k and 32k when it imports."""
    cases = LONG_CASES[:2] if ctx.quick else LONG_CASES
    step, results = run_cases(ctx, cases, case_timeout=240)
    rows = [case_row(ctx, step, f"mcore loop, {c}", results.get(c), seq=_seq(c)) for c in cases]
    if ctx.importable("megatron"):
        rows.extend(_megatron_rows(ctx))
    anchors = {r["seq"]: r.get("tokens_s_gpu") for r in rows if r["name"].startswith("Megatron")}
    for r in rows:
        if not r["name"].startswith("Megatron") and anchors.get(r.get("seq")) and r.get("tokens_s_gpu"):
            r["vs_megatron"] = r["tokens_s_gpu"] / anchors[r["seq"]]
    notes = [
        _MFU_NOTE + "; Megatron-Core against the rate its own process measured",
        "llama-1b, micro-batch 1, 131,072 tokens a step, bf16 with fp32 master weights and the distributed "
        "optimizer, mock data; mcore: compiled layers, weight-gradient fusion, cuDNN attention; 128k: the fused "
        "loss (model.cross_entropy_fusion) and the MLPs of the first 8 layers recomputed "
        "(model.recompute=selective, model.recompute_modules=[mlp], model.recompute_num_layers=8)",
        "Megatron-Core (bench/megatron_bench.py): no Transformer Engine, so the local spec with torch SDPA as its "
        "core attention; distributed optimizer; no recompute",
    ]
    return [table("long-context training on one GPU", _COLS, rows, notes)]


def train_packed(ctx: Context) -> list[dict[str, Any]]:
    """Rows of 32k tokens of the demo corpus's real documents, packed (attention per document) and unpacked."""
    demo = ctx.path("demo")
    prep = ctx.run([PY, "-m", "mcore_train.cli", "prepare-demo", "--out", demo, "--workers", "8"], timeout=900)
    data = ["data.mock=false", f"data.path={demo}/stdlib_text", "data.tokenizer=byte", "data.eod_mask_loss=true"]
    extra = ["--extra", *data, "--variant", "data.packing=true"]
    step, results = run_cases(ctx, ["llama-1b/32k"], *extra, case_timeout=240) if prep.ok or ctx.dry_run else (
        prep, {})  # fmt: skip
    rows = [case_row(ctx, step, label, results.get(key), seq=32768) for label, key in
            (("unpacked: causal attention over whole rows", "llama-1b/32k"),
             ("packed: causal attention within each document (data.packing=true)", "llama-1b/32k+data.packing=true"))]  # fmt: skip
    base = rows[0].get("tokens_s_gpu")
    for r in rows:
        if base and r.get("tokens_s_gpu"):
            r["vs_unpacked"] = r["tokens_s_gpu"] / base
    cols = [c for c in _COLS if c[0] != "vs_megatron"] + [("vs_unpacked", "vs unpacked", ".3f")]
    notes = [
        "llama-1b/32k (micro-batch 1, 4 rows a step, compiled layers, weight-gradient fusion) on the demo corpus: "
        "Python's standard library, one document a file, byte tokens, EOD loss masked; the same rows both ways",
        "unpacked: cuDNN causal attention across the documents of a row; packed: flex_attention with each row's "
        "document block mask, positions restarting per document; model TFLOP/s counts full causal attention "
        "in both (the packed row does less attention work for the same tokens)",
    ]
    return [table("packed sequences at 32k tokens a row", cols, rows, notes)]


CP_CASES = ["llama-1b/64k", "llama-1b/128k", "llama-1b/128k-cp2", "llama-1b/256k-cp2"]


def train_long_cp(ctx: Context) -> list[dict[str, Any]]:
    """Context parallelism on two GPUs: cp2 at 128k and 256k against one GPU at 64k and 128k."""
    cases = CP_CASES[::2] if ctx.quick else CP_CASES
    step, results = run_cases(ctx, cases, case_timeout=300)
    rows = [case_row(ctx, step, f"mcore loop, {c}", results.get(c), seq=_seq(c)) for c in cases]
    cols = [("gpus", "GPUs", "d"), *[c for c in _COLS if c[0] != "vs_megatron"], ("vs_1gpu", "vs 1 GPU", ".1%")]
    notes = [
        _MFU_NOTE,
        "vs 1 GPU: tokens/s per GPU against one GPU at the same sequence per GPU (cp2 at 131,072 against 65,536); "
        "each GPU of a cp2 run also attends to the other's half, so its attention work per token is larger",
        "ring attention (parallel.cp_comm=p2p): K/V sent to the next rank while the block in hand runs through "
        "flash attention; llama-1b, micro-batch 1, mock data, compiled layers, weight-gradient fusion",
    ]
    return [table("context parallelism on two GPUs", cols, rows, notes)]


LONG_SUITES = [
    Suite("train-long", "llama-1b at sequence 16k, 32k, 64k and 128k through the loop on one GPU",
          "Megatron-Core at 16k and 32k (when megatron-core imports) and the matmul rate, same call", 8, 1,
          train_long),
    Suite("train-long-cp", "llama-1b over context parallelism 2 at sequence 128k and 256k",
          "one GPU at the same sequence per GPU (64k, 128k) and the matmul rate, same call", 8, 2, train_long_cp),
    Suite("train-packed", "llama-1b at sequence 32k on the demo corpus's documents, packed against unpacked",
          "the unpacked causal run on the same rows, same call", 5, 1, train_packed),
]  # fmt: skip
