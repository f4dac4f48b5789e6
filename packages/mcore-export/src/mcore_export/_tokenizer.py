"""Tokenizer files between an mcore checkpoint's tokenizer description and a Hugging Face model directory.

mcore checkpoints record ``metadata["tokenizer"] = {"kind": "byte" | "sentencepiece" | "hf", "path", "eod_token"}``.
Export: an ``hf`` tokenizer's ``tokenizer.json`` is copied with a ``tokenizer_config.json`` for
``PreTrainedTokenizerFast``; a SentencePiece model becomes ``tokenizer.model`` with a ``LlamaTokenizer`` config; the
byte tokenizer becomes a ``tokenizer.json`` written here (:func:`byte_tokenizer_json`: the 256 bytes as ids 0..255,
EOD, PAD and BOS as special tokens 256..258) that encodes and decodes text exactly as mcore's ``ByteTokenizer``.
Each returns the special tokens, whose ids go into ``config.json``. Import copies the tokenizer files of a Hugging
Face directory into ``<ckpt>/tokenizer/`` and describes them relative to the checkpoint.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TokenIds", "byte_tokenizer_json", "export_tokenizer", "import_tokenizer", "HF_TOKENIZER_FILES"]

logger = logging.getLogger(__name__)

HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "added_tokens.json",
)
_EOS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")
_BOS = ("<s>", "<bos>", "<|begin_of_text|>")
_PAD = ("<pad>", "[PAD]", "<|pad|>")


@dataclass
class TokenIds:
    """Special tokens of an exported tokenizer (ids for ``config.json`` / ``generation_config.json``)."""

    eos: tuple[str, int] | None = None
    bos: tuple[str, int] | None = None
    pad: tuple[str, int] | None = None


def _vocabulary(tokenizer_json: Path) -> dict[str, int]:
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab: dict[str, int] = {}
    model_vocab = (data.get("model") or {}).get("vocab")
    if isinstance(model_vocab, dict):
        vocab.update({str(k): int(v) for k, v in model_vocab.items()})
    elif isinstance(model_vocab, list):  # Unigram: [[piece, score], ...] in id order
        vocab.update({str(item[0]): i for i, item in enumerate(model_vocab)})
    for tok in data.get("added_tokens") or []:
        vocab[str(tok["content"])] = int(tok["id"])
    return vocab


def _first(vocab: dict[str, int], names: tuple[str, ...]) -> tuple[str, int] | None:
    for n in names:
        if n in vocab:
            return n, vocab[n]
    return None


def export_tokenizer(spec: dict[str, Any] | None, out: Path, model_max_length: int) -> TokenIds:
    """Write the Hugging Face form of the checkpoint's tokenizer into ``out`` (if it has one)."""
    if spec is None:
        logger.warning("the checkpoint records no tokenizer: no tokenizer files written")
        return TokenIds()
    kind, path = spec.get("kind"), spec.get("path")
    if kind == "byte":
        return _export_byte(out, model_max_length)
    if not path or not Path(path).exists():
        logger.warning("the checkpoint's %s tokenizer file %s is missing: no tokenizer files written", kind, path)
        return TokenIds()
    src = Path(path)
    if kind == "hf":
        if src.is_dir():
            src = src / "tokenizer.json"
        shutil.copyfile(src, out / "tokenizer.json")
        vocab = _vocabulary(src)
        eod = spec.get("eod_token")
        ids = TokenIds(
            eos=(eod, vocab[eod]) if eod in vocab else _first(vocab, _EOS),
            bos=_first(vocab, _BOS),
            pad=_first(vocab, _PAD),
        )
        sibling = src.parent / "tokenizer_config.json"
        if sibling.exists():
            for name in ("tokenizer_config.json", "special_tokens_map.json"):
                if (src.parent / name).exists():
                    shutil.copyfile(src.parent / name, out / name)
        else:
            cfg: dict[str, Any] = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": model_max_length,
                "clean_up_tokenization_spaces": False,
            }
            for field, tok in (("eos_token", ids.eos), ("bos_token", ids.bos), ("pad_token", ids.pad)):
                if tok is not None:
                    cfg[field] = tok[0]
            (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        logger.info("tokenizer: copied %s (eos %s)", src, ids.eos)
        return ids
    if kind == "sentencepiece":
        shutil.copyfile(src, out / "tokenizer.model")
        pieces = _sentencepiece_specials(src)
        cfg = {
            "tokenizer_class": "LlamaTokenizer",
            "model_max_length": model_max_length,
            "bos_token": pieces.bos[0] if pieces.bos else "<s>",
            "eos_token": pieces.eos[0] if pieces.eos else "</s>",
            "unk_token": "<unk>",
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        if pieces.pad:
            cfg["pad_token"] = pieces.pad[0]
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        logger.info("tokenizer: copied SentencePiece model %s as tokenizer.model (LlamaTokenizer config, eos %s)",
                    src, pieces.eos)  # fmt: skip
        return pieces
    logger.warning("unknown tokenizer kind %r: no tokenizer files written", kind)
    return TokenIds()


def _sentencepiece_specials(model: Path) -> TokenIds:
    """The model's eos (mcore's end of document), bos and pad pieces, read with ``sentencepiece`` when installed."""
    try:
        import sentencepiece as spm
    except ImportError:
        logger.warning(
            "sentencepiece is not installed: the special-token ids of %s are not written to config.json "
            "(pip install sentencepiece)",
            model,
        )
        return TokenIds()
    sp = spm.SentencePieceProcessor(model_file=str(model))

    def piece(i: int) -> tuple[str, int] | None:
        return (str(sp.id_to_piece(i)), int(i)) if i >= 0 else None

    return TokenIds(eos=piece(sp.eos_id()), bos=piece(sp.bos_id()), pad=piece(sp.pad_id()))


# The special tokens of mcore's ByteTokenizer (ids after the 256 bytes), under names transformers knows.
_BYTE_SPECIALS = (("<|endoftext|>", 256), ("<pad>", 257), ("<s>", 258))


def _byte_to_unicode() -> dict[int, str]:
    """The printable character that stands for each byte in byte-level BPE vocabularies (GPT-2's table): printable
    Latin-1 bytes stand for themselves, the others map to code points from 256 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer_json() -> dict[str, Any]:
    """A ``tokenizers`` JSON equal to mcore's ``ByteTokenizer``: byte-level BPE without merges whose vocabulary maps
    each byte's character to the byte's value, so every UTF-8 byte of the text is one token with its own value as id;
    decoding joins the bytes and decodes UTF-8 with replacement characters. EOD, PAD and BOS are special tokens 256,
    257 and 258. No pre-tokenizer regex (splitting would not change the ids) and no normaliser: text goes in as is."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    added = [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for name, i in _BYTE_SPECIALS]  # fmt: skip
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {ch: b for b, ch in _byte_to_unicode().items()},
            "merges": [],
        },
    }


