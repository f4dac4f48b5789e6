"""Training new tokenizers from a corpus: SentencePiece (BPE or unigram) and Hugging Face byte-level BPE.

Inputs are JSONL, plain text or ``.gz`` files (read with :mod:`mcore_data.inputs`); the text is streamed to the
trainer, never held whole in memory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from mcore_data._files import check_outputs
from mcore_data.errors import ConfigError
from mcore_data.inputs import iter_texts
from mcore_data.tokenizer import _import

__all__ = ["train_hf_bpe", "train_sentencepiece"]

logger = logging.getLogger(__name__)


def _texts(inputs: Sequence[str | os.PathLike[str]], json_key: str, max_docs: int | None) -> Iterator[str]:
    for n, text in enumerate(iter_texts(inputs, json_key=json_key)):
        if max_docs is not None and n >= max_docs:
            return
        if text:
            yield text


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
) -> Path:
    """Train a SentencePiece model; writes ``model_prefix.model`` and ``.vocab``; returns the ``.model`` path.

    The model gets ids pad=0, bos=1, eos=2 (eos is the end-of-document token), unk=3.
    """
    if model_type not in ("bpe", "unigram"):
        raise ConfigError(f"SentencePiece model type must be bpe or unigram, not {model_type!r}")
    spm = _import("sentencepiece", "sentencepiece")
    prefix = os.fspath(model_prefix)
    check_outputs([prefix + ".model", prefix + ".vocab"], overwrite)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=_texts(inputs, json_key, max_docs),
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
    logger.info("trained SentencePiece %s model %s.model (vocab %d)", model_type, prefix, vocab_size)
    return Path(prefix + ".model")


def train_hf_bpe(
    inputs: Sequence[str | os.PathLike[str]],
    output: str | os.PathLike[str],
    vocab_size: int = 8000,
    *,
    json_key: str = "text",
    max_docs: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Train a byte-level BPE ``tokenizer.json`` with ``<|endoftext|>`` (EOD) and ``<pad>`` special tokens."""
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
    tok.train_from_iterator(_texts(inputs, json_key, max_docs), trainer=trainer)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, out)
    logger.info("trained HF byte-level BPE %s (vocab %d)", out, tok.get_vocab_size())
    return out
