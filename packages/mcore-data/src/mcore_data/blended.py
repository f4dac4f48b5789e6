"""``BlendedDataset``: samples drawn from several datasets in fixed proportions (Megatron's blending algorithm).

Sample ``i`` comes from ``argmax_d(w_d * max(i, 1) - count_d)`` (ties to the lowest ``d``), so every dataset's share
stays within one sample of its exact weight at every prefix. Indices are cached like GPTDataset's when a cache
directory is given.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from mcore_data._cache import IndexCache
from mcore_data._indices import build_blending_indices
from mcore_data.errors import ConfigError

__all__ = ["BlendedDataset", "SampleDataset"]

logger = logging.getLogger(__name__)


class SampleDataset(Protocol):
    description: dict[str, Any]

    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> npt.NDArray[np.int64]: ...
    def sample_with_boundaries(self, i: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...


class BlendedDataset:
    """``size`` samples from ``datasets`` with ``weights`` (normalised). ``size=None`` draws exactly ``weights[d]``
    samples from dataset ``d`` (integer weights), as Megatron's exhaustive blend."""

    def __init__(
        self,
        datasets: Sequence[SampleDataset],
        weights: Sequence[float],
        size: int | None,
        *,
        split: str = "train",
        cache_dir: str | None = None,
    ) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ConfigError(f"{len(datasets)} datasets but {len(weights)} weights")
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ConfigError(f"blend weights must be >= 0 with a positive sum, got {list(weights)}")
        if len(datasets) > np.iinfo(np.int16).max:
            raise ConfigError("at most 32767 datasets can be blended")
        self.datasets = list(datasets)
        self.split = split
        if size is None:
            counts = [int(w) for w in weights]
            self.size = sum(counts)
            self.weights = [c / self.size for c in counts]
        else:
            self.size = int(size)
            total = float(np.sum(np.asarray(weights, dtype=np.float64)))
            self.weights = (np.asarray(weights, dtype=np.float64) / total).tolist()
        self.description: dict[str, Any] = {
            "class": "BlendedDataset",
            "datasets": [d.description for d in self.datasets],
            "split": split,
            "weights": self.weights,
            "size": self.size,
            "exhaustive": size is None,
        }

        for d, ds in enumerate(self.datasets):  # cheap early check; the exact one follows the build
            if self.weights[d] * self.size > len(ds) + 1:
                raise ConfigError(
                    f"blended dataset {d} needs about {self.weights[d] * self.size:.0f} samples but has {len(ds)}; "
                    "build its child with more samples (raise the surplus / num_samples)"
                )

        def build() -> dict[str, npt.NDArray[Any]]:
            which, within = build_blending_indices(self.weights, self.size)
            return {"dataset_index": which, "dataset_sample_index": within}

        names = ("dataset_index", "dataset_sample_index")
        if cache_dir is None:
            arrays = build()
        else:
            arrays, _ = IndexCache(cache_dir, "BlendedDataset", split, self.description).load_or_build(names, build)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        for d, ds in enumerate(self.datasets):
            sel = self.dataset_sample_index[self.dataset_index == d]
            need = int(sel.max()) + 1 if sel.size else 0
            if need > len(ds):
                raise ConfigError(
                    f"blended dataset {d} needs {need} samples but has {len(ds)}; build its child with more samples "
                    "(raise the surplus / num_samples)"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> npt.NDArray[np.int64]:
        return self.sample_with_boundaries(i)[0]

    def sample_with_boundaries(self, i: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        if not -self.size <= i < self.size:
            raise IndexError(f"sample {i} out of range ({self.size} samples)")
        d = int(self.dataset_index[i])
        return self.datasets[d].sample_with_boundaries(int(self.dataset_sample_index[i]))
