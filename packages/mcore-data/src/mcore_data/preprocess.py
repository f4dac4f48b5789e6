"""Tokenizing raw text into a Megatron ``.bin``/``.idx`` pair, in parallel worker processes, order preserved.

The main process reads raw units in ~1 MB chunks and writes results; ``workers`` processes tokenize. The main
process plays one of two roles:

- ``reader`` (fewer workers than cores): it also parses JSON, and ``workers`` pool processes tokenize, as in
  Megatron's ``preprocess_data.py``; the main process has a core of its own.
- ``tokenizer`` (as many workers as cores, or more): ``workers - 1`` pool processes parse and tokenize, and the main
  process tokenizes a chunk itself whenever the pool already has enough queued work, so no core is shared between a
  busy tokenizer and a mostly idle reader.

At most a few chunks are in flight, so memory stays bounded; results are written in input order, so the output does
not depend on the number of workers or on the role of the main process.
"""

from __future__ import annotations

import contextlib
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

from mcore_data._files import check_outputs, usable_cores
from mcore_data.errors import ConfigError, EmptyInputError, InputFormatError
from mcore_data.indexed import IndexedDatasetWriter, optimal_dtype
from mcore_data.inputs import Chunk, expand_inputs, iter_chunks, parse_unit
from mcore_data.sentences import sentence_splitter
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
    main_process: str = "auto"
    """Role of the main process: ``reader``, ``tokenizer``, or ``auto`` (``tokenizer`` once workers >= cores)."""
    allow_empty: bool = False
    """Write an empty dataset when the inputs hold no document (otherwise that is an :class:`EmptyInputError`)."""
    keep_blank: bool = False
    """Keep documents that are empty or only whitespace (by default they are counted as blank and skipped)."""
    megatron_documents: bool = False
    """Megatron-LM's rules for each document (``tools/preprocess_data.py``): blank texts kept and tokenized as they
    are, empty sentences dropped, EOD appended only to a non-empty last sentence, and a document left with no tokens
    written as a document of no sequences (never skipped), so the files match Megatron's byte for byte."""
    split_sentences: bool = False
    """Split each text into sentences, one sequence each (see :mod:`mcore_data.sentences`)."""
    keep_newlines: bool = False
    """With ``split_sentences``: keep the whitespace between sentences (with the sentence before)."""
    lang: str = "english"
    """With ``split_sentences`` and NLTK installed: the punkt language."""

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ConfigError("preprocess needs at least one input (--input)")
        if not self.output_prefix:
            raise ConfigError("preprocess needs an output prefix (--output-prefix)")
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if self.main_process not in ("auto", "reader", "tokenizer"):
            raise ConfigError(f"main_process must be 'auto', 'reader' or 'tokenizer', not {self.main_process!r}")

    def main_tokenizes(self) -> bool:
        if self.main_process != "auto":
            return self.main_process == "tokenizer"
        return self.workers >= usable_cores()


@dataclass
class PreprocessSummary:
    """Counts reported at the end of a run."""

    documents: int = 0
    tokens: int = 0
    sentences: int = 0
    """Sequences written (equal to ``documents`` unless documents are sentences)."""
    skipped: int = 0
    skipped_examples: list[str] = field(default_factory=list)
    """``file:line: problem`` of the first malformed lines skipped (at most 10)."""
    blank: int = 0
    input_bytes: int = 0
    seconds: float = 0.0
    files: int = 0
    dtype: str = ""


_Encoded = tuple[npt.NDArray[Any], npt.NDArray[np.int32], npt.NDArray[np.int32] | None]
"""(concatenated tokens, sequence lengths, sequences per document or None when every document is one sequence)."""
_Doc = str | list[str]
"""A document: its text, or its ready-made sentences (one sequence each)."""


@dataclass(frozen=True)
class _Options:
    """What worker processes need besides the tokenizer (picklable)."""

    append_eod: bool = True
    dtype: Any = np.uint16
    json_key: str = "text"
    skip: bool = False
    keep_blank: bool = False
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"
    megatron_documents: bool = False


_TOKENIZER: Tokenizer | None = None
_OPTS = _Options()
_MAX_EXAMPLES = 10  # malformed lines logged with file:line


def _init_worker(spec: TokenizerSpec, opts: _Options) -> None:
    global _TOKENIZER, _OPTS
    # one tokenizer thread per process: parallelism comes from worker processes
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _TOKENIZER = build_tokenizer(spec)
    _OPTS = opts


_Counts = tuple[int, int, int, list[str]]
"""(documents, skipped, blank, first skipped lines as ``file:line: problem``) of a chunk."""


