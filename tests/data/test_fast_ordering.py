"""The ``fast`` ordering's bucketed, multi-threaded document shuffle (``mcore_data._indices._permute_documents``)."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from mcore_data import _indices


def _permute(sizes: np.ndarray, lo: int, hi: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    doc = np.empty(hi - lo, dtype=np.int32)
    lengths = np.empty(hi - lo, dtype=np.int32)
    _indices._permute_documents(sizes, lo, hi, np.random.SeedSequence(seed), doc, lengths)
    return doc, lengths


@pytest.mark.parametrize("bucket", [1, 2, 8])
def test_every_order_of_four_documents_is_equally_likely(monkeypatch: pytest.MonkeyPatch, bucket: int) -> None:
    monkeypatch.setattr(_indices, "_BUCKET", bucket)  # 4, 2 and 1 buckets
    monkeypatch.setattr(_indices, "_GROUP_CHUNK", 3)  # labels grouped over several chunks
    sizes = np.array([10, 20, 30, 40, 50], dtype=np.int32)
    trials = 2400
    counts = Counter(tuple(_permute(sizes, 1, 5, seed)[0].tolist()) for seed in range(trials))
    assert set(counts) == set(itertools.permutations(range(1, 5)))
    expected = trials / 24
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < 60, (chi2, counts)  # 23 degrees of freedom: p < 1e-4 for a uniform shuffle


def test_the_order_depends_on_the_seed_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_indices, "_BUCKET", 16)
    monkeypatch.setattr(_indices, "_GROUP_CHUNK", 37)
    sizes = np.random.default_rng(0).integers(0, 1000, 5000).astype(np.int32)
    results = []
    for threads in (1, 2, 5):
        monkeypatch.setattr(_indices, "_threads", lambda threads=threads: threads)
        results.append(_permute(sizes, 100, 4900, 7))
    for doc, lengths in results[1:]:
        assert np.array_equal(doc, results[0][0]) and np.array_equal(lengths, results[0][1])
    doc, lengths = results[0]
    assert np.array_equal(np.sort(doc), np.arange(100, 4900))
    assert np.array_equal(lengths, sizes[doc])
    assert not np.array_equal(doc, _permute(sizes, 100, 4900, 8)[0])
    moved = np.mean(doc != np.arange(100, 4900))
    assert moved > 0.99


def test_labels_spread_documents_over_all_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 256 buckets a document may land anywhere: early documents are not kept near the front."""
    monkeypatch.setattr(_indices, "_BUCKET", 64)
    n = 64 * 256
    doc, _ = _permute(np.ones(n, dtype=np.int32), 0, n, 3)
    position = np.empty(n, dtype=np.int64)
    position[doc] = np.arange(n)
    first = position[: n // 16]  # the first 1/16 of the documents
    assert np.histogram(first, bins=16, range=(0, n))[0].min() > 0.7 * len(first) / 16
