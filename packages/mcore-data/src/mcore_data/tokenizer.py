"""Tokenizers behind one small protocol: a byte-level tokenizer needing no files, SentencePiece and HF ``tokenizers``.

SentencePiece and ``tokenizers`` are optional extras, imported only when such a tokenizer is built; a missing one
raises :class:`~mcore_data.errors.MissingDependencyError` naming the extra (``pip install 'mcore-data[...]'``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from mcore_data.errors import ConfigError, MissingDependencyError

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "TokenizerSpec",
    "build_tokenizer",
]


@runtime_checkable
class Tokenizer(Protocol):
    """What preprocessing and datasets need from a tokenizer. ``pad``/``bos`` are ``None`` when absent."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def eod(self) -> int: ...
    @property
    def pad(self) -> int | None: ...
    @property
    def bos(self) -> int | None: ...
    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: Any) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus EOD 256, PAD 257 and BOS 258 (vocabulary 259). Needs no files."""

    vocab_size = 259
    eod = 256
    pad: int | None = 257
    bos: int | None = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def encode_bytes(self, text: str) -> bytes:
        """Fast path for preprocessing: the token ids are the bytes themselves."""
        return text.encode("utf-8")

    def decode(self, ids: Any) -> str:
        """The UTF-8 text of the byte ids (the special ids have none; broken bytes become U+FFFD)."""
        data = None
        if isinstance(ids, list | tuple):
            try:
                data = bytes(ids)  # every id a byte: one C call
            except ValueError:  # some id past 255 (EOD, PAD, BOS) or below 0
                data = bytes([i for i in ids if 0 <= i < 256])
            except TypeError:  # not integers
                pass
        if data is None:
            data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


def _import(module: str, extra: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(module, extra) from e


class SentencePieceTokenizer:
    """A SentencePiece ``.model``. EOD is the model's ``</s>`` (eos) id, as in Megatron's GPTSentencePieceTokenizer."""

    def __init__(self, model_path: str | os.PathLike[str]) -> None:
        spm = _import("sentencepiece", "sentencepiece")
        if not os.path.exists(model_path):
            raise FileNotFoundError(f"{model_path}: SentencePiece model not found")
        self.model_path = os.fspath(model_path)
        self._sp = spm.SentencePieceProcessor(model_file=self.model_path)
        self.vocab_size = int(self._sp.vocab_size())
        eos = int(self._sp.eos_id())
        if eos < 0:
            raise ConfigError(f"{model_path}: SentencePiece model has no eos piece to use as end of document")
        self.eod = eos
        self.pad = int(self._sp.pad_id()) if self._sp.pad_id() >= 0 else None
        self.bos = int(self._sp.bos_id()) if self._sp.bos_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return list(self._sp.encode(texts, num_threads=1))

    def decode(self, ids: Any) -> str:
        return str(self._sp.decode([int(i) for i in ids]))


_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]", "<|eot_id|>")
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>")
_BOS_CANDIDATES = ("<s>", "<bos>", "<|begin_of_text|>", "[CLS]")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` ``tokenizer.json``. EOD is ``eod_token`` or the first known end token found."""

    def __init__(self, path: str | os.PathLike[str], eod_token: str | None = None, merges: str | None = None) -> None:
        tk = _import("tokenizers", "tokenizers")
        p = os.fspath(path)
        if os.path.isdir(p) and merges is None:
            p = os.path.join(p, "tokenizer.json")
        for f in (p, merges):
            if f is not None and not os.path.exists(f):
                raise FileNotFoundError(f"{f}: tokenizer file not found")
        self.model_path = p
        self._tok = tk.Tokenizer.from_file(p) if merges is None else _gpt2_bpe(tk, p, merges)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        eod = self._find((eod_token,) if eod_token else _EOD_CANDIDATES)
        if eod is None:
            raise ConfigError(f"{p}: no end-of-document token found; pass one of its tokens as eod_token")
        self.eod = eod
        self.pad = self._find(_PAD_CANDIDATES)
        self.bos = self._find(_BOS_CANDIDATES)

    def _find(self, names: tuple[str, ...]) -> int | None:
        for n in names:
            i = self._tok.token_to_id(n)
            if i is not None:
                return int(i)
        return None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # ``encode_batch_fast`` (tokenizers >= 0.21) skips the character offsets: the same ids, ~20% faster on one
        # thread. Without it, a loop of ``encode`` beats ``encode_batch`` when its thread pool is off (parallelism
        # comes from worker processes).
        fast = getattr(self._tok, "encode_batch_fast", None)
        if fast is not None:
            return [e.ids for e in fast(texts, add_special_tokens=False)]
        enc = self._tok.encode
        return [enc(t, add_special_tokens=False).ids for t in texts]

    def decode(self, ids: Any) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))


def _gpt2_bpe(tk: Any, vocab: str, merges: str) -> Any:
    """GPT-2's byte-level BPE from ``vocab.json`` + ``merges.txt`` (what Megatron's GPT2BPETokenizer reads)."""
    tok = tk.Tokenizer(tk.models.BPE.from_file(vocab, merges))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    return tok


@dataclass(frozen=True)
class TokenizerSpec:
    """How to build a tokenizer (picklable, so worker processes can rebuild it).

    ``kind`` is ``byte``, ``sentencepiece``, ``hf`` or ``gpt2-bpe``; ``path`` the model file (for ``gpt2-bpe`` the
    ``vocab.json``, with ``merges`` the ``merges.txt``).
    """

    kind: str = "byte"
    path: str | None = None
    eod_token: str | None = None
    merges: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("byte", "sentencepiece", "hf", "gpt2-bpe"):
            raise ConfigError(f"unknown tokenizer kind {self.kind!r}; use byte, sentencepiece, hf or gpt2-bpe")
        if self.kind == "gpt2-bpe" and not self.merges:
            raise ConfigError("tokenizer kind 'gpt2-bpe' needs a merges.txt (--merge-file)")
        if self.kind != "byte" and not self.path:
            raise ConfigError(f"tokenizer kind {self.kind!r} needs a model path (--tokenizer-model)")

    def identifier(self) -> dict[str, Any]:
        ident = {"kind": self.kind, "path": os.path.abspath(self.path) if self.path else None}
        if self.merges:
            ident["merges"] = os.path.abspath(self.merges)
        return ident


def build_tokenizer(spec: TokenizerSpec | str, path: str | None = None) -> Tokenizer:
    """Build a tokenizer from a :class:`TokenizerSpec` or ``(kind, path)``."""
    if isinstance(spec, str):
        spec = TokenizerSpec(spec, path)
    if spec.kind == "byte":
        return ByteTokenizer()
    assert spec.path is not None
    if spec.kind == "sentencepiece":
        return SentencePieceTokenizer(spec.path)
    return HFTokenizer(spec.path, spec.eod_token, spec.merges)