def _export_byte(out: Path, model_max_length: int) -> TokenIds:
    (out / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(), ensure_ascii=False, indent=1) + "\n",
                                        encoding="utf-8")  # fmt: skip
    (eos, _), (pad, _), (bos, _) = _BYTE_SPECIALS
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "eos_token": eos,
        "pad_token": pad,
        "bos_token": bos,
        "clean_up_tokenization_spaces": False,
        # text that spells a special token stays bytes, as in mcore (the ids 256..258 come only from the data)
        "split_special_tokens": True,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    logger.info("tokenizer: mcore's byte tokenizer written as tokenizer.json (256 bytes, EOD %s = 256)", eos)
    return TokenIds(eos=_BYTE_SPECIALS[0], bos=_BYTE_SPECIALS[2], pad=_BYTE_SPECIALS[1])


def _is_byte_tokenizer(tokenizer_json: Path) -> bool:
    try:
        data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return bool(data == byte_tokenizer_json())


def _token_string(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def import_tokenizer(model_dir: Path, ckpt: Path) -> dict[str, Any] | None:
    """Copy the tokenizer files of ``model_dir`` into ``ckpt/tokenizer/``; returns the metadata entry (or None)."""
    present = [n for n in HF_TOKENIZER_FILES if (model_dir / n).is_file()]
    if not present:
        logger.warning("%s has no tokenizer files: the checkpoint records no tokenizer", model_dir)
        return None
    (ckpt / "tokenizer").mkdir()
    for name in present:
        shutil.copyfile(model_dir / name, ckpt / "tokenizer" / name)
    eod = None
    if "tokenizer_config.json" in present:
        try:
            eod = _token_string(json.loads((model_dir / "tokenizer_config.json").read_text()).get("eos_token"))
        except (json.JSONDecodeError, AttributeError):
            logger.warning("%s/tokenizer_config.json is not a JSON object; ignoring it", model_dir)
    if "tokenizer.json" in present:
        if _is_byte_tokenizer(model_dir / "tokenizer.json"):  # what the export writes for mcore's byte tokenizer
            return {"kind": "byte", "path": None}
        return {"kind": "hf", "path": "tokenizer/tokenizer.json", "eod_token": eod}
    if "tokenizer.model" in present:
        return {"kind": "sentencepiece", "path": "tokenizer/tokenizer.model", "eod_token": eod}
    logger.warning(
        "%s: only slow-tokenizer files (%s); mcore needs tokenizer.json or tokenizer.model, so the "
        "checkpoint records no tokenizer (files copied to tokenizer/)",
        model_dir,
        ", ".join(present),
    )
    return None
