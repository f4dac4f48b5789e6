"""The torch side of multimodal data: a map-style dataset of pixels + chat tokens, and a resumable DataLoader.

Imports torch when used (``pip install 'mcore-data[torch]'``). Sample ``i`` of a :class:`MultimodalDataset` is a
function of ``(seed, i)`` only: epoch ``e = i // N`` of an ``N``-sample set visits the samples in the order of
``numpy.random.default_rng([seed, e]).permutation(N)``. With :func:`build_multimodal_dataloader` (the same
:class:`~mcore_data.torch.ResumableSampler` as text data) a run resumed from its consumed-samples count sees
exactly the batches it would have seen, bit for bit, whatever the number of workers.

A sample holds 0..N images, one per ``<image>`` placeholder of its conversation, in order (a one-image conversation
without a placeholder gets it first in its first user turn; a caption record is ``user: caption_prompt``,
``assistant: caption``). Decoding (PNG with mcore-data's own decoder, anything else with Pillow when it is
installed), resizing (bilinear with antialiasing; the image is stretched, not cropped) and tiling
(:func:`image_tiles` with ``MultimodalConfig.tiling``: without tiling one ``image_size x image_size`` tile per
image, else its grid of tiles and a thumbnail) run in ``__getitem__``, that is in the DataLoader's worker processes,
and the batches come back in pinned memory when a GPU is present, so the training loop does not wait on images.
Each tile is ``image_tokens`` image tokens in the prompt, preceded by its tag's text tokens when ``tiling.tags``
(:func:`mcore_data.tiling.tile_tags`); the tile count of an image depends on its size, so the images are decoded
before the conversation is tokenized.

Each item: ``pixels`` float32 ``[k, 3, S, S]`` (every tile of every image in prompt order, ``k = num_tiles``, 0 for
a sample without images; in [0, 1], or normalized with ``mean``/``std``), ``tokens``, ``labels`` (int64
``[seq_length]``, labels shifted by one), ``loss_mask`` float32 (1 on the targets trained on: assistant turns and the
final EOD by default; never an image token or a tile tag), ``position_ids``, ``image_mask`` (bool ``[seq_length]``:
True where the image tokens sit in ``tokens``, ``num_tiles * image_tokens`` of them, for splicing the image
embeddings in order), ``num_tiles`` (int64 scalar) and ``sample_index`` (the stored sample).
:func:`collate_multimodal` (the loader's ``collate_fn``) stacks every field and concatenates ``pixels`` along dim
0: ``[sum of num_tiles, 3, S, S]``, item 0's tiles first.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from mcore_data._png import decode_png
from mcore_data.chat import IMAGE_PLACEHOLDER, caption_conversation, tokenize_conversation
from mcore_data.errors import ConfigError, ImageDecodeError
from mcore_data.multimodal import MultimodalSample, ShardReader
from mcore_data.tiling import Tiling, num_tiles, tile_grid, tile_tags
from mcore_data.tokenizer import Tokenizer
from mcore_data.torch import ResumableSampler, _torch

__all__ = ["MultimodalConfig", "MultimodalDataset", "build_multimodal_dataloader", "collate_multimodal", "decode_image",
           "image_pixels", "image_tiles", "sample_order"]  # fmt: skip


@dataclass
class MultimodalConfig:
    """What each multimodal item holds."""

    image_token_id: int
    """Token id standing for the image (its embeddings are spliced in by the model); best outside the text vocab."""
    seq_length: int = 512
    """Tokens per item (longer conversations are cut, shorter ones padded with loss 0)."""
    image_size: int = 224
    """The tower's input side: every tile is ``image_size x image_size`` pixels."""
    image_tokens: int = 1
    """Copies of ``image_token_id`` per tile (1 when the model expands it; the patch count when the data does)."""
    loss_on: str = "assistant"
    """``assistant`` (answers and the final EOD) or ``all`` (every text token); image tokens never carry loss."""
    caption_prompt: str = IMAGE_PLACEHOLDER
    """The user turn that a caption record answers."""
    seed: int = 1234
    """Seed of the sample order."""
    pad_id: int | None = None
    """Padding token (default: the tokenizer's pad, else its EOD)."""
    mean: tuple[float, float, float] | None = None
    """With ``std``: ``pixels = (pixels - mean) / std`` per channel (e.g. CLIP's)."""
    std: tuple[float, float, float] | None = None
    tiling: Tiling = field(default_factory=Tiling)
    """How images are cut into tiles (:class:`~mcore_data.tiling.Tiling`; the default, ``max_tiles=1``, is one tile
    per image)."""

    def __post_init__(self) -> None:
        if self.seq_length < 2 or self.image_size < 1:
            raise ConfigError(f"seq_length must be >= 2 and image_size >= 1, got {self.seq_length}, {self.image_size}")
        if (self.mean is None) != (self.std is None):
            raise ConfigError("give both mean and std, or neither")
        if not isinstance(self.tiling, Tiling):
            raise ConfigError(f"tiling must be a mcore_data.tiling.Tiling, not {type(self.tiling).__name__}")


