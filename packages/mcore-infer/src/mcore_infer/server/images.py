"""Images in chat requests: OpenAI ``image_url`` content parts with ``data:`` URLs, decoded into a VLM's pixels.

``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``: PNG by mcore-data's own decoder, JPEG
and WebP (and GIF) through Pillow when it is installed (:func:`mcore_data.multimodal_torch.decode_image`). The server
fetches nothing: an ``http(s)`` URL is refused. Each image becomes its tiles, as the model was trained
(:func:`~mcore_data.multimodal_torch.image_tiles` with ``VisionInfo.tiling``; without tiling, one tile: the image
resized to the tower's ``image_size``, bilinear with antialiasing, stretched, as mcore-data's training images are),
each normalised with ``EngineConfig.image_mean`` / ``image_std`` when set; a request's pixels are every tile of every
image, in order.
The prompt is the chat template with the image placeholder where each image part was
(:func:`mcore_data.chat.tokenize_conversation` with each image's :func:`~mcore_data.tiling.tile_tags`): per tile,
its tag's tokens then ``image_tokens`` copies of the image token, as mcore-data tokenizes the conversation to train.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
import struct
from typing import Any

import torch

from mcore_data.chat import IMAGE_PLACEHOLDER, tokenize_conversation
from mcore_data.tiling import tile_tags
from mcore_infer.errors import InvalidRequestError
from mcore_infer.images import ImagePrompt, VisionInfo
from mcore_infer.protocol import ChatMessages

__all__ = ["MAX_PIXELS", "ImagePart", "decode_data_url", "prepare_images", "prompt_with_images", "request_pixels",
           "to_tiles"]  # fmt: skip

ImagePart = tuple[str, str]
"""An image content part: its URL and where it is in the request (``messages[i].content[j]``)."""

MAX_PIXELS = 4096 * 4096
"""Largest PNG taken (width x height, read from its header before decoding; Pillow has its own limit)."""

_TYPES = {"png": "png", "jpeg": "jpeg", "jpg": "jpeg", "webp": "webp", "gif": "gif"}
_DATA_URL = re.compile(r"data:image/([A-Za-z0-9.+-]+)((?:;[^,;]*)*?);base64,(.*)", re.DOTALL)


def decode_data_url(url: str, where: str) -> tuple[bytes, str]:
    """The image bytes and their format of a ``data:image/<type>;base64,...`` URL; a 400 naming the problem else."""
    if not isinstance(url, str):
        raise InvalidRequestError("image_url.url must be a string", param=where)
    if re.match(r"(?i)https?://", url):
        raise InvalidRequestError("only data URLs (data:image/png;base64,...) are accepted for images: this server "
                                  "does not fetch http(s) URLs", param=where, code="image_url_not_supported")  # fmt: skip
    m = _DATA_URL.fullmatch(url.strip())
    if m is None:
        raise InvalidRequestError("image_url.url must be a base64 data URL: data:image/<png|jpeg|webp>;base64,<data>",
                                  param=where)  # fmt: skip
    kind = m.group(1).lower()
    if kind not in _TYPES:
        raise InvalidRequestError(f"image type image/{kind} is not supported: use png, jpeg or webp", param=where)
    try:
        data = base64.b64decode(re.sub(r"\s+", "", m.group(3)), validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequestError(f"the image data URL is not valid base64: {e}", param=where) from None
    if not data:
        raise InvalidRequestError("the image data URL is empty", param=where)
    return data, _TYPES[kind]


def to_tiles(data: bytes, ext: str, vision: VisionInfo, where: str) -> torch.Tensor:
    """An image's decoded, tiled (or resized) and normalised pixels ``[k, C, S, S]`` float32, its ``k`` tiles in
    :func:`mcore_data.multimodal_torch.image_pixels`, as training items are (a 400 when the image cannot be
    decoded)."""
    from mcore_data.errors import ImageDecodeError
    from mcore_data.multimodal_torch import decode_image, image_pixels

    if ext == "png" and data[12:16] == b"IHDR":  # a few compressed bytes can stand for gigabytes of pixels
        w, h = struct.unpack(">II", data[16:24])
        if w * h > MAX_PIXELS:
            raise InvalidRequestError(f"{where}: the image is {w} x {h} pixels; at most {MAX_PIXELS} pixels are "
                                      "accepted", param=where, code="image_too_large")  # fmt: skip
    try:
        px = decode_image(data, ext, where)
    except ImageDecodeError as e:
        raise InvalidRequestError(str(e), param=where, code="invalid_image") from None
    if px.shape[2] != vision.num_channels:
        raise InvalidRequestError(f"{where}: the model takes {vision.num_channels}-channel images", param=where)
    return image_pixels(px, vision.image_size, vision.tiling, vision.mean, vision.std)


def prompt_with_images(tokenizer: Any, turns: list[dict[str, str]], vision: VisionInfo,
                       tiles: list[int] | None = None) -> list[int]:  # fmt: skip
    """The chat prompt's token ids with each image placeholder of ``turns`` as its tiles (``tiles[i]`` of image
    ``i``, default one each): per tile its tag (:func:`~mcore_data.tiling.tile_tags`) and ``image_tokens`` image
    tokens, as mcore-data tokenizes a training conversation; then the generation prompt."""
    tags = None if tiles is None else [tile_tags(k, vision.tiling) for k in tiles]
    conv = tokenize_conversation(tokenizer, turns, image_token_id=vision.image_token_id,
                                 image_tokens=vision.image_tokens, append_eod=False, tiles=tags)  # fmt: skip
    return [int(t) for t in conv.tokens] + list(tokenizer.encode("<|assistant|>\n"))


def request_pixels(parts: list[ImagePart], vision: VisionInfo) -> tuple[torch.Tensor, list[int]]:
    """The pixels of a request's image parts, every tile of every image in order ``[sum k_i, C, S, S]``, and each
    image's tile count ``k_i``."""
    per_image = [to_tiles(*decode_data_url(url, where), vision, where) for url, where in parts]
    return torch.cat(per_image), [int(t.shape[0]) for t in per_image]


async def prepare_images(tokenizer: Any, chat: ChatMessages, vision: VisionInfo | None, model: str) -> ImagePrompt:
    """The prompt of a chat request with images and their pixels (decoded off the event loop); a 400 for an image
    to a text-only model, too many images, a bad URL, bad base64 or an undecodable image."""
    parts = chat.images
    if vision is None:
        raise InvalidRequestError(f"the model '{model}' is text-only: it does not take image content parts",
                                  param=parts[0][1], code="images_not_supported")  # fmt: skip
    if len(parts) > vision.max_images:
        raise InvalidRequestError(f"the request has {len(parts)} images; this server takes at most "
                                  f"{vision.max_images} per request", param="messages",
                                  code="too_many_images")  # fmt: skip
    if chat.placeholder_in_text is not None:
        raise InvalidRequestError(f"{chat.placeholder_in_text}: text must not hold {IMAGE_PLACEHOLDER!r} (the image "
                                  "placeholder) in a request with images", param=chat.placeholder_in_text)  # fmt: skip
    pixels, tiles = await asyncio.to_thread(request_pixels, parts, vision)
    return ImagePrompt.of(prompt_with_images(tokenizer, chat.turns, vision, tiles), pixels)
