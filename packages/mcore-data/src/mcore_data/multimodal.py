"""Image-text samples on disk: webdataset-style tar shards plus a JSON manifest for random access.

Layout for an output ``PREFIX``::

    PREFIX-000000.tar   KEY.png + KEY.json (one image), KEY.0.png + KEY.1.jpg + ... + KEY.json (several),
                        KEY.json alone (none); then the next sample, ...
    PREFIX-000001.tar   ...
    PREFIX.json         the manifest

A sample holds 0..N images, stored as given (PNG or JPEG bytes), in prompt order. Member names follow the
webdataset convention, the key before the first dot: one image is ``KEY.png`` (or ``KEY.jpg``), several are
``KEY.0.png``, ``KEY.1.jpg``, ... Every shard is a plain POSIX tar (``tar tf PREFIX-000000.tar`` lists it; a
webdataset reader streams it: the members of a sample are adjacent and share their key). ``KEY.json`` is
``{"conversations": [{"role": "user"|"assistant", "content": "... <image> ..."}, ...]}`` or ``{"caption": "..."}``
(plus ``"source"``, the input image path or the list of paths, when the sample came from files). Members are
written with mtime 0, uid/gid 0 and mode 0644, so the shards are byte-for-byte reproducible.

The manifest (``PREFIX.json``, version 2) holds the shard names, the sample count and byte size of each, and for
every sample ``[key, [[ext, offset, size], ...], json_offset, json_size]`` (``sample_fields``): the extension,
byte offset and size of each image member's data inside the shard, then the JSON member's, so that a reader reads
sample ``i`` with one ``seek`` + ``read`` per member instead of scanning the tar: sampling is random access, and the
order a dataset draws is a function of its seed only. :class:`ShardReader` also reads version 1 manifests (one image
per sample: ``[key, ext, image_offset, image_size, json_offset, json_size]``). numpy only, no torch and no
webdataset.
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
VERSION = 2
READABLE_VERSIONS = (1, 2)
_V1_FIELDS = ["key", "image_ext", "image_offset", "image_size", "json_offset", "json_size"]
_V2_FIELDS = ["key", "images", "json_offset", "json_size"]
IMAGE_EXTENSIONS = ("png", "jpg")


def manifest_path(prefix: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(prefix)}.json")


def shard_name(prefix: str | os.PathLike[str], i: int) -> str:
    return f"{Path(prefix).name}-{i:06d}.tar"


@dataclass
class MultimodalSample:
    """One sample as stored: its key, its images' bytes and extensions (``png``/``jpg``) in prompt order, and the
    JSON record."""

    key: str
    images: list[bytes]
    image_exts: list[str]
    record: dict[str, Any]

    @property
    def image(self) -> bytes:
        """The first image's bytes (for one-image callers)."""
        self._need_image()
        return self.images[0]

    @property
    def image_ext(self) -> str:
        """The first image's extension."""
        self._need_image()
        return self.image_exts[0]

    def _need_image(self) -> None:
        if not self.images:
            raise ValueError(f"sample {self.key} holds no image (.images lists the 0..N images of a sample)")


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
        """Append one sample of one image; returns its key (default: the sample's global index, 9 digits)."""
        return self.add_images([(image, image_ext)], record, key)

    def add_images(self, images: list[tuple[bytes, str]], record: dict[str, Any], key: str | None = None) -> str:
        """Append one sample of 0..N ``(bytes, ext)`` images in prompt order; returns its key (see :meth:`add`)."""
        for _, ext in images:
            if ext not in IMAGE_EXTENSIONS:
                raise ValueError(f"image extension must be one of {IMAGE_EXTENSIONS}, not {ext!r}")
        key = key if key is not None else f"{self._count:09d}"
        if not key or "." in key or "/" in key:
            raise ValueError(f"a sample key must be non-empty without '.' or '/' (webdataset's key), not {key!r}")
        if self._tar is None or len(self.shards[-1]["samples"]) >= self.shard_size:
            self._next_shard()
        meta = json.dumps(record, ensure_ascii=False, sort_keys=True).encode("utf-8")
        members = []
        for j, (data, ext) in enumerate(images):
            name = f"{key}.{ext}" if len(images) == 1 else f"{key}.{j}.{ext}"
            members.append([ext, *self._member(name, data)])
        js_off, js_size = self._member(f"{key}.json", meta)
        self.shards[-1]["samples"].append([key, members, js_off, js_size])
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
                    "sample_fields": _V2_FIELDS,
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


def _from_v1(e: list[Any], path: Path) -> list[Any]:
    """A version 1 sample entry (one image) in the version 2 form."""
    if not isinstance(e, list) or len(e) != len(_V1_FIELDS):
        raise IndexFormatError(path, f"a version 1 sample entry must be {_V1_FIELDS}, got {e!r}")
    key, ext, img_off, img_size, js_off, js_size = e
    return [key, [[ext, img_off, img_size]], js_off, js_size]


def _checked_v2(e: list[Any], path: Path) -> list[Any]:
    if not isinstance(e, list) or len(e) != len(_V2_FIELDS) or not isinstance(e[1], list):
        raise IndexFormatError(path, f"a sample entry must be {_V2_FIELDS} (images: [[ext, offset, size], ...]), "
                                     f"got {e!r}")  # fmt: skip
    if any(not isinstance(m, list) or len(m) != 3 for m in e[1]):
        raise IndexFormatError(path, f"sample {e[0]}: every image must be [ext, offset, size], got {e[1]!r}")
    return e


class ShardReader:
    """Random access to the samples of a prefix written by :class:`ShardWriter` (``len``, ``reader[i]``); reads
    manifests of version 1 (one image per sample) and 2.

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
        if not isinstance(m, dict) or m.get("format") != FORMAT or m.get("version") not in READABLE_VERSIONS:
            version = m.get("version") if isinstance(m, dict) else None
            raise IndexFormatError(path, f"not a {FORMAT} manifest of version 1 or 2 (version {version!r})")
        self.manifest_path = path
        self.version: int = m["version"]
        self.shard_names: list[str] = [s["name"] for s in m["shards"]]
        self.shard_counts: list[int] = [int(s["num_samples"]) for s in m["shards"]]
        upgrade = _from_v1 if self.version == 1 else _checked_v2
        self._entries: list[tuple[int, list[Any]]] = [
            (i, upgrade(e, path)) for i, s in enumerate(m["shards"]) for e in s["samples"]
        ]
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
        shard, (key, members, js_off, js_size) = self._entries[i]
        images = [self._read(shard, off, size) for _, off, size in members]
        try:
            record = json.loads(self._read(shard, js_off, js_size))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise IndexFormatError(self.location(i), f"bad JSON member ({e})") from None
        return MultimodalSample(key, images, [ext for ext, _, _ in members], record)

    def num_images(self, i: int) -> int:
        """How many images sample ``i`` holds (from the manifest, nothing read)."""
        return len(self._entries[i][1][1])

    def __iter__(self) -> Iterator[MultimodalSample]:
        for i in range(len(self)):
            yield self[i]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}
