"""The tiny LLaVA VLM of the serving tests (CPU and GPU) and its prompts."""

from __future__ import annotations

import torch

from mcore_models.multimodal import LlavaModel, llava_preset

__all__ = ["IMG", "S", "T", "prompt", "tiny_vlm"]

IMG = 255  # llava-tiny's image token (byte 0xff, never in UTF-8 text)
T = 16  # its image tokens per image
S = 16  # its image size


def tiny_vlm() -> LlavaModel:
    config = llava_preset("llava-tiny", language={"vocab_size": 259, "init_method_std": 0.2, "seed": 7})
    return LlavaModel(config).eval()


def prompt(before: int, after: int, images: int = 1, seed: int = 0) -> list[int]:
    """``before`` random text tokens, then per image its ``T`` image tokens and ``after`` more."""
    g = torch.Generator().manual_seed(seed)
    text = lambda k: torch.randint(0, 255, (k,), generator=g).tolist()  # noqa: E731
    ids = text(before)
    for _ in range(images):
        ids += [IMG] * T + text(after)
    return ids
