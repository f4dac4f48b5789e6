"""Raw inputs for preprocessing and tokenizer training: JSONL files, plain text files, directories and ``.gz``.

A JSONL line is one document (the value under ``json_key``). A plain text file is one document (``text_unit="file"``)
or one document per non-empty line (``text_unit="line"``). Directories are walked recursively in sorted order.
Raw units are read here as bytes in chunks; parsing happens where the tokenizer runs (worker processes).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from mcore_data.errors import ConfigError, InputFormatError

__all__ = ["Chunk", "expand_inputs", "iter_chunks", "iter_texts", "parse_unit"]

_JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
_TEXT_SUFFIXES = (".txt", ".text", ".md", ".py", ".rst")


def _base_suffix(p: Path) -> str:
    name = p.name[:-3] if p.name.endswith(".gz") else p.name
    return os.path.splitext(name)[1].lower()


def expand_inputs(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Files named by ``inputs``, directories expanded (recursively, sorted) to their JSONL/text files."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(
                q for q in p.rglob("*") if q.is_file() and _base_suffix(q) in _JSON_SUFFIXES + _TEXT_SUFFIXES
            )
            files.extend(found)
        elif p.exists():
            files.append(p)
        else:
            raise FileNotFoundError(f"{p}: input not found")
    if not files:
        raise ConfigError(f"no input files found in {', '.join(map(str, inputs))}")
    return files


def is_jsonl(path: Path) -> bool:
    return _base_suffix(path) in _JSON_SUFFIXES


def open_binary(path: Path) -> IO[bytes]:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb", buffering=1 << 20)


@dataclass
class Chunk:
    """A batch of raw units from one file: ``kind`` is ``json`` or ``text``; ``first_line`` numbers the first unit."""

    path: str
    kind: str
    first_line: int
    units: list[bytes] = field(default_factory=list)
    nbytes: int = 0


def iter_chunks(
    files: Sequence[Path], *, text_unit: str = "file", chunk_bytes: int = 1 << 20, tail_parts: int = 0
) -> Iterator[Chunk]:
    """Raw units of every file, batched into chunks of about ``chunk_bytes``; order is the input order.

    With ``tail_parts`` > 0 chunks shrink towards the end of the input (to the bytes left / ``tail_parts``, at least
    64 KiB), so parallel workers finish together instead of one waiting for another's last big chunk. Compressed
    inputs count with their compressed size (an estimate is enough here).
    """
    if text_unit not in ("file", "line"):
        raise ConfigError(f"text_unit must be 'file' or 'line', not {text_unit!r}")
    left = sum(p.stat().st_size for p in files) if tail_parts > 0 else 0

    def limit_now() -> int:
        return chunk_bytes if tail_parts <= 0 else max(1 << 16, min(chunk_bytes, left // tail_parts))

    for path in files:
        kind = "json" if is_jsonl(path) else "text"
        with open_binary(path) as f:
            if kind == "text" and text_unit == "file":
                data = f.read()
                left -= len(data)
                yield Chunk(str(path), kind, 1, [data], len(data))
                continue
            chunk = Chunk(str(path), kind, 1)
            limit = limit_now()
            for lineno, line in enumerate(f, 1):
                chunk.units.append(line)
                chunk.nbytes += len(line)
                if chunk.nbytes >= limit:
                    left -= chunk.nbytes
                    limit = limit_now()
                    yield chunk
                    chunk = Chunk(str(path), kind, lineno + 1)
            if chunk.units:
                left -= chunk.nbytes
                yield chunk


def parse_unit(kind: str, raw: bytes, json_key: str, keep_blank: bool = False) -> str | list[str] | None:
    """The text of one raw unit; ``None`` for a blank one. Raises ``ValueError`` for a malformed one.

    A JSONL value that is a list of strings is a document of ready-made sentences (Megatron's convention) and is
    returned as that list.

    A unit whose text is empty or only whitespace is blank unless ``keep_blank`` (then only an empty JSONL line or an
    empty text line is blank).
    """
    if kind == "text":
        text = raw.decode("utf-8")
        if raw.endswith(b"\n") and not raw.strip():
            return None
        return text if keep_blank or text.strip() else None
    if not raw.strip():
        return None
    obj = json.loads(raw)
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if json_key not in obj:
        raise ValueError(f"no key {json_key!r} (keys: {', '.join(list(obj)[:8])})")
    value = obj[json_key]
    if isinstance(value, list):
        if not all(isinstance(v, str) for v in value):
            raise ValueError(f"value of {json_key!r} is a list with non-string items, expected strings (sentences)")
        return value if keep_blank or any(v.strip() for v in value) else None
    if not isinstance(value, str):
        raise ValueError(f"value of {json_key!r} is {type(value).__name__}, expected a string or a list of strings")
    return value if keep_blank or value.strip() else None


def iter_texts(
    inputs: Sequence[str | os.PathLike[str]], *, json_key: str = "text", text_unit: str = "file"
) -> Iterator[str]:
    """Every document's text (malformed lines raise :class:`InputFormatError`)."""
    for chunk in iter_chunks(expand_inputs(inputs), text_unit=text_unit):
        for k, raw in enumerate(chunk.units):
            try:
                text = parse_unit(chunk.kind, raw, json_key)
            except (ValueError, UnicodeDecodeError) as e:
                raise InputFormatError(chunk.path, chunk.first_line + k, str(e)) from e
            if isinstance(text, list):
                yield " ".join(text)
            elif text is not None:
                yield text
