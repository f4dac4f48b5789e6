"""Image-text samples on disk: webdataset-style tar shards plus a JSON manifest for random access.

Layout for an output ``PREFIX``::

    PREFIX-000000.tar   KEY.png (or KEY.jpg: the image bytes as given) + KEY.json, then the next sample, ...
    PREFIX-000001.tar   ...
    PREFIX.json         the manifest

Every shard is a plain POSIX tar (``tar tf PREFIX-000000.tar`` lists it; a webdataset reader streams it: the members
of a sample are adjacent and share their key). ``KEY.json`` is ``{"conversations": [{"role": "user"|"assistant",
"content": "... <image> ..."}, ...]}`` or ``{"caption": "..."}`` (plus ``"source"``, the input image path, when the
sample came from a file). Members are written with mtime 0, uid/gid 0 and mode 0644, so the shards are byte-for-byte
reproducible.

The manifest (``PREFIX.json``) holds the shard names, the sample count of each, and for every sample its key, the
image member's extension and the byte offsets and sizes of both members' data inside the shard, so that a reader
reads sample ``i`` with two ``seek`` + ``read`` calls instead of scanning the tar: sampling is random access, and
the order a dataset draws is a function of its seed only. numpy only, no torch and no webdataset.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from mcore_data._files import check_outputs, temporary_path
from mcore_data.errors import IndexFormatError

__all__ = ["FORMAT", "IMAGE_EXTENSIONS", "MultimodalSample", "ShardReader", "ShardWriter", "manifest_path"]

FORMAT = "mcore-multimodal-tar"
VERSION = 1
IMAGE_EXTENSIONS = ("png", "jpg")


def manifest_path(prefix: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(prefix)}.json")


def shard_name(prefix: str | os.PathLike[str], i: int) -> str:
    return f"{Path(prefix).name}-{i:06d}.tar"


@dataclass
class MultimodalSample:
    """One sample as stored: its key, the image bytes and their extension (``png``/``jpg``), and the JSON record."""

    key: str
    image: bytes
    image_ext: str
    record: dict[str, Any]


def existing_outputs(prefix: str | os.PathLike[str]) -> list[Path]:
    """The manifest and every ``PREFIX-NNNNNN.tar`` shard already on disk."""
    p = Path(prefix)
    shards = sorted(p.parent.glob(f"{p.name}-[0-9][0-9][0-9][0-9][0-9][0-9].tar")) if p.parent.is_dir() else []
    m = manifest_path(prefix)
    return ([m] if m.exists() else []) + shards


class ShardWriter:
    """Writes samples into shards of ``shard_size`` samples each; ``close()`` writes the manifest.

    Refuses to write over an existing manifest or shard of the same prefix unless ``overwrite`` (then the old shards
    are deleted first, so no stale shard is left behind). The manifest is written last and renamed into place: a
    prefix with a manifest is complete.
    """

    def __init__(self, prefix: str | os.PathLike[str], shard_size: int = 1000, *, overwrite: bool = False) -> None:
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        old = existing_outputs(prefix)
        check_outputs(old, overwrite)
        for f in old:
            f.unlink()
        self.prefix = Path(prefix)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self.shard_size = shard_size
        self.shards: list[dict[str, Any]] = []
        self._tar: tarfile.TarFile | None = None
        self._count = 0

    def _member(self, name: str, data: bytes) -> tuple[int, int]:
        assert self._tar is not None
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
        info.uname = info.gname = ""
        self._tar.addfile(info, io.BytesIO(data))
        end = self._tar.offset  # the data ends padded to 512 bytes right before the tar's current offset
        return end - ((len(data) + 511) // 512) * 512, len(data)

    def add(self, image: bytes, image_ext: str, record: dict[str, Any], key: str | None = None) -> str:
        """Append one sample; returns its key (default: the sample's global index, 9 digits)."""
        if image_ext not in IMAGE_EXTENSIONS:
            raise ValueError(f"image extension must be one of {IMAGE_EXTENSIONS}, not {image_ext!r}")
        if self._tar is None or len(self.shards[-1]["samples"]) >= self.shard_size:
            self._next_shard()
        key = key if key is not None else f"{self._count:09d}"
        meta = json.dumps(record, ensure_ascii=False, sort_keys=True).encode("utf-8")
        img_off, img_size = self._member(f"{key}.{image_ext}", image)
        js_off, js_size = self._member(f"{key}.json", meta)
        self.shards[-1]["samples"].append([key, image_ext, img_off, img_size, js_off, js_size])
        self._count += 1
        return key

    def _next_shard(self) -> None:
        if self._tar is not None:
            self._tar.close()
        name = shard_name(self.prefix, len(self.shards))
        self._tar = tarfile.open(self.prefix.parent / name, "w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115
        self.shards.append({"name": name, "samples": []})

    def close(self) -> Path:
        """Finish the last shard and write the manifest; returns its path."""
        if self._tar is not None:
            self._tar.close()
            self._tar = None
        shards = [
            {"name": s["name"], "num_samples": len(s["samples"]),
             "bytes": os.path.getsize(self.prefix.parent / s["name"]), "samples": s["samples"]}
            for s in self.shards
        ]  # fmt: skip
        manifest = {"format": FORMAT, "version": VERSION, "num_samples": self._count,
                    "sample_fields": ["key", "image_ext", "image_offset", "image_size", "json_offset", "json_size"],
                    "shards": shards}  # fmt: skip
        path = manifest_path(self.prefix)
        tmp = temporary_path(path)
        tmp.write_text(json.dumps(manifest, separators=(",", ":")) + "\n")
        os.replace(tmp, path)
        return path

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        elif self._tar is not None:
            self._tar.close()


class ShardReader:
    """Random access to the samples of a prefix written by :class:`ShardWriter` (``len``, ``reader[i]``).

    Shard files are opened lazily and once per process (a DataLoader worker forked after use reopens its own), so a
    reader can be shared with worker processes.
    """

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = Path(prefix)
        path = manifest_path(prefix)
        try:
            m = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{path}: multimodal manifest not found (write it with mcore-data multimodal)"
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise IndexFormatError(path, f"not a JSON manifest ({e})") from None
        if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") != VERSION:
            raise IndexFormatError(path, f"not a {FORMAT} manifest of version {VERSION}")
        self.manifest_path = path
        self.shard_names: list[str] = [s["name"] for s in m["shards"]]
        self.shard_counts: list[int] = [int(s["num_samples"]) for s in m["shards"]]
        self._entries: list[tuple[int, list[Any]]] = [(i, e) for i, s in enumerate(m["shards"]) for e in s["samples"]]
        if len(self._entries) != m["num_samples"] or sum(self.shard_counts) != m["num_samples"]:
            raise IndexFormatError(path, "sample counts disagree with the listed samples")
        for s in m["shards"]:
            f = self.prefix.parent / s["name"]
            if not f.exists():
                raise IndexFormatError(path, f"shard {f} is missing")
            if os.path.getsize(f) != s["bytes"]:
                raise IndexFormatError(
                    path, f"shard {f} holds {os.path.getsize(f)} bytes, the manifest says {s['bytes']}"
                )
        self._files: dict[int, BinaryIO] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self._entries)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_files"] = {}
        return state

    def _file(self, shard: int) -> BinaryIO:
        if self._pid != os.getpid():
            self._files, self._pid = {}, os.getpid()
        f = self._files.get(shard)
        if f is None:
            f = self._files[shard] = open(self.prefix.parent / self.shard_names[shard], "rb")  # noqa: SIM115
        return f

    def _read(self, shard: int, offset: int, size: int) -> bytes:
        f = self._file(shard)
        f.seek(offset)
        data = f.read(size)
        if len(data) != size:
            raise IndexFormatError(self.prefix.parent / self.shard_names[shard], f"short read at byte {offset}")
        return data

    def location(self, i: int) -> str:
        """``shard.tar:KEY``, for error messages."""
        shard, e = self._entries[i]
        return f"{self.prefix.parent / self.shard_names[shard]}:{e[0]}"

    def __getitem__(self, i: int) -> MultimodalSample:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range ({len(self)} samples)")
        shard, (key, ext, img_off, img_size, js_off, js_size) = self._entries[i]
        image = self._read(shard, img_off, img_size)
        try:
            record = json.loads(self._read(shard, js_off, js_size))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise IndexFormatError(self.location(i), f"bad JSON member ({e})") from None
        return MultimodalSample(key, image, ext, record)

    def __iter__(self) -> Iterator[MultimodalSample]:
        for i in range(len(self)):
            yield self[i]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}
