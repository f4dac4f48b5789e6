"""The Mamba-2 training suite of ``bench/run.py``: the SSD scan against attention of the same width, and
``mamba2-1.3b`` and ``hybrid-1b`` through the real training loop beside ``llama-1b``, the scan at each of its chunk
lengths (``model.mamba.chunk_size``: the same function, computed in chunks of another length), in one call."""

from __future__ import annotations

import json
from typing import Any

from _harness import PY, Context, Step, Suite, table
from _train_suites import _MFU_NOTE, _TRAIN, case_row, run_cases

CHUNKS = ("256", "128")
"""The chunk lengths compared: the presets' (Hugging Face's ``Mamba2Config`` default) first, then Megatron-LM's."""
LOOP_CHUNKS = CHUNKS[:1]
"""The chunk lengths the models train at through the loop: the presets' only (128 timed slower at the scan's level on
an H100, ``bench/results/ssm/h100-scan-chunks.json``; each more length adds two training cases to the call)."""
_SCAN_COLS = [("seq", "batch x seq", ""), ("chunk", "chunk", "d"), ("scan_ms", "scan ms", ".2f"),
              ("scan_tflops", "scan TFLOP/s", ".0f"), ("attention_ms", "attention ms", ".2f"),
              ("vs_chunk", "vs the first chunk", ".2f")]  # fmt: skip
_LOOP_COLS = [*[c for c in _TRAIN if c[0] not in ("gpus", "vs_1gpu")], ("seq", "sequence", ",d"),
              ("vs_llama", "vs llama-1b, same sequence", ".2f")]  # fmt: skip
_LOOP_CASES = (
    "mamba2-1.3b/mb4",
    "hybrid-1b/4k",
    "llama-1b/best-mb4",
    "mamba2-1.3b/16k",
    "hybrid-1b/16k",
    "llama-1b/16k",
)
"""Each model at sequence 4,096 (micro-batch 4) and 16,384 (micro-batch 1), beside llama-1b at the same two."""
_QUICK_LOOP_CASES = ("hybrid-1b/16k", "llama-1b/16k")
_NORM_COLS = [("impl", "gated RMSNorm", ""), ("ms", "forward + backward ms", ".2f"), ("gb_s", "GB/s", ".0f"),
              ("vs_torch", "vs compiled PyTorch", ".2f")]  # fmt: skip
_CONV_COLS = [("impl", "causal conv + SiLU", ""), ("ms", "forward + backward ms", ".2f"), ("gb_s", "GB/s", ".0f"),
              ("vs_torch", "vs F.conv1d", ".2f")]  # fmt: skip


def _scan_rows(ctx: Context) -> list[dict[str, Any]]:
    out = ctx.path("ssd.json")
    seqs = ["4096"] if ctx.quick else ["4096", "16384"]
    step = ctx.run([PY, "bench/ssd_bench.py", "--seq", *seqs, "--chunk", *CHUNKS, "--json", out], timeout=300, out=out)
    rows, first = [], {}
    for r in (step.data or {}).get("rows", []) or [{}]:
        scan, attn = r.get("scan_16bit", {}), r.get("attention") or {}
        row = ctx.row(step, measured=bool(scan.get("ms")), seq=f"{r.get('batch')} x {r.get('seq')}",
                      chunk=r.get("chunk"), scan_ms=scan.get("ms"), scan_tflops=scan.get("tflops"),
                      attention_ms=attn.get("ms"))  # fmt: skip
        base = first.setdefault(r.get("seq"), scan.get("ms"))
        if base and scan.get("ms"):
            row["vs_chunk"] = base / scan["ms"]
        rows.append(row)
    return rows


def _impl_rows(ctx: Context, script: str, batch: str, labels: dict[str, str]) -> list[dict[str, Any]]:
    """One row per implementation of a bench script that times ``torch`` against ``triton`` (``labels``: each
    one's label), each against the ``torch`` row."""
    out = ctx.path(script.replace("_bench.py", ".json").replace("mamba_", ""))
    step = ctx.run([PY, f"bench/{script}", "--batch", batch, "--json", out], timeout=180, out=out)
    found = {r["impl"]: r for r in (step.data or {}).get("rows", [])}
    rows = []
    for impl, label in labels.items():
        r = found.get(impl, {})
        rows.append(ctx.row(step, measured=bool(r), impl=label, ms=r.get("ms"), gb_s=r.get("gb_s")))
    base = found.get("torch", {}).get("ms")
    for row in rows:
        if base and row.get("ms"):
            row["vs_torch"] = base / row["ms"]
    return rows


