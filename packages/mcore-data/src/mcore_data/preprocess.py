"""Tokenizing raw text into a Megatron ``.bin``/``.idx`` pair, in parallel worker processes, order preserved.

The main process reads raw units in ~1 MB chunks and writes results; workers tokenize. JSON is parsed by the main
process while a core is free for it (fewer workers than cores) and by the workers once they take every core, so the
reader never competes with the tokenizers for a core. At most a few chunks are in flight, so memory stays bounded;
results are written in input order, so the output does not depend on the number of workers or where parsing ran.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing as mp
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from mcore_data._files import check_outputs
from mcore_data.errors import ConfigError, InputFormatError
from mcore_data.indexed import IndexedDatasetWriter, optimal_dtype
from mcore_data.inputs import Chunk, expand_inputs, iter_chunks, parse_unit
from mcore_data.tokenizer import ByteTokenizer, Tokenizer, TokenizerSpec, build_tokenizer

__all__ = ["PreprocessConfig", "PreprocessSummary", "preprocess"]

logger = logging.getLogger(__name__)


@dataclass
class PreprocessConfig:
    """What ``mcore-data preprocess`` does."""

    inputs: Sequence[str] = ()
    """JSONL / text files or directories (``.gz`` allowed)."""
    output_prefix: str = ""
    """Writes ``output_prefix.bin`` and ``output_prefix.idx``."""
    tokenizer: TokenizerSpec = field(default_factory=TokenizerSpec)
    """Which tokenizer encodes the text."""
    json_key: str = "text"
    """Key of the text in each JSONL object."""
    text_unit: str = "file"
    """For plain text files: one document per ``file`` or per ``line``."""
    workers: int = 1
    """Tokenizer worker processes (the main process reads, parses and writes)."""
    append_eod: bool = True
    """Append the tokenizer's end-of-document token to every document."""
    skip_malformed: bool = False
    """Skip and count malformed lines instead of stopping at the first one."""
    chunk_bytes: int = 1 << 20
    """Raw bytes per unit of work sent to a worker."""
    overwrite: bool = False
    """Replace existing outputs."""
    parse_in: str = "auto"
    """Where JSON/text units are parsed: ``main``, ``workers``, or ``auto`` (the workers once they take every core)."""

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ConfigError("preprocess needs at least one input (--input)")
        if not self.output_prefix:
            raise ConfigError("preprocess needs an output prefix (--output-prefix)")
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if self.parse_in not in ("auto", "main", "workers"):
            raise ConfigError(f"parse_in must be 'auto', 'main' or 'workers', not {self.parse_in!r}")

    def parse_in_workers(self) -> bool:
        if self.parse_in != "auto":
            return self.parse_in == "workers"
        return self.workers >= _usable_cores()


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass
class PreprocessSummary:
    """Counts reported at the end of a run."""

    documents: int = 0
    tokens: int = 0
    skipped: int = 0
    blank: int = 0
    input_bytes: int = 0
    seconds: float = 0.0
    files: int = 0
    dtype: str = ""


_TOKENIZER: Tokenizer | None = None
_OPTS: tuple[bool, Any, str, bool] = (True, np.uint16, "text", False)


def _init_worker(spec: TokenizerSpec, append_eod: bool, dtype: Any, json_key: str, skip: bool) -> None:
    global _TOKENIZER, _OPTS
    # one tokenizer thread per process: parallelism comes from worker processes
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _TOKENIZER = build_tokenizer(spec)
    _OPTS = (append_eod, dtype, json_key, skip)


def _parse_chunk(chunk: Chunk, json_key: str, skip: bool) -> tuple[list[str], int, int]:
    """(texts, skipped, blank) of a chunk; the first malformed unit raises unless ``skip``."""
    texts: list[str] = []
    skipped = blank = 0
    for k, raw in enumerate(chunk.units):
        try:
            text = parse_unit(chunk.kind, raw, json_key)
        except (ValueError, UnicodeDecodeError) as e:
            if not skip:
                raise InputFormatError(chunk.path, chunk.first_line + k, f"{e} (use --skip-malformed to skip)") from e
            skipped += 1
            continue
        if text is None:
            blank += 1
            continue
        texts.append(text)
    return texts, skipped, blank