def _resize(t: Any, height: int, width: int) -> Any:
    """``[C, H, W]`` float pixels resized (bilinear with antialiasing, stretched) and clamped to [0, 1]."""
    torch = _torch()
    if tuple(t.shape[1:]) == (height, width):
        return t
    out = torch.nn.functional.interpolate(t[None], size=(height, width), mode="bilinear", antialias=True,
                                          align_corners=False)[0]  # fmt: skip
    return out.clamp_(0.0, 1.0)


def image_tiles(pixels: Any, size: int, tiling: Tiling | None = None) -> Any:
    """One image's tower inputs ``[k, C, size, size]`` from float pixels ``[C, H, W]`` in [0, 1]: the image resized
    to one tile without tiling, else its grid of tiles row-major plus the thumbnail (:mod:`mcore_data.tiling`)."""
    torch = _torch()
    tiling = tiling or Tiling()
    if not tiling.enabled:
        return _resize(pixels, size, size)[None]
    height, width = int(pixels.shape[1]), int(pixels.shape[2])
    cols, rows = tile_grid(width, height, tiling.max_tiles, size)
    if cols * rows == 1:
        return _resize(pixels, size, size)[None]
    big = _resize(pixels, rows * size, cols * size)
    tiles = big.view(-1, rows, size, cols, size).permute(1, 3, 0, 2, 4).reshape(rows * cols, -1, size, size)
    if tiling.thumbnail:
        tiles = torch.cat([tiles, _resize(pixels, size, size)[None]])
    return tiles.contiguous()