def _conv_rows(ctx: Context) -> list[dict[str, Any]]:
    return _impl_rows(ctx, "mamba_conv_bench.py", "2" if ctx.quick else "8",
                      {"torch": "F.conv1d + F.silu (mamba.conv_kernel=torch)",
                       "triton": "Triton kernels (mamba.conv_kernel=auto on CUDA)"})  # fmt: skip


def _norm_rows(ctx: Context) -> list[dict[str, Any]]:
    return _impl_rows(ctx, "mamba_norm_bench.py", "1" if ctx.quick else "4",
                      {"torch": "compiled PyTorch ops (mamba.norm_kernel=torch)",
                       "triton": "Triton kernels (mamba.norm_kernel=auto on CUDA)"})  # fmt: skip


def train_mamba(ctx: Context) -> list[dict[str, Any]]:
    """The scan at each chunk length; mamba2-1.3b and hybrid-1b at seq 4096 and 16k through the loop at each of
    :data:`LOOP_CHUNKS`, llama-1b at the same two beside them."""
    scan, conv, norm = _scan_rows(ctx), _conv_rows(ctx), _norm_rows(ctx)
    cases = list(_QUICK_LOOP_CASES if ctx.quick else _LOOP_CASES)
    variants = [x for c in LOOP_CHUNKS[1:] for x in ("--variant", f"model.mamba.chunk_size={c}")]
    step, results = run_cases(ctx, [c for c in cases if not c.startswith("llama")], *variants, case_timeout=240)
    anchor, more = run_cases(ctx, [c for c in cases if c.startswith("llama")], case_timeout=240)
    results.update(more)
    rows = []
    for case in cases:
        keys = (
            [case]
            if case.startswith("llama")
            else [case] + [f"{case}+model.mamba.chunk_size={c}" for c in LOOP_CHUNKS[1:]]
        )
        for key in keys:
            r = results.get(key)
            rows.append(case_row(ctx, anchor if key in more else step, key, r, seq=(r or {}).get("seq")))
    llama = {r["seq"]: r.get("tokens_s_gpu") for r in rows if r["name"].startswith("llama") and r.get("seq")}
    for r in rows:
        if llama.get(r.get("seq")) and r.get("tokens_s_gpu"):
            r["vs_llama"] = r["tokens_s_gpu"] / llama[r["seq"]]
    scan_notes = ["ssd_scan (Triton, 16-bit products) forward + backward for a d_model of 2048 (64 heads of 64, state "
                  "128, one group), 32k tokens per batch; causal cuDNN attention of the same width (32 heads of 64, "
                  "8 groups) in the same process; the scan's TFLOP/s count its products as each chunk length "
                  "performs them (the longer chunk does more)"]  # fmt: skip
    loop_notes = [_MFU_NOTE, "compiled layers, weight-gradient fusion, bf16 with fp32 master weights, mock data; "
                  "sequence 4,096: micro-batch 4, global batch 16; sequence 16,384: micro-batch 1, global batch 8; "
                  "Mamba layers' FLOPs as Megatron-LM counts them (mcore_models.flops)"]  # fmt: skip
    conv_notes = ["mamba2-1.3b's convolution (4,352 channels, kernel 4) on the in-projection's layout (a view of its "
                  "8,512-wide output, whose gradient the slice's backward fills: both rows pay it), bf16, 32k tokens "
                  "(--quick: 8k)"]  # fmt: skip
    norm_notes = ["mamba2-1.3b's gated norm (d_inner 4,096, one group) under torch.compile, forward + backward: y the "
                  "scan's [b, s, d] output transposed, z a view of the 8,512-wide in-projection output whose gradient "
                  "is assembled from dz and the rest (the PyTorch path writes dz into it, the kernel's dz is copied), "
                  "bf16, batch 4 x 4096 (--quick: 1 x 4096)"]  # fmt: skip
    return [
        table("the SSD scan by chunk length", _SCAN_COLS, scan, scan_notes),
        table("the mixer's causal convolution", _CONV_COLS, conv, conv_notes),
        table("the mixer's gated RMSNorm", _NORM_COLS, norm, norm_notes),
        table("Mamba-2 and hybrid training through the loop, one GPU", _LOOP_COLS, rows, loop_notes),
    ]


