"""``GPTDataset``: fixed-length samples of ``sequence_length + 1`` tokens drawn across document boundaries.

numpy only. The document, sample and shuffle indices come from :mod:`mcore_data._indices` (``megatron`` ordering
reproduces Megatron-LM exactly; ``fast`` is the default) and are cached as ``.npy`` next to a JSON description.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from mcore_data._cache import IndexCache
from mcore_data._indices import ORDERING_VERSIONS, build_fast_indices, build_megatron_indices, plan_epochs
from mcore_data.errors import ConfigError

__all__ = ["GPTDataset", "GPTDatasetConfig", "LowLevelDataset", "dataset_fingerprint"]

logger = logging.getLogger(__name__)
_NAMES = ("document_index", "sample_index", "shuffle_index")


class LowLevelDataset(Protocol):
    """What GPTDataset reads: :class:`~mcore_data.indexed.IndexedDataset` or :class:`~mcore_data.mock.MockIndexedDataset`."""

    path_prefix: str
    sequence_lengths: npt.NDArray[np.int32]
    document_indices: npt.NDArray[np.int64]

    def __len__(self) -> int: ...
    def get(self, i: int, offset: int = 0, length: int | None = None) -> npt.NDArray[Any]: ...


@dataclass
class GPTDatasetConfig:
    """How samples are drawn. Everything here (plus the dataset file and split) keys the index cache."""

    sequence_length: int = 2048
    """Tokens per sample (each sample holds one more, for the shifted labels)."""
    random_seed: int = 1234
    """Seed of the document and sample shuffles: the same seed gives the same samples everywhere."""
    ordering: str = "fast"
    """``fast`` (default) or ``megatron`` (Megatron-LM's exact indices for the same seed and split)."""
    split: str = "969,30,1"
    """Train/valid/test document weights."""
    cache_dir: str | None = None
    """Where index caches live; default ``<data dir>/cache/GPTDataset_indices``. None + mock data: memory only."""
    drop_last_partial_validation_sequence: bool = True
    """When False the valid split keeps a final short sample (padded with ``pad_id``)."""
    pad_id: int = -1
    """Fills short samples (only possible for the valid split, see above)."""

    def __post_init__(self) -> None:
        if self.sequence_length < 2:
            raise ConfigError(f"sequence_length must be >= 2, got {self.sequence_length}")
        if self.ordering not in ("fast", "megatron"):
            raise ConfigError(f"ordering must be 'fast' or 'megatron', not {self.ordering!r}")


def dataset_fingerprint(dataset: LowLevelDataset) -> dict[str, Any]:
    """O(1) identity of a dataset's content: sizes plus an md5 of the first and last MiB of its ``.idx``."""
    fp = getattr(dataset, "fingerprint", None)
    if callable(fp):
        return dict(fp())
    idx_path = getattr(dataset, "idx_path", None)
    bin_path = getattr(dataset, "bin_path", None)
    if idx_path is None or bin_path is None:
        raise ConfigError(f"cannot fingerprint {type(dataset).__name__}; give it a fingerprint() method")
    size = os.path.getsize(idx_path)
    h = hashlib.md5()
    with open(idx_path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
        h.update(f.read(1 << 20))
    return {"idx_bytes": size, "bin_bytes": os.path.getsize(bin_path), "idx_md5_head_tail": h.hexdigest()}


class GPTDataset:
    """Samples ``i`` in ``range(len(ds))``: ``ds[i]`` is an int64 array of ``sequence_length + 1`` tokens.

    ``document_range`` restricts it to documents ``[lo, hi)`` (a split); ``num_samples`` asks for at least that many
    samples (more epochs as needed; ``len`` may be a little larger, as in Megatron). With ``build=False`` a missing
    cache is an error instead of being built (for ranks that must only load).
    """

    def __init__(
        self,
        dataset: LowLevelDataset,
        config: GPTDatasetConfig,
        *,
        split: str = "train",
        num_samples: int | None = None,
        document_range: tuple[int, int] | None = None,
        build: bool = True,
    ) -> None:
        self.dataset = dataset
        self.config = config
        self.split = split
        n_docs = len(dataset.document_indices) - 1
        lo, hi = document_range if document_range is not None else (0, n_docs)
        if not 0 <= lo < hi <= n_docs:
            raise ConfigError(f"document range [{lo}, {hi}) is empty or outside 0..{n_docs} of {dataset.path_prefix}")
        self.document_range = (lo, hi)
        self.num_samples = num_samples
        self.description: dict[str, Any] = {
            "class": "GPTDataset",
            "format": 1,
            "dataset_path": os.path.abspath(dataset.path_prefix)
            if os.path.exists(dataset.path_prefix + ".idx")
            else dataset.path_prefix,
            "dataset_fingerprint": dataset_fingerprint(dataset),
            "num_samples": num_samples,
            "index_split": split,
            "document_range": [lo, hi],
            "random_seed": config.random_seed,
            "sequence_length": config.sequence_length,
            "ordering": config.ordering,
            "ordering_version": ORDERING_VERSIONS[config.ordering],
            "add_extra_token_to_sequence": 1,
            "drop_last_partial_sequence": self._drop_last(),
        }
        t0 = time.perf_counter()
        cache_dir = config.cache_dir
        if cache_dir is None and os.path.exists(dataset.path_prefix + ".idx"):
            cache_dir = os.path.join(
                os.path.dirname(os.path.abspath(dataset.path_prefix)), "cache", "GPTDataset_indices"
            )
        if cache_dir is None:
            arrays, built = self._build(), True
        else:
            cache = IndexCache(cache_dir, "GPTDataset", split, self.description)
            self.cache = cache
            if not build:
                loaded = cache.load(_NAMES)
                if loaded is None:
                    raise ConfigError(f"no index cache {cache.description_path}; run `mcore-data build-index` first")
                arrays, built = loaded, False
            else:
                arrays, built = cache.load_or_build(_NAMES, self._build)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        logger.info(
            "%s GPTDataset %s indices for %s (%d samples) in %.3fs",
            "built" if built else "loaded",
            split,
            dataset.path_prefix,
            len(self),
            time.perf_counter() - t0,
        )

    def _drop_last(self) -> bool:
        return self.split != "valid" or self.config.drop_last_partial_validation_sequence

    def _build(self) -> dict[str, npt.NDArray[Any]]:
        lo, hi = self.document_range
        sizes = self.dataset.sequence_lengths
        tokens = int(np.sum(sizes[lo:hi], dtype=np.int64))
        plan = plan_epochs(tokens, self.num_samples, self.config.sequence_length)
        build = build_megatron_indices if self.config.ordering == "megatron" else build_fast_indices
        doc, sample, shuffle = build(
            sizes, lo, hi, plan, self.config.sequence_length, self.config.random_seed, self._drop_last()
        )
        return {"document_index": doc, "sample_index": sample, "shuffle_index": shuffle}

    def __len__(self) -> int:
        return int(self.sample_index.shape[0]) - 1

    def _pieces(self, idx: int) -> list[npt.NDArray[Any]]:
        n = len(self)
        if not -n <= idx < n:
            raise IndexError(f"sample {idx} out of range ({n} samples)")
        j = int(self.shuffle_index[idx])
        d0, o0 = (int(x) for x in self.sample_index[j])
        d1, o1 = (int(x) for x in self.sample_index[j + 1])
        get, doc = self.dataset.get, self.document_index
        if d0 == d1:
            return [get(int(doc[d0]), o0, o1 - o0 + 1)]
        pieces = [get(int(doc[d0]), o0)]
        pieces.extend(get(int(doc[k])) for k in range(d0 + 1, d1))
        pieces.append(get(int(doc[d1]), 0, o1 + 1))
        return pieces

    def __getitem__(self, idx: int) -> npt.NDArray[np.int64]:
        return self.sample_with_boundaries(idx)[0]

    def sample_with_boundaries(self, idx: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Sample ``idx`` and the offsets where each of its document pieces starts (first is 0)."""
        pieces = self._pieces(idx)
        want = self.config.sequence_length + 1
        text = np.full(want, self.config.pad_id, dtype=np.int64)
        starts = np.zeros(len(pieces), dtype=np.int64)
        pos = 0
        for k, p in enumerate(pieces):
            starts[k] = pos
            text[pos : pos + len(p)] = p
            pos += len(p)
        return text, starts

    def state(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "description": self.description}
