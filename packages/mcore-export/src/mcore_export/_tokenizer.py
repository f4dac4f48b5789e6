"""Tokenizer files between an mcore checkpoint's tokenizer description and a Hugging Face model directory.

mcore checkpoints record ``metadata["tokenizer"] = {"kind": "byte" | "sentencepiece" | "hf", "path", "eod_token"}``.
Export: an ``hf`` tokenizer's ``tokenizer.json`` is copied with a ``tokenizer_config.json`` for
``PreTrainedTokenizerFast``; a SentencePiece model becomes ``tokenizer.model`` with a ``LlamaTokenizer`` config; the
byte tokenizer has no Hugging Face form and is reported as such. Import copies the tokenizer files of a Hugging Face
directory into ``<ckpt>/tokenizer/`` and describes them relative to the checkpoint.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TokenIds", "export_tokenizer", "import_tokenizer", "HF_TOKENIZER_FILES"]

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
        logger.warning(
            "the checkpoint uses mcore's byte tokenizer, which has no Hugging Face form: no tokenizer files written"
        )
        return TokenIds()
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
        cfg = {
            "tokenizer_class": "LlamaTokenizer",
            "model_max_length": model_max_length,
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        logger.info("tokenizer: copied SentencePiece model %s as tokenizer.model (LlamaTokenizer config)", src)
        return TokenIds()
    logger.warning("unknown tokenizer kind %r: no tokenizer files written", kind)
    return TokenIds()


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
