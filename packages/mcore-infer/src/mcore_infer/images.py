"""Images of vision-language (LLaVA-style) requests in the engine.

A request to a :class:`~mcore_models.multimodal.LlavaModel` may carry images: pixels ``[n, C, S, S]`` already
resized to the tower's ``image_size`` and normalised (:mod:`mcore_infer.server.images` does that for the server);
its prompt holds ``image_tokens`` copies of ``image_token_id`` per image, in order. With tiling
(:attr:`VisionInfo.tiling`, as the model was trained: :mod:`mcore_data.tiling`) each image is several tower inputs,
its tiles: the ``n`` pixels are then every tile of every image in order, and the engine checks tiles
(``image_tokens`` per tile, at most ``max_images * tiling.most_tiles`` per request) without knowing which image a
tile came from. The engine keeps them with the request (:class:`RequestImages`):

- the first prefill step whose chunk reaches an image token encodes the request's images once
  (``LlavaModel.image_embeddings``) and keeps the embeddings ``[n * image_tokens, hidden]``;
- each prefill step takes the rows of its chunk's image positions (a chunk boundary may cut an image: the next
  chunk takes the remaining rows) and the runner splices them into the word embeddings of the step
  (:class:`ImageSplice`), the first layer's input (``GPTModel``'s ``decoder_input``);
- once the prompt is prefilled the embeddings are dropped (the image tokens' keys and values are in the KV cache like
  any prompt token's; decode steps never see the image again); the pixels stay with the request until it finishes or
  is aborted, so a preempted request, recomputed from its prompt, encodes them again.

At tp > 1 every TP rank runs the tower on the same pixels and splices the same rows: the first rank sends the
followers the pixels and each step's image rows (:mod:`mcore_infer.tp_images`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mcore_data.tiling import Tiling
from mcore_infer.errors import InvalidRequestError

if TYPE_CHECKING:
    from mcore_infer.runner import ModelRunner
    from mcore_infer.scheduler import Scheduled

__all__ = ["ImagePrompt", "ImageSplice", "RequestImages", "VisionInfo", "check_images", "image_splice", "vision_info"]


@dataclass(frozen=True)
class VisionInfo:
    """What a front end needs to know of a VLM engine to prepare images (plain values: it crosses processes)."""

    image_token_id: int
    image_tokens: int
    """Prompt tokens one tower input (an image, or with tiling one tile of it) becomes."""
    image_size: int
    """Side of the square pixels the tower takes."""
    num_channels: int
    max_images: int
    """Most images per request (``EngineConfig.max_images``)."""
    mean: tuple[float, ...] | None = None
    """With ``std``: pixels in [0, 1] are normalised as ``(pixels - mean) / std`` per channel; None: left in [0, 1]."""
    std: tuple[float, ...] | None = None
    tiling: Tiling = field(default_factory=Tiling)
    """How each image is cut into tiles (``EngineConfig.tiling()``); the default: no tiling, one tile per image."""

    @property
    def max_request_tiles(self) -> int:
        """Most tower inputs per request: ``max_images`` images of at most ``tiling.most_tiles`` tiles each."""
        return self.max_images * self.tiling.most_tiles


def vision_info(model: Any, max_images: int, mean: Any = None, std: Any = None, tiling: Tiling | None = None
                ) -> VisionInfo:  # fmt: skip
    """The :class:`VisionInfo` of a ``LlavaModel``."""
    cfg = model.config
    v = cfg.vision
    return VisionInfo(cfg.image_token_id, cfg.image_tokens, v.image_size, v.num_channels, max_images,
                      None if mean is None else tuple(mean), None if std is None else tuple(std),
                      tiling or Tiling())  # fmt: skip


@dataclass(eq=False)
class RequestImages:
    """One request's images while it runs."""

    pixels: torch.Tensor
    """``[n, C, S, S]``, as given (with tiling: every tile of every image)."""
    positions: list[int]
    """The prompt positions of the image tokens (sorted; ``n * image_tokens`` of them)."""
    embeds: torch.Tensor | None = None
    """``[n * image_tokens, hidden]`` once encoded, until the prompt is prefilled."""
    num_encodes: int = 0
    key: int | None = None
    """At tp > 1, while ``embeds`` is set: the key the follower ranks keep their copy under
    (:mod:`mcore_infer.tp_images`); ``forget`` tells them to drop it."""
    forget: Callable[[int], None] | None = field(default=None, repr=False)
    last_position: int = field(init=False)

    def __post_init__(self) -> None:
        self.last_position = self.positions[-1] if self.positions else -1

    def drop_embeds(self) -> None:
        """Drop the embeddings (and, at tp > 1, the followers' copy)."""
        self.embeds = None
        if self.key is not None:
            assert self.forget is not None
            self.forget(self.key)
            self.key = None


