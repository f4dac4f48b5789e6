"""Training new tokenizers from a corpus: SentencePiece (BPE or unigram) and Hugging Face byte-level BPE.

Inputs are JSONL, plain text or ``.gz`` files (read with :mod:`mcore_data.inputs`); the text is streamed to the
trainer, never held whole in memory.

With ``progress=True`` (the CLI's default) both phases of a training show progress (:mod:`mcore_data._progress`):
reading and counting the corpus (a bar over its bytes on a terminal, else log lines with the rate and an ETA), then
the trainer's own work (merges, or SentencePiece's EM rounds), whose length is not known in advance: the elapsed time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from mcore_data._files import check_outputs
from mcore_data._progress import Heartbeat, Progress
from mcore_data.errors import ConfigError, InputFormatError
from mcore_data.inputs import expand_inputs, iter_chunks, parse_unit
from mcore_data.tokenizer import _import

__all__ = ["train_hf_bpe", "train_sentencepiece"]

logger = logging.getLogger(__name__)


class _Corpus:
    """The documents' texts for a trainer (at most ``max_docs``), with the reading's progress, and when the reading
    ends (the trainer has all it needs from the corpus) a heartbeat for the trainer's own phase ``then``."""

    def __init__(self, inputs: Sequence[str | os.PathLike[str]], json_key: str, max_docs: int | None,
                 progress: bool, then: str) -> None:  # fmt: skip
        self.files = expand_inputs(inputs)
        self.json_key, self.max_docs, self.then = json_key, max_docs, then
        self.progress = progress
        self.documents = 0
        compressed = any(f.name.endswith(".gz") for f in self.files)  # the bytes read are not the file sizes
        if max_docs is not None:
            self.bar = Progress("reading the corpus", max_docs, "documents", enabled=progress)
        else:
            total = None if compressed else sum(f.stat().st_size for f in self.files)
            self.bar = Progress("reading the corpus", total, "B", enabled=progress)
        self.heartbeat = Heartbeat(then, enabled=progress)

    def texts(self) -> Iterator[str]:
        by_docs = self.max_docs is not None
        for chunk in iter_chunks(self.files):
            for k, raw in enumerate(chunk.units):
                if self.max_docs is not None and self.documents >= self.max_docs:
                    self._read()
                    return
                try:
                    text = parse_unit(chunk.kind, raw, self.json_key)
                except (ValueError, UnicodeDecodeError) as e:
                    raise InputFormatError(chunk.path, chunk.first_line + k, str(e)) from e
                self.documents += 1
                if by_docs:
                    self.bar.update(1)
                if isinstance(text, list):
                    text = " ".join(text)
                if text:
                    yield text
            if not by_docs:
                self.bar.update(chunk.nbytes)
        self._read()

    def _read(self) -> None:
        if self.bar.enabled:
            self.bar.close()
            self.heartbeat.__enter__()

    def done(self, error: BaseException | None = None) -> None:
        """After the trainer returned (or raised ``error``): end the heartbeat (saying how long it took when done)."""
        self.bar.close()
        self.heartbeat.__exit__(None if error is None else type(error), error, None)


def train_sentencepiece(
    inputs: Sequence[str | os.PathLike[str]],
    model_prefix: str | os.PathLike[str],
    vocab_size: int = 8000,
    model_type: str = "bpe",
    *,
    json_key: str = "text",
    max_docs: int | None = None,
    character_coverage: float = 0.9995,
    overwrite: bool = False,
    num_threads: int = 1,
    progress: bool = False,
) -> Path:
    """Train a SentencePiece model; writes ``model_prefix.model`` and ``.vocab``; returns the ``.model`` path.

    The model gets ids pad=0, bos=1, eos=2 (eos is the end-of-document token), unk=3. ``progress``: report the
    reading of the corpus and the training (see the module docstring).
    """
    if model_type not in ("bpe", "unigram"):
        raise ConfigError(f"SentencePiece model type must be bpe or unigram, not {model_type!r}")
    spm = _import("sentencepiece", "sentencepiece")
    prefix = os.fspath(model_prefix)
    check_outputs([prefix + ".model", prefix + ".vocab"], overwrite)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    corpus = _Corpus(inputs, json_key, max_docs, progress, f"training the SentencePiece {model_type} model")
    try:
        _train_spm(spm, corpus, prefix, vocab_size, model_type, character_coverage, num_threads)
    except BaseException as e:
        corpus.done(e)
        raise
    corpus.done()
    logger.info("trained SentencePiece %s model %s.model (vocab %d)", model_type, prefix, vocab_size)
    return Path(prefix + ".model")


def _train_spm(spm: Any, corpus: _Corpus, prefix: str, vocab_size: int, model_type: str, character_coverage: float,
               num_threads: int) -> None:  # fmt: skip
    spm.SentencePieceTrainer.train(
        sentence_iterator=corpus.texts(),
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=3,
        byte_fallback=True,
        max_sentence_length=1 << 16,
        num_threads=num_threads,
        minloglevel=2,
    )


def train_hf_bpe(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    vocab_size: int = 8000,
    *,
    json_key: str = "text",
    max_docs: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Train a byte-level BPE ``tokenizer.json`` with ``<|endoftext|>`` (EOD) and ``<pad>`` special tokens.

    ``progress``: report the reading of the corpus and the merges (see the module docstring; the trainer's own bars,
    ``show_progress``, stay off: they draw only on a terminal, without an ETA for a streamed corpus)."""
    tk = _import("tokenizers", "tokenizers")
    out = Path(output)
    if out.is_dir() or not out.suffix:
        out = out / "tokenizer.json"
    check_outputs([out], overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _Corpus(inputs, json_key, max_docs, progress, f"computing the merges (vocabulary {vocab_size:,})")
    try:
        tok.train_from_iterator(corpus.texts(), trainer=trainer)
    except BaseException as e:
        corpus.done(e)
        raise
    corpus.done()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, out)
    logger.info("trained HF byte-level BPE %s (vocab %d)", out, tok.get_vocab_size())
    return out
