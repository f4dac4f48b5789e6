"""Vision-language benchmark (not a test): LLaVA-1b-clip336 training through ``mcore-train pretrain`` and serving
TTFT with one image.

Training: synthetic image-caption shards (``--stored`` distinct 640 x 480 PNGs of textured shapes, each with a
caption of about 1,500 bytes; the run reads them for as many epochs as it needs), then one ``torchrun`` of the real
loop per ``--stages`` entry with the ``llava-1b-clip336`` recipe (CLIP ViT-L/14-336 features of layer -2, 576 image
tokens, the mlp projector, llama-1b, seq 4096, one image per sample, images decoded and resized in
``multimodal.data_workers`` DataLoader processes), byte tokens (image token 259). Reported from the run's own
``metrics.jsonl`` (the last logging window): tokens/s, model TFLOP/s with the tower's and projector's FLOPs counted
(``mcore_models.flops.llava_training_flops``), MFU against the bf16 matmul rate measured first in this process, peak
memory, and the data loader's host time per step (``data_ms_per_step``, ``data_share`` of the window).

Serving (``--serve``): the engine over a random-weight LLaVA-1b-clip336 (bf16), one request at a time with a 336 px
image and 64 text tokens (640 prompt tokens) then 32 greedy tokens: time to first token (the tower, the projector and
the prefill) against a text-only prompt of the same 640 tokens, and the per-token latency after it; median of
``--repeats``.

    python bench/vlm_bench.py --out vlm.json [--stages stage2,stage1] [--serve]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

STAGES = {
    "stage1": ("multimodal.freeze=[vision,language]", "the projector alone (LLaVA pretraining)"),
    "stage2": ("multimodal.freeze=[vision]", "projector + language model (LLaVA instruction tuning)"),
    "full": ("multimodal.freeze=[]", "everything, the tower too"),
}
WORDS = [
    "red",
    "green",
    "blue",
    "disc",
    "square",
    "cross",
    "stripes",
    "on",
    "a",
    "white",
    "black",
    "background",
    "the",
    "image",
    "shows",
]


def write_shards(prefix: Path, stored: int) -> None:
    from mcore_data._png import encode_png
    from mcore_data.multimodal import ShardWriter
    from mcore_data.multimodal_prep import synthetic_sample

    rng = np.random.default_rng(0)
    with ShardWriter(prefix, shard_size=256, overwrite=True) as w:
        for i in range(stored):
            px, caption = synthetic_sample(i, size=480, seed=1)
            px = np.concatenate([px, px[:, :160]], axis=1)  # 640 x 480
            px = np.clip(px.astype(np.int16) + rng.integers(-40, 40, px.shape), 0, 255).astype(np.uint8)
            text = caption + ". " + " ".join(rng.choice(WORDS, 260))
            w.add(encode_png(px), "png", {"caption": text})


def train_stage(name: str, prefix: Path, args: argparse.Namespace, peak: float | None, work: Path) -> dict[str, Any]:
    run_dir = work / name
    freeze, about = STAGES[name]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "-m", "mcore_train.cli", "pretrain", "--recipe", args.recipe, f"data.path={prefix}",
           "data.tokenizer=byte", "multimodal.image_token_id=259", freeze,
           f"training.micro_batch_size={args.micro_batch}", f"training.global_batch_size={args.global_batch}",
           f"training.train_iters={args.steps}", f"logging.log_interval={args.steps // 2}",
           f"multimodal.data_workers={args.workers}", "training.compile=layers",
           "parallel.gradient_accumulation_fusion=true", "logging.progress_bar=false", "training.eval_iters=0",
           "scheduler.warmup_iters=1", f"logging.dir={run_dir}",
           *([f"logging.peak_tflops={peak}"] if peak else []), *args.extra]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "4"},
                          timeout=args.timeout)  # fmt: skip
    head = {
        "stage": name,
        "about": about,
        "overrides": cmd[cmd.index("--recipe") + 2 :],
        "wall_s": time.perf_counter() - t0,
    }
    if proc.returncode != 0:
        return {**head, "error": (proc.stdout + proc.stderr)[-4000:]}
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "tokens_per_s" in r][-1]
    keys = ("tokens_per_s", "tflops_per_gpu", "mfu", "mem_peak_gib", "data_ms_per_step", "data_share", "loss")
    out = {**head, **{k: last.get(k) for k in keys}}
    out["step_s"] = last["global_batch_size"] / last["samples_per_s"]
    return out


def serve(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from mcore_infer import LLM, EngineConfig, SamplingParams
    from mcore_models.multimodal import LlavaModel, llava_preset

    torch.manual_seed(0)
    config = llava_preset(
        "llava-1b-clip336", language={"params_dtype": "bfloat16"}, vision={"params_dtype": "bfloat16"}
    )
    model = LlavaModel(config, device="cuda").eval()
    llm = LLM(model=model, config=EngineConfig(max_model_len=2048, max_num_seqs=8, memory_fraction=0.5,
                                               compile=args.compile, max_images=1))  # fmt: skip
    tid, n_img = config.image_token_id, config.image_tokens
    g = torch.Generator().manual_seed(1)
    text = torch.randint(0, 32000, (64,), generator=g).tolist()
    with_image = [*text[:8], *[tid] * n_img, *text[8:]]
    text_only = torch.randint(0, 32000, (len(with_image),), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def one(ids: list[int], images: Any) -> tuple[float, float]:
        eng = llm.engine
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rid = eng.add_request(ids, params, images=images, stream=True)
        first = done = None
        while eng.has_work():
            for o in eng.step():
                now = time.perf_counter()
                if o.request_id == rid and first is None and o.new_token_ids:
                    first = now
                if o.finished:
                    done = now
        assert first is not None and done is not None
        return (first - t0) * 1e3, (done - first) * 1e3 / (params.max_tokens - 1)

    rows = {}
    for label, ids, make in (("one image", with_image, lambda: torch.rand(1, 3, 336, 336, device="cuda")),
                             ("text only", text_only, lambda: None)):  # fmt: skip
        runs = [one(ids, make()) for _ in range(args.repeats + 2)][2:]  # two warm-ups (graphs, compilation)
        rows[label] = {"prompt_tokens": len(ids), "ttft_ms": statistics.median(r[0] for r in runs),
                       "ttft_ms_runs": [r[0] for r in runs], "tpot_ms": statistics.median(r[1] for r in runs)}  # fmt: skip
    px = torch.rand(1, 3, 336, 336, device="cuda", dtype=torch.bfloat16)
    times = []
    for _ in range(args.repeats + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.image_embeddings(px)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"rows": rows, "image_encode_ms": statistics.median(times[2:]), "image_tokens": n_img}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--recipe", default="llava-1b-clip336", help="llava-tiny: a CPU smoke run of the tool")
    p.add_argument("--stages", default="stage2", help="comma list of " + ", ".join(STAGES))
    p.add_argument("--stored", type=int, default=256, help="distinct samples in the shards")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=4, help="multimodal.data_workers")
    p.add_argument("--timeout", type=float, default=420)
    p.add_argument("--serve", action="store_true")
    p.add_argument("--compile", action="store_true", help="the engine's compiled layers (serving)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--extra", nargs="*", default=[], help="more mcore-train overrides for every stage")
    args = p.parse_args()
    result: dict[str, Any] = {"stages": []}
    stages = [s for s in args.stages.split(",") if s]
    if stages:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import torch
        from _timing import bf16_matmul_tflops

        peak = bf16_matmul_tflops() if torch.cuda.is_available() else None
        result["matmul_tflops"] = peak
        with tempfile.TemporaryDirectory() as work:
            prefix = Path(work) / "shards" / "synthetic"
            t0 = time.perf_counter()
            write_shards(prefix, args.stored)
            result["shards_s"] = time.perf_counter() - t0
            for name in stages:
                row = train_stage(name, prefix, args, peak, Path(work))
                print(json.dumps(row), flush=True)
                result["stages"].append(row)
    if args.serve:
        result["serve"] = serve(args)
        print(json.dumps(result["serve"]), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