def check_images(
    vision: VisionInfo | None, prompt_ids: list[int], images: Any, param: str = "images"
) -> RequestImages | None:
    """Validate a request's images against its prompt; None for a request without images (and none expected).
    With tiling, ``images`` are the tiles of all the request's images: at most ``vision.max_request_tiles`` of them."""
    n = 0 if images is None else (len(images) if isinstance(images, list | tuple) else int(images.shape[0]))
    if vision is None:
        if n:
            raise InvalidRequestError("this model is text-only: it does not take images", param=param)
        return None
    positions = [i for i, t in enumerate(prompt_ids) if t == vision.image_token_id]
    tiled, bound = vision.tiling.enabled, vision.max_request_tiles
    what = "image tile(s)" if tiled else "image(s)"
    if n > bound:
        msg = f"the request has {n} images; this server takes at most {bound} per request"
        if tiled:
            msg = (f"the request has {n} image tiles; this server takes at most {bound} per request "
                   f"({vision.max_images} images of at most {vision.tiling.most_tiles} tiles each)")  # fmt: skip
        raise InvalidRequestError(msg, param=param, code="too_many_images")
    if len(positions) != n * vision.image_tokens:
        raise InvalidRequestError(f"the prompt holds {len(positions)} image tokens (id {vision.image_token_id}) but "
                                  f"{n} {what} x {vision.image_tokens} image_tokens = {n * vision.image_tokens} were "
                                  "expected", param=param)  # fmt: skip
    if not n:
        return None
    pixels = torch.stack(list(images)) if isinstance(images, list | tuple) else images
    want = (n, vision.num_channels, vision.image_size, vision.image_size)
    if tuple(pixels.shape) != want or not pixels.is_floating_point():
        raise InvalidRequestError(f"images must be float pixels of shape {list(want)}, got {pixels.dtype} "
                                  f"{list(pixels.shape)}", param=param)  # fmt: skip
    return RequestImages(pixels, positions)


@dataclass
class ImageSplice:
    """A step's image rows: the first layer's input at the flat token indices ``index`` is ``embeds``."""

    index: torch.Tensor
    """``[k]`` int64 flat token indices of the step (on the device)."""
    embeds: torch.Tensor
    """``[k, hidden]``."""
    rows: tuple[list[int], list[tuple[int, int, int]]] | None = None
    """At tp > 1, for the follower ranks: the flat indices on the host and the ``(key, lo, hi)`` row ranges of
    ``embeds`` (:mod:`mcore_infer.tp_images`)."""


def image_splice(plan: list[Scheduled], runner: ModelRunner) -> ImageSplice | None:
    """The image rows of a step ``plan`` (in the scheduler's batch order), encoding the images of requests whose
    chunk reaches an image token and that hold no embeddings yet; None when the step has no image token."""
    index: list[int] = []
    parts: list[torch.Tensor] = []
    driver = runner.driver_images  # tp > 1: the followers get the pixels and the rows' keys (None at tp=1)
    rows: list[tuple[int, int, int]] = []
    t0 = 0
    for item in plan:
        seq, n = item.seq, item.num_tokens
        imgs: RequestImages | None = seq.images
        start = seq.num_computed
        if imgs is not None and start <= imgs.last_position:
            lo = bisect.bisect_left(imgs.positions, start)
            hi = bisect.bisect_left(imgs.positions, start + n)
            if hi > lo:
                if imgs.embeds is None:
                    imgs.embeds = runner.encode_images(imgs.pixels) if driver is None else driver.encode(imgs)
                    imgs.num_encodes += 1
                index.extend(t0 + p - start for p in imgs.positions[lo:hi])
                parts.append(imgs.embeds[lo:hi])
                if driver is not None:
                    assert imgs.key is not None
                    rows.append((imgs.key, lo, hi))
        t0 += n
    if not index:
        return None
    ids = torch.tensor(index, dtype=torch.long, device=runner.device)
    splice = ImageSplice(ids, torch.cat(parts) if len(parts) > 1 else parts[0])
    if driver is not None:
        splice.rows = (index, rows)
    return splice


def prefilled(seq: Any) -> None:
    """After a step: drop the embeddings of a request whose image tokens are all computed now."""
    imgs: RequestImages | None = seq.images
    if imgs is not None and imgs.embeds is not None and seq.num_computed > imgs.last_position:
        imgs.drop_embeds()


class ImagePrompt(list[int]):
    """Prompt token ids that carry their request's images (pixels ``[n, C, S, S]``): what the server's chat route
    hands the engine loop (``AsyncEngine.generate`` / the engine process's client pass ``images`` on)."""

    images: torch.Tensor | None = None

    @classmethod
    def of(cls, ids: list[int], images: torch.Tensor | None) -> ImagePrompt:
        p = cls(ids)
        p.images = images
        return p
