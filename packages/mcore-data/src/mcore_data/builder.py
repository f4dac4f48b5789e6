"""Building the train / valid / test datasets of a run from one prefix, a weighted blend, or per-split blends."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mcore_data._indices import split_ranges
from mcore_data.blended import BlendedDataset
from mcore_data.errors import ConfigError
from mcore_data.gpt_dataset import GPTDataset, GPTDatasetConfig
from mcore_data.indexed import IndexedDataset

__all__ = ["SPLITS", "build_gpt_datasets", "parse_blend"]

SPLITS = ("train", "valid", "test")
Blend = Sequence[tuple[float, str]]


def parse_blend(items: Sequence[str]) -> list[tuple[float, str]]:
    """``["0.3", "a", "0.7", "b"]`` or ``["a"]`` (weight 1) → ``[(0.3, "a"), (0.7, "b")]``."""
    items = list(items)
    if len(items) == 1:
        return [(1.0, items[0])]
    if len(items) % 2:
        raise ConfigError(f"a blend is 'weight prefix weight prefix ...', got an odd number of items: {items}")
    out = []
    for w, p in zip(items[0::2], items[1::2]):
        try:
            out.append((float(w), p))
        except ValueError as e:
            raise ConfigError(f"blend weight {w!r} (before {p!r}) is not a number") from e
    return out


def _one_split(
    blend: Blend,
    config: GPTDatasetConfig,
    split: str,
    size: int | None,
    ranges: list[tuple[int, int] | None] | None,
    surplus: float,
    build: bool,
) -> Any:
    children = []
    total = sum(w for w, _ in blend)
    for weight, prefix in blend:
        ds = IndexedDataset(prefix)
        if ranges is None:
            rng: tuple[int, int] | None = (0, ds.num_documents)
        else:
            rng = split_ranges(config.split, ds.num_documents)[SPLITS.index(split)]
            if rng is None or rng[0] >= rng[1]:
                return None
        n = None
        if size is not None:
            n = size if len(blend) == 1 else math.ceil(math.ceil(size * weight / total) * (1 + surplus))
        children.append(GPTDataset(ds, config, split=split, num_samples=n, document_range=rng, build=build))
    if len(children) == 1:
        return children[0]
    return BlendedDataset(children, [w for w, _ in blend], size, split=split, cache_dir=config.cache_dir)


def build_gpt_datasets(
    config: GPTDatasetConfig,
    sizes: Sequence[int | None],
    blend: Blend | None = None,
    blend_per_split: Sequence[Blend | None] | None = None,
    *,
    surplus: float = 0.005,
    build: bool = True,
) -> list[Any]:
    """``[train, valid, test]`` (``None`` where a split is empty or not asked for).

    ``blend`` is split by ``config.split`` (document weights); ``blend_per_split`` gives each split its own blend
    of whole datasets. Children of a blend get ``ceil(ceil(size * w) * (1 + surplus))`` samples, as in Megatron.
    """
    if (blend is None) == (blend_per_split is None):
        raise ConfigError("give exactly one of blend and blend_per_split")
    out: list[Any] = []
    for k, split in enumerate(SPLITS):
        size = sizes[k] if k < len(sizes) else None
        if size == 0:
            out.append(None)
            continue
        if blend is not None:
            out.append(_one_split(blend, config, split, size, [], surplus, build))
        else:
            assert blend_per_split is not None
            b = blend_per_split[k] if k < len(blend_per_split) else None
            out.append(None if not b else _one_split(b, config, split, size, None, surplus, build))
    return out