def _parse_and_encode(chunk: Chunk) -> tuple[tuple[int, int, int], tuple[npt.NDArray[Any], npt.NDArray[np.int32]]]:
    """Worker side when workers parse: ((documents, skipped, blank), encoded) of a raw chunk."""
    _, _, json_key, skip = _OPTS
    texts, skipped, blank = _parse_chunk(chunk, json_key, skip)
    return (len(texts), skipped, blank), _encode(texts)


def _encode(texts: list[str]) -> tuple[npt.NDArray[Any], npt.NDArray[np.int32]]:
    """(concatenated tokens, per-document lengths) of ``texts`` with the worker's tokenizer."""
    tok = _TOKENIZER
    assert tok is not None, "worker not initialised"
    append_eod, dtype = _OPTS[:2]
    eod = tok.eod
    if isinstance(tok, ByteTokenizer):
        encoded = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter((len(b) for b in encoded), np.int32, len(encoded))
        tokens = np.frombuffer(b"".join(encoded), np.uint8).astype(dtype)
        if append_eod:
            tokens = np.insert(tokens, np.cumsum(lengths), eod)
            lengths += 1
    else:
        ids = tok.encode_batch(texts)
        lengths = np.fromiter((len(d) for d in ids), np.int32, len(ids))
        if append_eod:
            for d in ids:
                d.append(eod)
            lengths += 1
        tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype, int(lengths.sum()))
    if not append_eod and len(lengths):  # documents with no token at all are dropped
        lengths = lengths[lengths > 0]
    return tokens, lengths


def preprocess(config: PreprocessConfig, progress: Callable[[int, int], None] | None = None) -> PreprocessSummary:
    """Tokenize ``config.inputs`` into ``config.output_prefix``; ``progress(documents, bytes)`` after every chunk."""
    t0 = time.perf_counter()
    check_outputs([config.output_prefix + ".bin", config.output_prefix + ".idx"], config.overwrite)
    files = expand_inputs(config.inputs)
    tokenizer = build_tokenizer(config.tokenizer)
    dtype = optimal_dtype(tokenizer.vocab_size)
    summary = PreprocessSummary(files=len(files), dtype=str(dtype))
    chunks = iter_chunks(files, text_unit=config.text_unit, chunk_bytes=config.chunk_bytes)
    init_args = (config.tokenizer, config.append_eod, dtype, config.json_key, config.skip_malformed)
    parse_in_workers = config.parse_in_workers()
    logger.info("parsing %s (%d workers)", "in the workers" if parse_in_workers else "in the main process",
                config.workers)  # fmt: skip

    def consume(nbytes: int, head: tuple[int, int, int] | None, res: Any, writer: IndexedDatasetWriter) -> None:
        if head is None:  # parsed in the worker: the counts come back with the tokens
            head, res = res
        n_docs_in, skipped, blank = head
        tokens, lengths = res
        writer.add_documents(tokens, lengths)
        summary.documents += len(lengths)
        summary.tokens += int(tokens.size)
        summary.skipped += skipped
        summary.blank += blank + n_docs_in - len(lengths)
        summary.input_bytes += nbytes
        if progress is not None:
            progress(len(lengths), nbytes)

    # With --workers N there are N tokenizer processes plus this reader/writer, as in Megatron's preprocess_data.py.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    with (
        IndexedDatasetWriter(config.output_prefix, dtype, overwrite=config.overwrite) as writer,
        ctx.Pool(config.workers, initializer=_init_worker, initargs=init_args) as pool,
    ):
        pending: deque[tuple[int, tuple[int, int, int] | None, Any]] = deque()
        for chunk in chunks:
            if parse_in_workers:
                pending.append((chunk.nbytes, None, pool.apply_async(_parse_and_encode, (chunk,))))
            else:
                texts, skipped, blank = _parse_chunk(chunk, config.json_key, config.skip_malformed)
                pending.append((chunk.nbytes, (len(texts), skipped, blank), pool.apply_async(_encode, (texts,))))
            if len(pending) >= 2 * config.workers + 2:
                n, h, r = pending.popleft()
                consume(n, h, r.get(), writer)
        while pending:
            n, h, r = pending.popleft()
            consume(n, h, r.get(), writer)
    summary.seconds = time.perf_counter() - t0
    logger.info(
        "preprocessed %d documents, %d tokens, %d skipped in %.1fs",
        summary.documents,
        summary.tokens,
        summary.skipped,
        summary.seconds,
    )
    return summary
