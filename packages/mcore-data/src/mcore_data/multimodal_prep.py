"""``mcore-data multimodal``: image folders + JSONL records into tar shards, and a synthetic image-caption set.

Input records, one JSON object per line, image paths relative to the JSONL file's directory::

    {"image": "imgs/0001.jpg", "caption": "a dog on a beach"}
    {"image": "imgs/0002.png", "conversations": [{"role": "user", "content": "<image>\\nWhat is this?"},
                                                 {"role": "assistant", "content": "A cat."}]}
    {"images": ["imgs/0003.png", "imgs/0004.jpg"],
     "conversations": [{"role": "user", "content": "<image> or <image>: which is bigger?"},
                       {"role": "assistant", "content": "The first."}]}

A record gives exactly one of ``image`` (one path) and ``images`` (a non-empty list of paths, in the order of the
``<image>`` placeholders). A conversation holds one placeholder per image, except a one-image conversation without
any (the dataset puts the image first in the first user turn); a caption record takes exactly one image.

Every record is checked before anything is written (a bad line, an unknown key, a placeholder count that differs
from the image count, a missing or non-image file is an :class:`~mcore_data.errors.InputFormatError` naming
``file:line``), so a failed run leaves no partial output.

The synthetic set: deterministic images of simple patterns (a coloured square, disc, cross or stripes on a
contrasting background) written with mcore-data's own PNG encoder, each with a caption that describes it, e.g.
``"a red disc on a white background"``: small enough for a tiny vision-language model to learn image -> caption.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from mcore_data._files import check_outputs
from mcore_data._png import PNG_SIGNATURE, encode_png
from mcore_data._progress import Progress
from mcore_data.chat import CHAT_ROLES, IMAGE_PLACEHOLDER
from mcore_data.errors import ConfigError, EmptyInputError, InputFormatError
from mcore_data.multimodal import ShardWriter

__all__ = [
    "COLORS",
    "SHAPES",
    "MultimodalSummary",
    "iter_records",
    "preprocess_multimodal",
    "synthetic_sample",
    "write_synthetic",
    "write_synthetic_folder",
]

_KEYS = {"image", "images", "caption", "conversations", "id"}


@dataclass
class MultimodalSummary:
    samples: int = 0
    shards: int = 0
    image_bytes: int = 0
    manifest: str = ""


@dataclass
class _Record:
    images: list[Path]
    exts: list[str]
    record: dict[str, Any]


def _jsonl_files(source: str | os.PathLike[str]) -> list[Path]:
    p = Path(source)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix == ".jsonl" and f.is_file())
        if not files:
            raise FileNotFoundError(f"{p}: no .jsonl file in this directory")
        return files
    if not p.exists():
        raise FileNotFoundError(f"{p}: input not found")
    return [p]


def _image_ext(path: Path, head: bytes) -> str | None:
    if head.startswith(PNG_SIGNATURE):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpg"
    return None


def _check_conversations(conv: Any, where: tuple[Path, int], images: int) -> None:
    if not isinstance(conv, list) or not conv:
        raise InputFormatError(*where, "'conversations' must be a non-empty list of {role, content} turns")
    for j, turn in enumerate(conv):
        if not isinstance(turn, dict) or set(turn) != {"role", "content"}:
            raise InputFormatError(*where, f"conversations[{j}] must be an object with exactly 'role' and 'content'")
        if turn["role"] not in CHAT_ROLES:
            raise InputFormatError(*where, f"conversations[{j}].role {turn['role']!r} is not one of {CHAT_ROLES}")
        if not isinstance(turn["content"], str):
            raise InputFormatError(*where, f"conversations[{j}].content must be a string")
    placeholders = sum(t["content"].count(IMAGE_PLACEHOLDER) for t in conv)
    if placeholders != images and not (images == 1 and placeholders == 0):
        raise InputFormatError(*where, f"{placeholders} {IMAGE_PLACEHOLDER} placeholder(s) in the conversation but "
                                       f"{images} image(s): give one placeholder per image (a single image may have "
                                       "none)")  # fmt: skip
    if not any(t["role"] == "assistant" for t in conv):
        raise InputFormatError(*where, "the conversation has no assistant turn (nothing to train on)")


def _image_paths(obj: dict[str, Any], where: tuple[Path, int]) -> list[str]:
    if ("image" in obj) == ("images" in obj):
        raise InputFormatError(*where, "needs exactly one of 'image' (a path relative to the JSONL file) and "
                                       "'images' (a list of them)")  # fmt: skip
    if "image" in obj:
        if not isinstance(obj["image"], str) or not obj["image"]:
            raise InputFormatError(*where, "'image' must be the image path relative to the JSONL file")
        return [obj["image"]]
    paths = obj["images"]
    if not isinstance(paths, list) or not paths:
        raise InputFormatError(*where, "'images' must be a non-empty list of image paths (relative to the JSONL file)")
    for j, rel in enumerate(paths):
        if not isinstance(rel, str) or not rel:
            raise InputFormatError(*where, f"images[{j}] must be an image path, not {rel!r}")
    return paths


def _check_image(path: Path, rel: str, where: tuple[Path, int]) -> tuple[Path, str]:
    image = path.parent / rel
    if not image.is_file():
        raise InputFormatError(*where, f"image file {image} not found")
    with open(image, "rb") as f:
        ext = _image_ext(image, f.read(8))
    if ext is None:
        raise InputFormatError(*where, f"image file {image} is neither PNG nor JPEG")
    return image, ext


def _parse_line(raw: bytes, path: Path, line: int) -> _Record:
    where = (path, line)
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputFormatError(path, line, f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise InputFormatError(path, line, f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        raise InputFormatError(path, line, f"unknown key(s) {unknown}; allowed: {sorted(_KEYS)}")
    rels = _image_paths(obj, where)
    if ("caption" in obj) == ("conversations" in obj):
        raise InputFormatError(path, line, "needs exactly one of 'caption' and 'conversations'")
    if "caption" in obj:
        if not isinstance(obj["caption"], str) or not obj["caption"].strip():
            raise InputFormatError(path, line, "'caption' must be a non-empty string")
        if len(rels) != 1:
            raise InputFormatError(path, line, f"a caption record takes exactly one image, got {len(rels)} in 'images'")
        record: dict[str, Any] = {"caption": obj["caption"]}
    else:
        _check_conversations(obj["conversations"], where, len(rels))
        record = {"conversations": obj["conversations"]}
    checked = [_check_image(path, rel, where) for rel in rels]
    record["source"] = obj["image"] if "image" in obj else list(rels)
    if "id" in obj:
        record["id"] = obj["id"]
    return _Record([image for image, _ in checked], [ext for _, ext in checked], record)


def iter_records(source: str | os.PathLike[str]) -> Iterator[_Record]:
    """The checked records of a JSONL file (or of every ``.jsonl`` in a directory, sorted), blank lines skipped."""
    for path in _jsonl_files(source):
        with open(path, "rb") as f:
            for line, raw in enumerate(f, 1):
                if raw.strip():
                    yield _parse_line(raw, path, line)


def preprocess_multimodal(
    source: str | os.PathLike[str],
    output_prefix: str | os.PathLike[str],
    *,
    shard_size: int = 1000,
    overwrite: bool = False,
    progress: bool = True,
) -> MultimodalSummary:
    """Check every record of ``source``, then write ``output_prefix-NNNNNN.tar`` shards and ``output_prefix.json``."""
    if shard_size < 1:
        raise ConfigError(f"--shard-size must be >= 1, got {shard_size}")
    from mcore_data.multimodal import existing_outputs

    check_outputs(existing_outputs(output_prefix), overwrite)
    total = sum(1 for _ in iter_records(source))  # the checking pass: nothing is written if a record is bad
    if total == 0:
        raise EmptyInputError(f"{source}: no records")
    summary = MultimodalSummary()
    bar = Progress("multimodal", total, unit="samples", enabled=progress)
    with ShardWriter(output_prefix, shard_size, overwrite=overwrite) as w:
        for r in iter_records(source):
            images = [(image.read_bytes(), ext) for image, ext in zip(r.images, r.exts)]
            w.add_images(images, r.record)
            summary.samples += 1
            summary.image_bytes += sum(len(data) for data, _ in images)
            bar.update(1)
    bar.close()
    summary.shards = len(w.shards)
    summary.manifest = str(Path(f"{os.fspath(output_prefix)}.json"))
    return summary


COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 180, 50),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 30),
    "purple": (140, 40, 180),
    "orange": (250, 140, 20),
}
SHAPES = ("square", "disc", "cross", "horizontal stripes", "vertical stripes")
_BACKGROUNDS = {"white": (255, 255, 255), "black": (0, 0, 0)}


def _shape_mask(shape: str, size: int) -> npt.NDArray[np.bool_]:
    y, x = np.mgrid[0:size, 0:size]
    c, r = (size - 1) / 2, size / 4
    if shape == "square":
        return (abs(x - c) <= r) & (abs(y - c) <= r)
    if shape == "disc":
        return (x - c) ** 2 + (y - c) ** 2 <= (1.2 * r) ** 2
    if shape == "cross":
        return ((abs(x - c) <= r / 3) | (abs(y - c) <= r / 3)) & (abs(x - c) <= 1.5 * r) & (abs(y - c) <= 1.5 * r)
    band = max(size // 8, 1)
    return ((y // band) % 2 == 0) if shape == "horizontal stripes" else ((x // band) % 2 == 0)


def synthetic_sample(i: int, size: int = 32, seed: int = 0) -> tuple[npt.NDArray[np.uint8], str]:
    """Pixels ``[size, size, 3]`` and the caption of synthetic sample ``i`` (a function of ``(i, seed)`` only)."""
    rng = np.random.default_rng([seed, i])
    color = list(COLORS)[int(rng.integers(len(COLORS)))]
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    bg = list(_BACKGROUNDS)[int(rng.integers(len(_BACKGROUNDS)))]
    px = np.empty((size, size, 3), np.uint8)
    px[:] = _BACKGROUNDS[bg]
    px[_shape_mask(shape, size)] = COLORS[color]
    article = "" if shape.endswith("stripes") else "an " if color[0] in "aeiou" else "a "
    return px, f"{article}{color} {shape} on a {bg} background"


def write_synthetic(
    output_prefix: str | os.PathLike[str],
    n: int,
    *,
    size: int = 32,
    seed: int = 0,
    shard_size: int = 1000,
    overwrite: bool = False,
    progress: bool = False,
) -> MultimodalSummary:
    """``n`` synthetic PNG + caption samples straight into shards (see :func:`synthetic_sample`)."""
    if n < 1:
        raise ConfigError(f"--synthetic needs at least 1 sample, got {n}")
    summary = MultimodalSummary()
    bar = Progress("synthetic", n, unit="samples", enabled=progress)
    with ShardWriter(output_prefix, shard_size, overwrite=overwrite) as w:
        for i in range(n):
            px, caption = synthetic_sample(i, size, seed)
            png = encode_png(px)
            w.add(png, "png", {"caption": caption})
            summary.samples += 1
            summary.image_bytes += len(png)
            bar.update(1)
    bar.close()
    summary.shards = len(w.shards)
    summary.manifest = str(Path(f"{os.fspath(output_prefix)}.json"))
    return summary


def write_synthetic_folder(directory: str | os.PathLike[str], n: int, *, size: int = 32, seed: int = 0) -> Path:
    """A folder of ``images/NNNNNN.png`` plus ``data.jsonl`` captions: the raw input of :func:`preprocess_multimodal`."""
    d = Path(directory)
    (d / "images").mkdir(parents=True, exist_ok=True)
    jsonl = d / "data.jsonl"
    with open(jsonl, "w") as f:
        for i in range(n):
            px, caption = synthetic_sample(i, size, seed)
            rel = f"images/{i:06d}.png"
            (d / rel).write_bytes(encode_png(px))
            f.write(json.dumps({"image": rel, "caption": caption}) + "\n")
    return jsonl