def image_pixels(
    image: npt.NDArray[np.uint8],
    size: int,
    tiling: Tiling | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> Any:
    """One decoded image (``uint8 [H, W, C]``) as the tower's inputs ``[k, C, size, size]`` float32: scaled to [0, 1],
    tiled (:func:`image_tiles`), then normalized per channel with ``mean`` / ``std`` when given. Training items and
    the server's image parts both go through it, so a served image is exactly what the model was trained on."""
    torch = _torch()
    t = torch.from_numpy(image if image.flags.writeable else image.copy()).permute(2, 0, 1).float().div_(255.0)
    tiles = image_tiles(t, size, tiling)
    if mean is not None and std is not None:
        tiles = (tiles - torch.tensor(mean).view(-1, 1, 1)) / torch.tensor(std).view(-1, 1, 1)
    return tiles.contiguous()


def sample_order(num_stored: int, epoch: int, seed: int) -> npt.NDArray[np.int64]:
    """The stored-sample order of one epoch."""
    return np.random.default_rng([seed, epoch]).permutation(num_stored).astype(np.int64)


def _pillow_decode(data: bytes) -> npt.NDArray[np.uint8]:
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


def decode_image(data: bytes, ext: str, where: str = "image") -> npt.NDArray[np.uint8]:
    """RGB ``uint8 [H, W, 3]``: PNG by mcore-data's decoder, otherwise (or when it cannot) by Pillow."""
    problem = ""
    if ext == "png":
        try:
            return decode_png(data)
        except Exception as e:  # ValueError, zlib.error: fall back to Pillow
            problem = f"PNG decoder: {e}; "
    try:
        return _pillow_decode(data)
    except ImportError:
        raise ImageDecodeError(
            f"{where}: cannot decode the {ext} image ({problem}Pillow is not installed: pip install 'mcore-data[images]')"
        ) from None
    except Exception as e:
        raise ImageDecodeError(f"{where}: cannot decode the {ext} image ({problem}Pillow: {e})") from None


class MultimodalDataset:
    """``num_samples`` items (default: one epoch) drawn from the shards of ``prefix`` in a seeded order."""

    def __init__(self, prefix: str | os.PathLike[str] | ShardReader, tokenizer: Tokenizer, config: MultimodalConfig,
                 num_samples: int | None = None) -> None:  # fmt: skip
        self.reader = prefix if isinstance(prefix, ShardReader) else ShardReader(prefix)
        if len(self.reader) == 0:
            raise ConfigError(f"{self.reader.manifest_path}: no samples")
        self.tokenizer = tokenizer
        self.config = config
        self.num_samples = len(self.reader) if num_samples is None else num_samples
        pad = config.pad_id if config.pad_id is not None else getattr(tokenizer, "pad", None)
        self.pad_id = int(tokenizer.eod if pad is None else pad)
        self._order: tuple[int, npt.NDArray[np.int64]] | None = None

    def __len__(self) -> int:
        return self.num_samples

    def stored_index(self, i: int) -> int:
        """The stored sample that item ``i`` reads."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"item {i} out of range ({self.num_samples} items)")
        n = len(self.reader)
        epoch = i // n
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, sample_order(n, epoch, self.config.seed))
        return int(self._order[1][i % n])

    def conversation(self, record: dict[str, Any], num_images: int = 1) -> list[dict[str, str]]:
        """The turns of a stored record; a conversation of one image and no placeholder gets the placeholder first in
        its first user turn."""
        if "caption" in record:
            return caption_conversation(record["caption"], self.config.caption_prompt)
        turns = [dict(t) for t in record["conversations"]]
        if num_images == 1 and not any(IMAGE_PLACEHOLDER in t["content"] for t in turns):
            first = next((t for t in turns if t["role"] == "user"), turns[0])
            first["content"] = f"{IMAGE_PLACEHOLDER}\n{first['content']}"
        return turns

    def _turns(self, idx: int, sample: MultimodalSample) -> list[dict[str, str]]:
        turns = self.conversation(sample.record, len(sample.images))
        placeholders = sum(t["content"].count(IMAGE_PLACEHOLDER) for t in turns)
        if placeholders != len(sample.images):
            raise ConfigError(f"{self.reader.location(idx)}: {placeholders} {IMAGE_PLACEHOLDER} placeholder(s) in the "
                              f"conversation but {len(sample.images)} image(s) in the sample")  # fmt: skip
        return turns

    def _decode(self, idx: int, sample: MultimodalSample) -> list[npt.NDArray[np.uint8]]:
        where = self.reader.location(idx)
        many = len(sample.images) > 1
        return [decode_image(data, ext, f"{where} image {j}" if many else where)
                for j, (data, ext) in enumerate(zip(sample.images, sample.image_exts))]  # fmt: skip

    def _tokens(self, idx: int, turns: list[dict[str, str]], sizes: list[tuple[int, int]]) -> dict[str, Any]:
        """The token part of an item whose images are ``(width, height)``: numpy arrays."""
        cfg = self.config
        counts = [num_tiles(w, h, cfg.tiling, cfg.image_size) for w, h in sizes]
        conv = tokenize_conversation(self.tokenizer, turns, image_token_id=cfg.image_token_id,
                                     image_tokens=cfg.image_tokens, loss_on=cfg.loss_on,
                                     tiles=[tile_tags(n, cfg.tiling) for n in counts])  # fmt: skip
        n = cfg.seq_length
        if len(conv.image_positions) and conv.image_positions[-1] >= n:
            raise ConfigError(
                f"{self.reader.location(idx)}: the images need {len(conv.image_positions)} image tokens "
                f"({sum(counts)} tile(s) x {cfg.image_tokens}) and end at token {int(conv.image_positions[-1]) + 1}, "
                f"past seq_length {n}: set a larger data.seq_length, fewer max_tiles, or the pixel shuffle (a quarter "
                "of the image tokens)"
            )
        ids = np.full(n + 1, self.pad_id, np.int64)
        mask = np.zeros(n + 1, np.float32)
        k = min(len(conv.tokens), n + 1)
        ids[:k], mask[:k] = conv.tokens[:k], conv.loss_mask[:k]
        image_mask = np.zeros(n, np.bool_)
        image_mask[conv.image_positions] = True
        return {"tokens": ids[:-1].copy(), "labels": ids[1:].copy(), "loss_mask": mask[1:].copy(),
                "image_mask": image_mask, "num_tiles": np.asarray(sum(counts), np.int64)}  # fmt: skip

    def text(self, i: int) -> dict[str, npt.NDArray[Any]]:
        """The token part of item ``i`` (numpy): tokens, labels, loss_mask, image_mask, num_tiles (the images are
        decoded only when tiling, for their sizes)."""
        idx = self.stored_index(i)
        s = self.reader[idx]
        turns = self._turns(idx, s)
        if self.config.tiling.enabled:
            sizes = [(px.shape[1], px.shape[0]) for px in self._decode(idx, s)]
        else:
            sizes = [(1, 1)] * len(s.images)  # one tile each, whatever the size
        return self._tokens(idx, turns, sizes)

    def _pixels(self, decoded: list[npt.NDArray[np.uint8]]) -> Any:
        cfg = self.config
        if not decoded:
            return _torch().zeros(0, 3, cfg.image_size, cfg.image_size)
        return _torch().cat([image_pixels(px, cfg.image_size, cfg.tiling, cfg.mean, cfg.std) for px in decoded])

    def pixels(self, i: int) -> Any:
        """The tiles of item ``i``'s images, decoded, resized (and normalized): float32 ``[num_tiles, 3, S, S]``."""
        idx = self.stored_index(i)
        return self._pixels(self._decode(idx, self.reader[idx]))

    def __getitem__(self, i: int) -> dict[str, Any]:
        torch = _torch()
        idx = self.stored_index(int(i))
        s = self.reader[idx]
        turns = self._turns(idx, s)
        decoded = self._decode(idx, s)
        text = self._tokens(idx, turns, [(px.shape[1], px.shape[0]) for px in decoded])
        item: dict[str, Any] = {k: torch.from_numpy(v) for k, v in text.items()}
        item["pixels"] = self._pixels(decoded)
        assert item["pixels"].shape[0] == int(item["num_tiles"]), "tiles cut and tiles counted disagree"
        item["position_ids"] = torch.arange(self.config.seq_length, dtype=torch.int64)
        item["sample_index"] = torch.tensor(idx, dtype=torch.int64)
        return item


def collate_multimodal(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch of items: every field stacked (``[b, ...]``), but ``pixels`` concatenated along dim 0 (``[sum of
    num_tiles, 3, S, S]``, item 0's tiles first, then item 1's, ...: the order of the image tokens in the batch,
    row-major). In a DataLoader worker the batch is built in shared memory, as ``default_collate`` does."""
    torch = _torch()
    if not items:
        raise ValueError("collate_multimodal needs at least one item")
    keys = list(items[0])
    for j, it in enumerate(items[1:], 1):
        if list(it) != keys:
            raise ValueError(f"item {j} has fields {sorted(it)}, item 0 {sorted(keys)}")
    out = {k: torch.utils.data.default_collate([it[k] for it in items]) for k in keys if k != "pixels"}
    if "pixels" in items[0]:
        px = [it["pixels"] for it in items]
        shape = (sum(int(p.shape[0]) for p in px), *px[0].shape[1:])
        buf = torch.empty(shape, dtype=px[0].dtype)
        if torch.utils.data.get_worker_info() is not None and buf.numel():
            buf.share_memory_()  # sent to the main process without another copy
        out["pixels"] = torch.cat(px, out=buf)
    return {k: out[k] for k in keys}


def build_multimodal_dataloader(
    dataset: MultimodalDataset,
    micro_batch_size: int,
    *,
    consumed_samples: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
    num_workers: int = 2,
    pin_memory: bool = True,
    prefetch_factor: int | None = None,
) -> Any:
    """A ``DataLoader`` of this rank's batches after ``consumed_samples`` (collated by :func:`collate_multimodal`);
    images decoded in ``num_workers`` processes, batches in pinned memory when CUDA is available (``pin_memory``)."""
    torch = _torch()
    sampler = ResumableSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    extra = {"prefetch_factor": prefetch_factor} if num_workers > 0 and prefetch_factor else {}
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate_multimodal,
        pin_memory=pin_memory and torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        **extra,
    )