_TUNE_COLS = [("what", "kernels", ""), ("rank", "rank", "d"), ("tiles", "constants", ""), ("ms", "ms", ".3f"),
              ("vs_default", "vs the defaults", ".3f")]  # fmt: skip
_TOP = 5


def _tune_rows(ctx: Context, what: str, step: Step) -> list[dict[str, Any]]:
    """The fastest :data:`_TOP` rows of a ``--tune`` and the defaults' row (the constants its JSON names as the
    defaults; a row without one of them, which the sweep held at its default, matches), each against the defaults'."""
    defaults = (step.data or {}).get("defaults", {})
    tuned = [r for r in (step.data or {}).get("tune", []) if r.get("ms")]
    flat = [{**r, **r.get("tiles", {})} for r in tuned]
    default = next((r for r, f in zip(tuned, flat, strict=True)
                    if all(f[k] == v for k, v in defaults.items() if k in f)), None)  # fmt: skip
    picked = tuned[:_TOP] + ([default] if default is not None and default not in tuned[:_TOP] else [])
    rows = []
    for r in picked or [{}]:
        consts = r.get("tiles") or {k: v for k, v in r.items() if k.startswith("_") or k in ("dots", "chunk")}
        row = ctx.row(step, measured=bool(r), what=what, rank=tuned.index(r) + 1 if r else None,
                      tiles=json.dumps(consts, separators=(",", ":")) + (" (defaults)" if r is default else ""),
                      ms=r.get("ms"))  # fmt: skip
        if default is not None and r.get("ms"):
            row["vs_default"] = default["ms"] / r["ms"]
        rows.append(row)
    return rows


def tune_mamba(ctx: Context) -> list[dict[str, Any]]:
    """``ssd_bench.py --tune`` at chunk 256 and 128 and ``mamba_conv_bench.py --tune``: the fastest constants
    beside the defaults."""
    rows = []
    for chunk in CHUNKS:
        out = ctx.path(f"ssd-tune-{chunk}.json")
        step = ctx.run([PY, "bench/ssd_bench.py", "--seq", "4096", "--chunk", chunk, "--tune", "--json", out],
                       timeout=420, out=out)  # fmt: skip
        rows += _tune_rows(ctx, f"SSD scan, chunk {chunk}", step)
    out = ctx.path("conv-tune.json")
    step = ctx.run([PY, "bench/mamba_conv_bench.py", "--batch", "8", "--tune", "--json", out], timeout=420, out=out)
    rows += _tune_rows(ctx, "causal conv", step)
    notes = ["SSD: forward + backward at batch 8 x 4096, bf16, 16-bit products; the forward's rows and warps swept "
             "with the others at their defaults, then the forward's stages, the backward's rows and warps and its "
             "stages, each with the others at the best so far, then the state pass's block (ssd_bench.TUNE); the "
             "defaults: ssd_triton.TILES",
             "causal conv: forward + backward of mamba2-1.3b's layer at batch 8 x 4096 (at batch 2 the host's launches "
             "bound it); each kernel's (positions, channels, warps; dpre's also its position blocks per program) in "
             "turn (mamba_conv_bench.TUNE, TUNE_DPRE)"]  # fmt: skip
    return [table("Mamba-2 kernels' constants, fastest first", _TUNE_COLS, rows, notes)]


MAMBA_SUITES = [
    Suite("train-mamba", "mamba2-1.3b and hybrid-1b at seq 4096 and 16k through the loop, the SSD scan alone at "
          "chunk lengths 256 and 128, the mixer's convolution against F.conv1d and its gated norm against the compiled "
          "PyTorch ops", "llama-1b at 4096 and 16k through the loop, and causal cuDNN attention of the same width, "
          "F.conv1d, the compiled PyTorch norm, same call", 9, 1,
          train_mamba),
    Suite("tune-mamba", "the SSD scan's tiles, warps and pipeline stages at chunk 256 and 128, and the causal conv's "
          "tiles per kernel: the fastest beside the defaults", "the defaults (ssd_triton.TILES, conv_triton.TILES), "
          "same call", 5, 1, tune_mamba),
]  # fmt: skip