def _parse_chunk(chunk: Chunk, opts: _Options) -> tuple[list[_Doc], _Counts]:
    """(documents, counts) of a chunk; the first malformed unit raises unless ``opts.skip``."""
    docs: list[_Doc] = []
    skipped = blank = 0
    examples: list[str] = []
    split = sentence_splitter(opts.lang, opts.keep_newlines) if opts.split_sentences else None
    for k, raw in enumerate(chunk.units):
        try:
            text = parse_unit(chunk.kind, raw, opts.json_key, opts.keep_blank)
        except (ValueError, UnicodeDecodeError) as e:
            if not opts.skip:
                raise InputFormatError(chunk.path, chunk.first_line + k, f"{e} (use --skip-malformed to skip)") from e
            skipped += 1
            if len(examples) < _MAX_EXAMPLES:
                examples.append(f"{chunk.path}:{chunk.first_line + k}: {e}")
            continue
        if text is None:
            blank += 1
            continue
        docs.append(split(text) if split is not None and isinstance(text, str) else text)
    return docs, (len(docs), skipped, blank, examples)


def _parse_and_encode(chunk: Chunk) -> tuple[_Counts, _Encoded]:
    """Worker side when workers parse: (counts, encoded) of a raw chunk."""
    docs, counts = _parse_chunk(chunk, _OPTS)
    return counts, _encode(docs)


def _encode(docs: list[_Doc]) -> _Encoded:
    """Tokens of ``docs`` with the worker's tokenizer; one sequence per document unless a document is sentences."""
    tok = _TOKENIZER
    assert tok is not None, "worker not initialised"
    if not all(isinstance(d, str) for d in docs):
        return _encode_sentences(tok, docs)
    texts: list[str] = docs  # type: ignore[assignment]
    append_eod, dtype = _OPTS.append_eod, _OPTS.dtype
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
    return tokens, lengths, None


def _encode_sentences(tok: Tokenizer, docs: list[_Doc]) -> _Encoded:
    """Documents of sentences: one sequence per non-empty sentence, EOD at the end of the last one (Megatron's rule)."""
    flat: list[str] = []
    counts: list[int] = []
    for d in docs:
        sentences = [d] if isinstance(d, str) else d
        flat.extend(sentences)
        counts.append(len(sentences))
    ids = tok.encode_batch(flat)
    tokens: list[int] = []
    lengths: list[int] = []
    per_doc: list[int] = []
    pos = 0
    for n in counts:
        doc = [list(x) for x in ids[pos : pos + n] if len(x)]
        pos += n
        if _OPTS.append_eod:
            if doc:
                doc[-1].append(tok.eod)
            elif not _OPTS.megatron_documents:
                doc = [[tok.eod]]
        if not doc and not _OPTS.megatron_documents:  # no token at all: dropped, counted as blank
            continue
        per_doc.append(len(doc))
        for x in doc:
            lengths.append(len(x))
            tokens.extend(x)
    return np.asarray(tokens, _OPTS.dtype), np.asarray(lengths, np.int32), np.asarray(per_doc, np.int32)


