"""A minimal PNG encoder and decoder (zlib + struct, no Pillow) for 8-bit images.

The encoder writes 8-bit RGB (or grayscale) non-interlaced PNGs with filter 0 on every row: what the synthetic
multimodal generator needs. The decoder reads 8-bit grayscale, gray+alpha, RGB, RGBA and palette PNGs without
interlacing (every row filter of the PNG specification), which covers the synthetic images and most PNGs written by
common tools; anything else raises :class:`ValueError` so that the caller can fall back to Pillow.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["PNG_SIGNATURE", "decode_png", "encode_png"]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(pixels: npt.NDArray[np.uint8]) -> bytes:
    """PNG bytes of a ``uint8`` array ``[H, W, 3]`` (RGB) or ``[H, W]`` (grayscale)."""
    a = np.ascontiguousarray(pixels, dtype=np.uint8)
    if a.ndim == 2:
        colour = 0
    elif a.ndim == 3 and a.shape[2] == 3:
        colour = 2
    else:
        raise ValueError(f"encode_png takes [H, W] or [H, W, 3] uint8 pixels, not shape {a.shape}")
    h, w = a.shape[:2]
    rows = a.reshape(h, -1)
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rows], axis=1).tobytes()  # filter byte 0 per row
    header = struct.pack(">IIBBBBB", w, h, 8, colour, 0, 0, 0)
    return PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 6)) + _chunk(b"IEND", b"")


def _chunks(data: bytes) -> dict[str, Any]:
    if not data.startswith(PNG_SIGNATURE):
        raise ValueError("not a PNG (bad signature)")
    pos, idat = 8, []
    out: dict[str, Any] = {}
    while pos + 8 <= len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if len(body) != length:
            raise ValueError("truncated PNG chunk")
        pos += 12 + length
        if kind == b"IHDR":
            out["ihdr"] = struct.unpack(">IIBBBBB", body)
        elif kind == b"PLTE":
            out["plte"] = np.frombuffer(body, np.uint8).reshape(-1, 3)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    if "ihdr" not in out or not idat:
        raise ValueError("PNG without IHDR or IDAT")
    out["idat"] = b"".join(idat)
    return out


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    if pa <= pb and pa <= pc:
        return a
    return b if pb <= pc else c


def _unfilter_row(ftype: int, row: npt.NDArray[np.int32], prev: npt.NDArray[np.int32], bpp: int) -> None:
    if ftype == 0:
        return
    if ftype == 2:
        row += prev
        row &= 0xFF
        return
    for i in range(len(row)):  # Sub, Average and Paeth depend on the pixel to the left: one sample at a time
        left = int(row[i - bpp]) if i >= bpp else 0
        if ftype == 1:
            row[i] = (row[i] + left) & 0xFF
        elif ftype == 3:
            row[i] = (row[i] + ((left + int(prev[i])) >> 1)) & 0xFF
        elif ftype == 4:
            up_left = int(prev[i - bpp]) if i >= bpp else 0
            row[i] = (row[i] + _paeth(left, int(prev[i]), up_left)) & 0xFF
        else:
            raise ValueError(f"bad PNG filter type {ftype}")


def decode_png(data: bytes) -> npt.NDArray[np.uint8]:
    """``uint8`` pixels ``[H, W, 3]`` (RGB; gray is repeated, alpha dropped, a palette looked up)."""
    c = _chunks(data)
    w, h, depth, colour, _, _, interlace = c["ihdr"]
    if depth != 8 or colour not in _CHANNELS or interlace != 0:
        raise ValueError(f"unsupported PNG (bit depth {depth}, colour type {colour}, interlace {interlace})")
    bpp = _CHANNELS[colour]
    stride = w * bpp
    raw = np.frombuffer(zlib.decompress(c["idat"]), np.uint8)
    if raw.size != h * (stride + 1):
        raise ValueError(f"PNG data holds {raw.size} bytes, expected {h * (stride + 1)}")
    rows = raw.reshape(h, stride + 1)
    out = np.empty((h, stride), np.int32)
    prev = np.zeros(stride, np.int32)
    for y in range(h):
        row = rows[y, 1:].astype(np.int32)
        _unfilter_row(int(rows[y, 0]), row, prev, bpp)
        out[y] = row
        prev = row
    px = out.astype(np.uint8).reshape(h, w, bpp)
    if colour == 3:
        if "plte" not in c:
            raise ValueError("palette PNG without PLTE")
        return np.ascontiguousarray(c["plte"][px[..., 0]])
    if colour in (0, 4):
        return np.ascontiguousarray(np.repeat(px[..., :1], 3, axis=2))
    return np.ascontiguousarray(px[..., :3])
