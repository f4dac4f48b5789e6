"""Images of vision-language requests under tensor parallelism: how they reach the follower ranks.

At ``tp`` > 1 a ``LlavaModel``'s vision tower is split over the TP ranks like the language model (heads, MLP; it
returns the whole output on every rank) and its projector is replicated: the tower is a collective, so every rank
runs ``image_embeddings`` on the same pixels at the same time, and then every rank holds the same embeddings. The
first rank runs the scheduler and :mod:`mcore_infer.images` as at tp=1; its runner mirrors the embeddings on the
followers with the messages it broadcasts to them anyway (``broadcast_object_list`` over the TP group):

- encoding a request's images, it first sends :class:`EncodeImages` (a key, unique per encoding, and the pixels on
  the host in the model's dtype), then runs the tower; each follower runs the tower on those pixels and keeps the
  embeddings under the key (:class:`FollowerImages`);
- a step with image rows is sent as an :class:`ImageStep`: the :class:`~mcore_infer.runner.StepBatch`, the flat
  token indices of its image rows and, in order, the ``(key, lo, hi)`` row ranges they take from each encoding, so
  each follower rebuilds the same :class:`~mcore_infer.images.ImageSplice` and splices exactly as the first rank;
- when the first rank drops a request's embeddings (its prompt prefilled; the request finished, aborted, failed or
  removed before that) its key goes to :class:`DriverImages`'s drop list, which the next message carries (a step,
  an encoding, or at once when the engine idles: :meth:`ModelRunner.keep_alive`, and before ``stop_followers``);
  the followers drop theirs, so they hold exactly the embeddings the first rank holds.

A text-only step with no drop pending is still sent as the bare ``StepBatch``; at tp=1 none of this exists.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from mcore_infer.images import ImageSplice, RequestImages

if TYPE_CHECKING:
    from mcore_infer.runner import ModelRunner, StepBatch

__all__ = ["DriverImages", "DropImages", "EncodeImages", "FollowerImages", "ImageStep"]


@dataclass
class DropImages:
    """First rank → followers: forget the embeddings of these keys."""

    drops: list[int] = field(default_factory=list)


@dataclass
class EncodeImages(DropImages):
    """First rank → followers: (after the drops) run the tower on ``pixels`` with it, keep the result as ``key``."""

    key: int = -1
    pixels: torch.Tensor | None = None
    """``[n, C, S, S]`` on the host, in the model's dtype (the first rank encodes the same values)."""


@dataclass
class ImageStep(DropImages):
    """First rank → followers: (after the drops) run ``batch`` with its image rows: the embeddings of ``rows``
    (``(key, lo, hi)``: rows ``lo:hi`` of that encoding, concatenated in order) at the flat token indices ``index``."""

    batch: StepBatch | None = None
    index: list[int] = field(default_factory=list)
    rows: list[tuple[int, int, int]] = field(default_factory=list)


class DriverImages:
    """The first TP rank's side: keys of the embeddings the followers hold, and the drops not sent yet."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._keys = itertools.count()
        self.live: set[int] = set()
        """Keys the followers hold (or are told to keep by the next message)."""
        self.drops: list[int] = []

    def encode(self, imgs: RequestImages) -> torch.Tensor:
        """Send the followers the pixels under a new key, then run the tower with them (``runner.encode_images``)."""
        runner = self.runner
        key = next(self._keys)
        pixels = imgs.pixels.detach().to("cpu", runner.dtype)
        runner._send_followers(EncodeImages(self.take_drops(), key, pixels))
        self.live.add(key)
        imgs.key, imgs.forget = key, self.forget
        return runner.encode_images(pixels)

    def forget(self, key: int) -> None:
        """The first rank dropped the embeddings of ``key``: the followers drop theirs with the next message."""
        if key in self.live:
            self.live.discard(key)
            self.drops.append(key)

    def take_drops(self) -> list[int]:
        drops, self.drops = self.drops, []
        return drops

    def message(self, batch: StepBatch, images: ImageSplice | None) -> Any:
        """What the followers are sent for a step: the bare batch, or an :class:`ImageStep` with its image rows
        and the pending drops."""
        if images is None and not self.drops:
            return batch
        if images is None:
            return ImageStep(self.take_drops(), batch)
        assert images.rows is not None, "an image step at tp > 1 needs its rows for the followers"
        index, rows = images.rows
        return ImageStep(self.take_drops(), batch, index, rows)


class FollowerImages:
    """A follower's side: the embeddings the first rank holds, by key, and the steps that splice them."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.cache: dict[int, torch.Tensor] = {}
        self.num_encodes = 0

    def handle(self, msg: DropImages) -> None:
        for key in msg.drops:
            self.cache.pop(key, None)
        if isinstance(msg, EncodeImages):
            assert msg.pixels is not None
            self.cache[msg.key] = self.runner.encode_images(msg.pixels)
            self.num_encodes += 1
        elif isinstance(msg, ImageStep):
            assert msg.batch is not None
            self.runner._run(msg.batch, None, self.splice(msg) if msg.index else None)

    def splice(self, msg: ImageStep) -> ImageSplice:
        parts = [self.cache[key][lo:hi] for key, lo, hi in msg.rows]
        ids = torch.tensor(msg.index, dtype=torch.long, device=self.runner.device)
        return ImageSplice(ids, torch.cat(parts) if len(parts) > 1 else parts[0])