class _Done:
    """A result computed in this process, with the ``AsyncResult`` methods the main loop uses."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def ready(self) -> bool:
        return True

    def get(self) -> Any:
        return self.value


@dataclass
class _Pending:
    nbytes: int
    counts: _Counts | None
    """(documents, skipped, blank, examples) when the main process parsed the chunk; None when they come with the result."""
    result: Any


def _restore_worker_state(tokenizer: Tokenizer | None, opts: _Options, env: str | None) -> None:
    """Undo what :func:`_init_worker` did to this (the caller's) process when it tokenized here."""
    global _TOKENIZER, _OPTS
    _TOKENIZER, _OPTS = tokenizer, opts
    if env is None:
        os.environ.pop("TOKENIZERS_PARALLELISM", None)
    else:
        os.environ["TOKENIZERS_PARALLELISM"] = env


def preprocess(config: PreprocessConfig, progress: Callable[[int, int], None] | None = None) -> PreprocessSummary:
    """Tokenize ``config.inputs`` into ``config.output_prefix``; ``progress(documents, bytes)`` after every chunk."""
    t0 = time.perf_counter()
    check_outputs([config.output_prefix + ".bin", config.output_prefix + ".idx"], config.overwrite)
    files = expand_inputs(config.inputs)
    tokenizer = build_tokenizer(config.tokenizer)
    dtype = optimal_dtype(tokenizer.vocab_size)
    summary = PreprocessSummary(files=len(files), dtype=str(dtype))
    # shrinking chunks at the end of the input let the tokenizer processes finish together
    chunks = iter_chunks(files, text_unit=config.text_unit, chunk_bytes=config.chunk_bytes,
                         tail_parts=4 * config.workers if config.workers > 1 else 0)  # fmt: skip
    opts = _Options(config.append_eod, dtype, config.json_key, config.skip_malformed,
                    config.keep_blank or config.megatron_documents, config.split_sentences, config.keep_newlines,
                    config.lang, config.megatron_documents)  # fmt: skip
    init_args = (config.tokenizer, opts)
    main_tokenizes = config.main_tokenizes()
    pool_size = config.workers - 1 if main_tokenizes else config.workers
    logger.info("%d tokenizer processes: %d pool workers%s", config.workers, pool_size,
                " and the main process" if main_tokenizes else "; the main process reads and parses")  # fmt: skip

    def consume(item: _Pending, writer: IndexedDatasetWriter) -> None:
        if item.counts is None:  # parsed where it was tokenized: the counts come back with the tokens
            (n_docs_in, skipped, blank, examples), (tokens, lengths, per_doc) = item.result.get()
        else:
            (n_docs_in, skipped, blank, examples), (tokens, lengths, per_doc) = item.counts, item.result.get()
        for line in examples[: _MAX_EXAMPLES - len(summary.skipped_examples)]:
            logger.warning("skipped malformed line %s", line)
            summary.skipped_examples.append(line)
        writer.add_documents(tokens, lengths, per_doc)
        n_docs = len(lengths) if per_doc is None else len(per_doc)
        summary.documents += n_docs
        summary.sentences += len(lengths)
        summary.tokens += int(tokens.size)
        summary.skipped += skipped
        summary.blank += blank + n_docs_in - n_docs
        summary.input_bytes += item.nbytes
        if progress is not None:
            progress(n_docs, item.nbytes)

    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    # Results are written in input order, so finished chunks wait behind the oldest unfinished one. In the tokenizer
    # role the main process must not block on that one while it could tokenize the next chunk itself: allow a deeper
    # queue there (a chunk in flight holds ~1 MB of text and its tokens, so memory stays bounded either way).
    max_in_flight = (8 if main_tokenizes else 2) * config.workers + 2
    with contextlib.ExitStack() as stack:
        writer = stack.enter_context(IndexedDatasetWriter(config.output_prefix, dtype, overwrite=config.overwrite))
        pool = None
        if pool_size > 0:
            pool = stack.enter_context(ctx.Pool(pool_size, initializer=_init_worker, initargs=init_args))
        if main_tokenizes:  # after the fork: the pool does not inherit this process's tokenizer
            stack.callback(_restore_worker_state, _TOKENIZER, _OPTS, os.environ.get("TOKENIZERS_PARALLELISM"))
            _init_worker(*init_args)
        pending: deque[_Pending] = deque()
        for chunk in chunks:
            if main_tokenizes:
                queued = sum(1 for p in pending if not p.result.ready())
                if pool is None or queued >= 2 * pool_size:  # the pool has enough to do: tokenize this one here
                    pending.append(_Pending(chunk.nbytes, None, _Done(_parse_and_encode(chunk))))
                else:
                    pending.append(_Pending(chunk.nbytes, None, pool.apply_async(_parse_and_encode, (chunk,))))
            else:
                assert pool is not None
                docs, counts = _parse_chunk(chunk, opts)
                pending.append(_Pending(chunk.nbytes, counts, pool.apply_async(_encode, (docs,))))
            while pending and (len(pending) >= max_in_flight or pending[0].result.ready()):
                consume(pending.popleft(), writer)
        while pending:
            consume(pending.popleft(), writer)
        if writer.num_documents == 0 and not config.allow_empty:  # raising here discards the outputs
            raise EmptyInputError(
                f"no documents in {len(files)} input file(s) ({summary.blank:,} blank, {summary.skipped:,} malformed "
                "skipped); pass --allow-empty to write an empty dataset"
            )
    return _finish(summary, t0)


def _finish(summary: PreprocessSummary, t0: float) -> PreprocessSummary:
    if summary.skipped:
        logger.warning("skipped %d malformed line(s) in total", summary.skipped)
    summary.seconds = time.perf_counter() - t0
    logger.info("preprocessed %d documents, %d tokens, %d skipped in %.1fs", summary.documents, summary.tokens,
                summary.skipped, summary.seconds)  # fmt: skip
    return summary
