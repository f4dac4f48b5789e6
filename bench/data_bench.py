"""mcore-data benchmarks (not a test): preprocess throughput, index build time/memory, cache reload, read latency.

    python bench/data_bench.py --workdir /tmp/mcore-data-bench [--skip-100m] [--out results.json]

Preprocess runs the real ``mcore-data`` console script in a subprocess on a JSONL of ``--corpus-mb`` (default ~60 MB)
built from the demo corpus (standard library sources), for the byte, SentencePiece-BPE (vocab 8000) and HF byte-level BPE (vocab 8000)
tokenizers, at 1 and 2 workers; raw single-thread encode speed is measured in-process on the same texts (for HF the
faster of an ``encode`` loop and ``encode_batch_fast``). Index
builds run in a fresh subprocess each (peak RSS from ``getrusage``) on synthetic ``.idx`` files (mean 500 tokens per
document, sparse ``.bin``), seq length 4096, one epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
EXE = Path(sys.executable).parent / "mcore-data"


def cli(*args: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([str(EXE), "--log-level", "WARNING", *args], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def load_texts(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def raw_encode_mb_s(kind: str, model: str, texts: list[str], nbytes: int) -> float:
    from mcore_data.tokenizer import build_tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = build_tokenizer(kind, model or None)
    if kind == "byte":
        enc = lambda t: t.encode("utf-8")  # noqa: E731
    elif kind == "sentencepiece":
        sp = tok._sp  # type: ignore[attr-defined]
        enc = sp.encode
    else:
        hf = tok._tok  # type: ignore[attr-defined]
        enc = lambda t: hf.encode(t, add_special_tokens=False).ids  # noqa: E731
    t0 = time.perf_counter()
    for t in texts:
        enc(t)
    loop = nbytes / 1e6 / (time.perf_counter() - t0)
    if kind != "hf" or not hasattr(tok._tok, "encode_batch_fast"):  # type: ignore[attr-defined]
        return loop
    # HF's fastest single-thread API (no offsets), in ~1 MB batches: the baseline preprocess must match
    fast = tok._tok.encode_batch_fast  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    for i in range(0, len(texts), 50):
        [e.ids for e in fast(texts[i : i + 50], add_special_tokens=False)]
    return max(loop, nbytes / 1e6 / (time.perf_counter() - t0))


def train_tokenizers(work: Path, corpus: Path) -> dict[str, str]:
    """The tokenizer model of each kind (trained on ``corpus`` once, reused from ``work`` later): the byte tokenizer
    (no model), SentencePiece-BPE and HF byte-level BPE at vocab 8000."""
    models = {"byte": ""}
    sp = work / "sp8000"
    if not Path(str(sp) + ".model").exists():
        cli(
            "train-tokenizer",
            "--input",
            str(corpus),
            "--type",
            "sentencepiece-bpe",
            "--vocab-size",
            "8000",
            "--output",
            str(sp),
            "--max-docs",
            "3000",
        )
    models["sentencepiece"] = str(sp) + ".model"
    hf = work / "hf8000" / "tokenizer.json"
    if not hf.exists():
        cli(
            "train-tokenizer",
            "--input",
            str(corpus),
            "--type",
            "hf-bpe",
            "--vocab-size",
            "8000",
            "--output",
            str(hf),
            "--max-docs",
            "3000",
        )
    models["hf"] = str(hf)
    return models


def preprocess_s(source: Path, prefix: Path, tok_args: list[str], *options: str) -> float:
    """Wall seconds of one ``mcore-data preprocess`` run of ``source`` into ``prefix`` (``options`` after the
    tokenizer's)."""
    return cli(
        "preprocess",
        "--input",
        str(source),
        "--output-prefix",
        str(prefix),
        *tok_args,
        *options,
        "--no-progress",
        "--overwrite",
    )


def bench_preprocess(work: Path, corpus_mb: int, repeats: int) -> list[dict[str, object]]:
    from mcore_data import IndexedDataset

    corpus = work / f"demo{corpus_mb}.jsonl"
    if not corpus.exists():
        cli("demo-corpus", "--out", str(corpus), "--min-mb", str(corpus_mb))
    nbytes = corpus.stat().st_size
    tiny = work / "tiny.jsonl"
    tiny.write_text('{"text": "hello"}\n')
    models = train_tokenizers(work, corpus)
    texts = load_texts(corpus)
    rows = []
    for kind, model in models.items():
        # best of `repeats` for the raw encode and for every preprocess run alike: a shared 2-core machine varies by
        # 5-7% from run to run
        raw = max(raw_encode_mb_s(kind, model, texts, nbytes) for _ in range(repeats))
        tok_args = ["--tokenizer-type", kind] + (["--tokenizer-model", model] if model else [])
        startup = min(preprocess_s(tiny, work / "tiny", tok_args) for _ in range(3))  # a one-line input
        for workers in (1, 2):
            out = work / f"pp-{kind}-{workers}"
            wall = min(preprocess_s(corpus, out, tok_args, "--workers", str(workers)) for _ in range(repeats))
            tokens = IndexedDataset(out).num_tokens
            after = nbytes / 1e6 / max(wall - startup, 1e-9)
            rows.append(
                {
                    "tokenizer": kind,
                    "workers": workers,
                    "mb": nbytes / 1e6,
                    "wall_s": wall,
                    "startup_s": startup,
                    "mb_s": nbytes / 1e6 / wall,
                    "tokens_s": tokens / wall,
                    "mb_s_after_startup": after,
                    "per_worker_vs_raw": after / workers / raw,
                    "raw_mb_s": raw,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


BUILD = r"""
import json, sys, time
import numpy as np
from mcore_data import GPTDataset, GPTDatasetConfig, IndexedDataset
prefix, cache, ordering = sys.argv[1], sys.argv[2], sys.argv[3]
ds = IndexedDataset(prefix)
def hwm():  # this process's own peak RSS (ru_maxrss would include the parent's peak from before exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
base = hwm()
t0 = time.perf_counter()
g = GPTDataset(ds, GPTDatasetConfig(sequence_length=4096, random_seed=1234, ordering=ordering, cache_dir=cache))
dt = time.perf_counter() - t0
peak = hwm()
rng = np.random.default_rng(0)
idx = rng.integers(0, len(g), 2000)
t1 = time.perf_counter()
for i in idx:
    g[int(i)]
lat = (time.perf_counter() - t1) / len(idx)
print(json.dumps({"seconds": dt, "peak_rss_mb": peak, "rss_before_mb": base, "samples": len(g), "read_us": lat * 1e6}))
"""


def make_synthetic(work: Path, n: int) -> Path:
    from mcore_data.indexed import write_index

    prefix = work / f"synthetic-{n}"
    if not Path(str(prefix) + ".idx").exists():
        lengths = np.random.default_rng(0).integers(1, 1000, n, dtype=np.int32)  # mean 500
        write_index(prefix, np.uint16, lengths)
        with open(str(prefix) + ".bin", "wb") as f:  # sparse: the right size, no data blocks
            f.truncate(int(lengths.sum(dtype=np.int64)) * 2)
        del lengths
    return prefix


def bench_index(work: Path, sizes: list[int]) -> list[dict[str, object]]:
    rows = []
    for n in sizes:
        prefix = make_synthetic(work, n)
        for ordering in ("fast", "megatron"):
            cache = work / f"cache-{n}-{ordering}"
            shutil.rmtree(cache, ignore_errors=True)
            cmd = [sys.executable, "-c", BUILD, str(prefix), str(cache), ordering]

            def run(cmd: list[str] = cmd) -> dict[str, float]:
                return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)

            build = run()
            reload = min((run() for _ in range(3)), key=lambda r: r["seconds"])
            rows.append(
                {
                    "documents": n,
                    "ordering": ordering,
                    "build_s": build["seconds"],
                    "peak_rss_mb": build["peak_rss_mb"],
                    "rss_before_mb": build["rss_before_mb"],
                    "samples": build["samples"],
                    "reload_s": reload["seconds"],
                    "read_us": reload["read_us"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(cache, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default="/tmp/mcore-data-bench")
    ap.add_argument("--skip-100m", action="store_true")
    ap.add_argument("--skip-preprocess", action="store_true")
    ap.add_argument("--corpus-mb", type=int, default=60, help="size of the demo corpus that preprocess reads")
    ap.add_argument("--repeats", type=int, default=3, help="best of this many runs per preprocess measurement")
    ap.add_argument("--out", help="write the JSON results here")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
    }
    if not args.skip_preprocess:
        result["preprocess"] = bench_preprocess(work, args.corpus_mb, args.repeats)
    result["index"] = bench_index(work, [10_000_000] + ([] if args.skip_100m else [100_000_000]))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
