"""The ``mcore-data`` command: preprocess, train-tokenizer, build-index, inspect, merge, demo-corpus, multimodal.

Only this module configures logging handlers and writes to stdout. Heavy imports happen inside each subcommand so
that start-up stays fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from mcore_data._megatron_args import (
    MEGATRON_TOKENIZERS,
    add_megatron_args,
    megatron_mode,
    megatron_outputs,
    resolve_tokenizer,
)

__all__ = ["main"]

logger = logging.getLogger("mcore_data.cli")


def _out(line: str = "") -> None:
    sys.stdout.write(line + "\n")


def _add_tokenizer_args(p: argparse.ArgumentParser, required: bool = True, megatron: bool = False) -> None:
    kinds = ["byte", "sentencepiece", "hf"] + (["gpt2-bpe", *MEGATRON_TOKENIZERS] if megatron else [])
    p.add_argument("--tokenizer-type", choices=kinds, default="byte" if required else None, metavar="TYPE",
                   help=f"one of: {', '.join(kinds)}")  # fmt: skip
    p.add_argument("--tokenizer-model", help="SentencePiece .model or HF tokenizer.json (or its directory)")
    p.add_argument("--eod-token", help="HF only: the end-of-document token (default: first known one)")


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--split", default="969,30,1", help="train,valid,test document weights")
    p.add_argument("--ordering", choices=["fast", "megatron"], default="fast",
                   help="sample order: fast (default) or megatron (Megatron-LM's exact samples, to continue its runs)")  # fmt: skip
    p.add_argument("--cache-dir", help="index cache directory (default <data dir>/cache/GPTDataset_indices)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mcore-data", description="Megatron-compatible data preparation.")
    ap.add_argument("--log-level", default="INFO")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("preprocess", help="tokenize JSONL / text into prefix.bin + prefix.idx")
    p.add_argument("--input", nargs="+", required=True, help="files or directories (.jsonl, .txt, .gz)")
    p.add_argument("--output-prefix", required=True)
    _add_tokenizer_args(p, megatron=True)
    p.add_argument("--json-key", default="text")
    p.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (NLTK punkt or a regex)")
    p.add_argument("--text-unit", choices=["file", "line"], default="file", help="plain text: document per ...")
    p.add_argument("--workers", type=int, default=1, help="tokenizer worker processes")
    p.add_argument("--main-process", choices=["auto", "reader", "tokenizer"], default="auto",
                   help="role of the main process: reader (reads and parses; a core of its own) or tokenizer (also "
                   "tokenizes, with workers-1 pool processes); auto: tokenizer once workers >= cores")  # fmt: skip
    p.add_argument("--no-append-eod", action="store_true", help="do not append the EOD token to documents")
    p.add_argument("--skip-malformed", action="store_true",
                   help="skip malformed lines (the first 10 are logged with file:line, then a total) instead of stopping")  # fmt: skip
    p.add_argument("--allow-empty", action="store_true", help="write an empty dataset when the inputs hold no document")
    p.add_argument("--keep-blank-documents", action="store_true",
                   help="keep empty or whitespace-only documents (default: count them as blank and skip them)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    add_megatron_args(p)

    p = sub.add_parser("train-tokenizer", help="train a SentencePiece or HF BPE tokenizer on a corpus")
    p.add_argument("--input", nargs="+", required=True)
    p.add_argument("--type", choices=["sentencepiece-bpe", "sentencepiece-unigram", "hf-bpe"], default="hf-bpe")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--output", required=True, help="model prefix (SentencePiece) or tokenizer.json path (HF)")
    p.add_argument("--json-key", default="text")
    p.add_argument("--max-docs", type=int)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress (default: a bar on a terminal, else log lines with the rate and an ETA)")  # fmt: skip

    p = sub.add_parser("build-index", help="build and cache GPTDataset indices ahead of training")
    p.add_argument("--data-prefix", nargs="+", required=True, help="prefix, or 'weight prefix weight prefix ...'")
    _add_dataset_args(p)
    p.add_argument("--train-samples", type=int)
    p.add_argument("--valid-samples", type=int)
    p.add_argument("--test-samples", type=int)

    p = sub.add_parser("inspect", help="statistics of a dataset; decode a document, sequence or sample")
    p.add_argument("prefix")
    _add_tokenizer_args(p, required=False)
    p.add_argument("--document", type=int)
    p.add_argument("--sequence", type=int)
    p.add_argument("--sample", type=int, help="sample i of the GPTDataset split (see --seq-length ...)")
    p.add_argument("--split-name", choices=["train", "valid", "test"], default="train")
    _add_dataset_args(p)
    p.add_argument("--validate", action="store_true", help="re-run the structural checks (they also run at open)")
    p.add_argument("--multimodal", action="store_true",
                   help="the index ends with one mode byte per sequence (a Megatron multimodal index)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="statistics as JSON")

    p = sub.add_parser("merge", help="concatenate several datasets into one")
    p.add_argument("--input", nargs="+", required=True, help="input prefixes")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--overwrite", action="store_true")

    p = sub.add_parser("multimodal", help="images + JSONL captions/conversations (or synthetic ones) into tar shards")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help="a JSONL file of {image|images, caption|conversations} records, or a directory of "
                     "them")  # fmt: skip
    src.add_argument("--synthetic", type=int, metavar="N", help="N synthetic pattern images with their captions")
    p.add_argument("--output", required=True, help="prefix: writes PREFIX-000000.tar, ... and PREFIX.json")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per shard (default 1000)")
    p.add_argument("--image-size", type=int, default=32, help="--synthetic: image side in pixels")
    p.add_argument("--seed", type=int, default=0, help="--synthetic: seed of the patterns")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true")

    p = sub.add_parser("demo-corpus", help="export the Python standard library's sources as a JSONL corpus")
    p.add_argument("--out", required=True)
    p.add_argument("--max-files", type=int)
    p.add_argument("--min-mb", type=float, default=0.0, help="repeat the corpus up to this size")
    p.add_argument("--overwrite", action="store_true")
    return ap


def _tokenizer_spec(args: argparse.Namespace) -> Any:
    from mcore_data.tokenizer import TokenizerSpec

    return TokenizerSpec(args.tokenizer_type, args.tokenizer_model, args.eod_token)


def _cmd_preprocess(args: argparse.Namespace) -> int:
    from mcore_data.preprocess import PreprocessConfig
    from mcore_data.tokenizer import TokenizerSpec

    kind, model, merges = resolve_tokenizer(args)
    spec = TokenizerSpec(kind, model, args.eod_token, merges)
    append_eod = bool(args.append_eod) if megatron_mode(args) else not args.no_append_eod
    for key, prefix in megatron_outputs(args):
        cfg = PreprocessConfig(
            inputs=args.input,
            output_prefix=prefix,
            tokenizer=spec,
            json_key=key,
            text_unit=args.text_unit,
            workers=args.workers,
            append_eod=append_eod,
            skip_malformed=args.skip_malformed,
            overwrite=args.overwrite,
            main_process=args.main_process,
            allow_empty=args.allow_empty,
            keep_blank=args.keep_blank_documents,
            megatron_documents=megatron_mode(args),
            split_sentences=args.split_sentences,
            keep_newlines=bool(args.keep_newlines),
            lang=args.lang or "english",
        )
        _preprocess_one(args, cfg)
    return 0


def _preprocess_one(args: argparse.Namespace, cfg: Any) -> None:
    import os

    from mcore_data.inputs import expand_inputs
    from mcore_data.preprocess import preprocess

    bar: Any = None
    if not args.no_progress:
        from tqdm import tqdm

        tqdm.monitor_interval = 0
        total = sum(os.path.getsize(f) for f in expand_inputs(args.input))
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="preprocess", file=sys.stderr)
    t0 = time.perf_counter()
    state = {"docs": 0}

    def progress(docs: int, nbytes: int) -> None:
        state["docs"] += docs
        if bar is not None:
            bar.update(nbytes)
            bar.set_postfix_str(f"{state['docs'] / max(time.perf_counter() - t0, 1e-9):,.0f} docs/s", refresh=False)

    try:
        s = preprocess(cfg, progress)
    finally:
        if bar is not None:
            bar.close()
    mb = s.input_bytes / 1e6
    _out(
        f"documents {s.documents:,}  tokens {s.tokens:,}  skipped (malformed) {s.skipped:,}  blank {s.blank:,}  "
        f"files {s.files}  dtype {s.dtype}" + (f"  sequences {s.sentences:,}" if s.sentences != s.documents else "")
    )
    _out(
        f"{mb:,.1f} MB in {s.seconds:.2f}s: {mb / max(s.seconds, 1e-9):.2f} MB/s, "
        f"{s.documents / max(s.seconds, 1e-9):,.0f} docs/s, {s.tokens / max(s.seconds, 1e-9):,.0f} tokens/s"
    )
    _out(f"wrote {cfg.output_prefix}.bin and {cfg.output_prefix}.idx")


def _cmd_train_tokenizer(args: argparse.Namespace) -> int:
    from mcore_data.tokenizer_training import train_hf_bpe, train_sentencepiece

    if args.type == "hf-bpe":
        path = train_hf_bpe(
            args.input,
            args.output,
            args.vocab_size,
            json_key=args.json_key,
            max_docs=args.max_docs,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    else:
        path = train_sentencepiece(
            args.input,
            args.output,
            args.vocab_size,
            args.type.split("-", 1)[1],
            json_key=args.json_key,
            max_docs=args.max_docs,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    _out(f"wrote {path}")
    return 0


def _dataset_config(args: argparse.Namespace) -> Any:
    from mcore_data.gpt_dataset import GPTDatasetConfig

    return GPTDatasetConfig(
        sequence_length=args.seq_length,
        random_seed=args.seed,
        ordering=args.ordering,
        split=args.split,
        cache_dir=args.cache_dir,
    )


def _cmd_build_index(args: argparse.Namespace) -> int:
    from mcore_data.builder import SPLITS, build_gpt_datasets, parse_blend

    t0 = time.perf_counter()
    datasets = build_gpt_datasets(
        _dataset_config(args),
        [args.train_samples, args.valid_samples, args.test_samples],
        parse_blend(args.data_prefix),
    )
    for name, ds in zip(SPLITS, datasets):
        _out(f"{name}: " + ("empty" if ds is None else f"{len(ds):,} samples"))
    _out(f"indices ready in {time.perf_counter() - t0:.2f}s")
    return 0


def _decode(args: argparse.Namespace, ids: Any) -> str:
    if not args.tokenizer_type:
        return " ".join(str(int(i)) for i in ids)
    from mcore_data.tokenizer import build_tokenizer

    return build_tokenizer(_tokenizer_spec(args)).decode(ids)


def _cmd_inspect(args: argparse.Namespace) -> int:
    import numpy as np

    from mcore_data.indexed import IndexedDataset

    ds = IndexedDataset(args.prefix, multimodal=args.multimodal)
    if args.validate:
        ds.validate()
    if args.document is not None:
        _out(_decode(args, ds.document(args.document)))
        return 0
    if args.sequence is not None:
        _out(_decode(args, ds[args.sequence]))
        return 0
    if args.sample is not None:
        from mcore_data._indices import split_ranges
        from mcore_data.builder import SPLITS
        from mcore_data.gpt_dataset import GPTDataset

        rng = split_ranges(args.split, ds.num_documents)[SPLITS.index(args.split_name)]
        if rng is None:
            raise SystemExit(f"split {args.split_name} is empty for --split {args.split}")
        gpt = GPTDataset(ds, _dataset_config(args), split=args.split_name, document_range=rng)
        _out(_decode(args, gpt[args.sample]))
        return 0
    lengths = ds.sequence_lengths
    doc_tokens = np.diff(np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))[ds.document_indices])
    stats = {
        "prefix": ds.path_prefix,
        "dtype": str(ds.dtype),
        "sequences": len(ds),
        "documents": ds.num_documents,
        "tokens": ds.num_tokens,
        "document_tokens_min": int(doc_tokens.min()) if len(doc_tokens) else 0,
        "document_tokens_mean": float(doc_tokens.mean()) if len(doc_tokens) else 0.0,
        "document_tokens_max": int(doc_tokens.max()) if len(doc_tokens) else 0,
        "multimodal": ds.sequence_modes is not None,
    }
    if args.json:
        _out(json.dumps(stats, indent=2))
    else:
        for k, v in stats.items():
            _out(
                f"{k:22s} {v:,.1f}"
                if isinstance(v, float)
                else f"{k:22s} {v:,}"
                if isinstance(v, int) and not isinstance(v, bool)
                else f"{k:22s} {v}"
            )
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    from mcore_data.indexed import merge_datasets

    ds = merge_datasets(args.input, args.output_prefix, overwrite=args.overwrite)
    _out(
        f"merged {len(args.input)} datasets into {ds.path_prefix}: {ds.num_documents:,} documents, {ds.num_tokens:,} tokens"
    )
    return 0


def _cmd_demo_corpus(args: argparse.Namespace) -> int:
    from mcore_data.demo_corpus import write_demo_corpus

    docs, nbytes = write_demo_corpus(
        args.out, max_files=args.max_files, min_bytes=int(args.min_mb * 1e6), overwrite=args.overwrite
    )
    _out(f"wrote {args.out}: {docs:,} documents, {nbytes / 1e6:.1f} MB")
    return 0


def _cmd_multimodal(args: argparse.Namespace) -> int:
    from mcore_data.multimodal_prep import preprocess_multimodal, write_synthetic

    if args.synthetic is not None:
        s = write_synthetic(args.output, args.synthetic, size=args.image_size, seed=args.seed,
                            shard_size=args.shard_size, overwrite=args.overwrite, progress=not args.no_progress)  # fmt: skip
    else:
        s = preprocess_multimodal(args.input, args.output, shard_size=args.shard_size, overwrite=args.overwrite,
                                  progress=not args.no_progress)  # fmt: skip
    _out(f"samples {s.samples:,}  shards {s.shards}  image bytes {s.image_bytes:,}")
    _out(f"wrote {args.output}-000000.tar ... and {s.manifest}")
    return 0


_COMMANDS = {
    "preprocess": _cmd_preprocess,
    "train-tokenizer": _cmd_train_tokenizer,
    "build-index": _cmd_build_index,
    "inspect": _cmd_inspect,
    "merge": _cmd_merge,
    "demo-corpus": _cmd_demo_corpus,
    "multimodal": _cmd_multimodal,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from mcore_data.errors import MCoreDataError

    try:
        return _COMMANDS[args.command](args)
    except (MCoreDataError, FileNotFoundError) as e:
        sys.stderr.write(f"mcore-data: error: {e}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
