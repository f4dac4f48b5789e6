"""GPTDataset, BlendedDataset and builder: sample properties, Megatron parity, caching and determinism."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mcore_data import (
    BlendedDataset,
    ConfigError,
    GPTDataset,
    GPTDatasetConfig,
    IndexedDataset,
    MockIndexedDataset,
    build_gpt_datasets,
)
from mcore_data._indices import build_blending_indices, split_ranges

from .conftest import write_unique_dataset
from .megatron_reference import reference_blend, reference_indices, split_bounds


def _config(tmp_path: Path, **kw: object) -> GPTDatasetConfig:
    base: dict[str, object] = {"sequence_length": 64, "random_seed": 3, "cache_dir": str(tmp_path / "cache")}
    base.update(kw)
    return GPTDatasetConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("ordering", ["fast", "megatron"])
def test_every_token_once_per_epoch_and_contiguous_windows(unique_dataset: Path, tmp_path: Path, ordering: str) -> None:
    ds = IndexedDataset(unique_dataset)
    gpt = GPTDataset(ds, _config(tmp_path, ordering=ordering))
    s = gpt.config.sequence_length
    total = ds.num_tokens
    assert len(gpt) == (total - 1) // s
    seen = np.zeros(total, dtype=np.int64)
    starts = {int(ds.sequence_pointers[i]) // 4 for i in range(len(ds))}
    for i in range(len(gpt)):
        text = gpt[i]
        assert text.shape == (s + 1,) and text.dtype == np.int64
        seen[text[:-1]] += 1
        # contiguous window: +1 within a document, a jump only onto the start of a document
        for a, b in itertools.pairwise(text):
            assert b == a + 1 or int(b) in starts
    # one epoch: every token is an input exactly once, except fewer than s tokens at the end of the stream
    assert seen.max() == 1
    assert total - s <= seen.sum() <= total
    # each document's tokens appear in one contiguous run in the document order
    doc_order = np.asarray(gpt.document_index)
    assert sorted(doc_order.tolist()) == list(range(len(ds)))


def test_multi_epoch_counts(unique_dataset: Path, tmp_path: Path) -> None:
    ds = IndexedDataset(unique_dataset)
    s = 64
    per_epoch = (ds.num_tokens - 1) // s
    gpt = GPTDataset(ds, _config(tmp_path), num_samples=3 * per_epoch)
    assert len(gpt) >= 3 * per_epoch
    seen = np.zeros(ds.num_tokens, dtype=np.int64)
    for i in range(len(gpt)):
        seen[gpt[i][:-1]] += 1
    assert seen.max() <= 3 + 1 and np.mean(seen) > 2.9
    doc = np.asarray(gpt.document_index)
    n = len(ds)
    epochs = len(doc) // n
    for e in range(epochs):  # fast ordering: every epoch is a permutation of the documents
        assert sorted(doc[e * n : (e + 1) * n].tolist()) == list(range(n))


@pytest.mark.parametrize(
    ("num_samples", "split_name", "seq"),
    [(None, 0, 64), (50, 0, 64), (900, 0, 64), (2000, 0, 37), (700, 1, 16), (None, 1, 16), (5, 2, 8)],
)
def test_megatron_indices_match_reference(tmp_path: Path, num_samples: int | None, split_name: int, seq: int) -> None:
    rng = np.random.default_rng(11)
    sizes = rng.integers(1, 120, 300).tolist()
    sizes[5] = 0  # a zero-length document is skipped over
    prefix = tmp_path / "d"
    write_unique_dataset(prefix, sizes)
    ds = IndexedDataset(prefix)
    split = "90,8,2"
    rng_split = split_ranges(split, len(ds))[split_name]
    assert rng_split == split_bounds(split, len(ds))[split_name]
    assert rng_split is not None
    name = ["train", "valid", "test"][split_name]
    cfg = _config(tmp_path, ordering="megatron", sequence_length=seq, random_seed=1234, split=split)
    gpt = GPTDataset(ds, cfg, split=name, num_samples=num_samples, document_range=rng_split)
    doc, sample, shuffle = reference_indices(sizes, *rng_split, seq, 1234, num_samples)
    assert gpt.document_index.dtype == np.int32 and np.array_equal(gpt.document_index, doc)
    assert gpt.sample_index.dtype == np.int32 and np.array_equal(gpt.sample_index, sample)
    assert gpt.shuffle_index.dtype == np.uint32 and np.array_equal(gpt.shuffle_index, shuffle)


def test_megatron_valid_keeps_partial_sequence(tmp_path: Path) -> None:
    sizes = [7, 13, 5, 22, 9]
    prefix = tmp_path / "v"
    write_unique_dataset(prefix, sizes)
    cfg = _config(tmp_path, ordering="megatron", sequence_length=10, drop_last_partial_validation_sequence=False)
    gpt = GPTDataset(IndexedDataset(prefix), cfg, split="valid")
    _doc, sample, shuffle = reference_indices(sizes, 0, 5, 10, 3, None, drop_last=False)
    assert np.array_equal(gpt.sample_index, sample) and np.array_equal(gpt.shuffle_index, shuffle)
    assert len(gpt) == 6  # ceil(55/10)
    last = gpt[int(np.flatnonzero(np.asarray(gpt.shuffle_index) == 5)[0])]
    assert (last == -1).sum() > 0  # padded with pad_id


def test_determinism_across_processes(unique_dataset: Path, tmp_path: Path) -> None:
    code = (
        "import sys, json, numpy as np\n"
        "from mcore_data import GPTDataset, GPTDatasetConfig, IndexedDataset\n"
        "cfg = GPTDatasetConfig(sequence_length=32, random_seed=5, cache_dir=sys.argv[2])\n"
        "g = GPTDataset(IndexedDataset(sys.argv[1]), cfg, num_samples=500)\n"
        "print(json.dumps([g[i].tolist() for i in range(0, len(g), 7)]))\n"
    )
    outs = [
        subprocess.run(
            [sys.executable, "-c", code, str(unique_dataset), str(tmp_path / f"c{k}")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for k in range(2)
    ]
    assert outs[0] == outs[1]
    here = GPTDataset(
        IndexedDataset(unique_dataset), _config(tmp_path, sequence_length=32, random_seed=5), num_samples=500
    )
    assert json.loads(outs[0]) == [here[i].tolist() for i in range(0, len(here), 7)]
    other = GPTDataset(
        IndexedDataset(unique_dataset), _config(tmp_path, sequence_length=32, random_seed=6), num_samples=500
    )
    assert not np.array_equal(other[0], here[0]) or not np.array_equal(other[1], here[1])


def test_cache_reuse_and_invalidation(unique_dataset: Path, tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    a = GPTDataset(IndexedDataset(unique_dataset), cfg)
    files = sorted((tmp_path / "cache").glob("*"))
    assert len([f for f in files if f.name.endswith(".npy")]) == 3
    desc = json.loads(next(f for f in files if f.name.endswith("description.json")).read_text())
    assert desc["sequence_length"] == 64 and desc["random_seed"] == 3 and desc["ordering"] == "fast"
    b = GPTDataset(IndexedDataset(unique_dataset), cfg, build=False)  # loads, does not build
    assert isinstance(b.sample_index, np.memmap)
    assert np.array_equal(a.sample_index, b.sample_index)
    # another configuration never reuses this cache
    with pytest.raises(ConfigError, match="build-index"):
        GPTDataset(IndexedDataset(unique_dataset), _config(tmp_path, random_seed=4), build=False)
    with pytest.raises(ConfigError):
        GPTDataset(IndexedDataset(unique_dataset), cfg, num_samples=10_000, build=False)
    # rewriting the data changes the fingerprint: the old cache is not used
    write_unique_dataset(tmp_path / "tmp", [5, 6, 7])
    for suffix in (".bin", ".idx"):
        unique_dataset.with_suffix(suffix).write_bytes((tmp_path / "tmp").with_suffix(suffix).read_bytes())
    with pytest.raises(ConfigError):
        GPTDataset(IndexedDataset(unique_dataset), cfg, build=False)
    # a tampered description with the right name is rebuilt, not trusted
    d = next(f for f in files if f.name.endswith("description.json"))
    d.write_text(d.read_text().replace('"random_seed": 3', '"random_seed": 99'))
    assert GPTDataset(IndexedDataset(unique_dataset), cfg) is not None


def test_lazy_build_once_while_others_wait(unique_dataset: Path, tmp_path: Path) -> None:
    code = (
        "import sys, logging\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from mcore_data import GPTDataset, GPTDatasetConfig, IndexedDataset\n"
        "cfg = GPTDatasetConfig(sequence_length=16, random_seed=1, cache_dir=sys.argv[2])\n"
        "g = GPTDataset(IndexedDataset(sys.argv[1]), cfg, num_samples=20000)\n"
        "print(int(g[len(g) - 1].sum()))\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(unique_dataset), str(tmp_path / "c")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = [p.communicate() for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    assert len({out for out, _ in results}) == 1
    logs = "".join(err for _, err in results)
    assert logs.count("saved index cache") == 1
    assert logs.count("loaded GPTDataset") == 2
    assert len(list((tmp_path / "c").glob("*.npy"))) == 3


def test_blending_matches_megatron_and_stays_within_one_sample() -> None:
    for weights, size in [([0.5, 0.5], 100), ([0.2, 0.3, 0.5], 997), ([0.01, 0.99], 500), ([1 / 3] * 3, 301)]:
        which, within = build_blending_indices(weights, size)
        rw, rs = reference_blend(weights, size)
        assert which.tolist() == rw and within.tolist() == rs
        counts = np.zeros(len(weights))
        for i, d in enumerate(which.tolist()):
            counts[d] += 1
            assert np.all(np.abs(counts - np.asarray(weights) * (i + 1)) <= 1.0 + 1e-9)


def test_blended_dataset_and_builder(tmp_path: Path) -> None:
    for name, n in (("a", 300), ("b", 200)):
        write_unique_dataset(tmp_path / name, [50 + (k % 17) for k in range(n)])
    cfg = _config(tmp_path, split="80,20,0")
    train, valid, test = build_gpt_datasets(
        cfg, [400, 40, 0], [(0.25, str(tmp_path / "a")), (0.75, str(tmp_path / "b"))]
    )
    assert isinstance(train, BlendedDataset) and len(train) == 400 and test is None
    assert valid is not None and len(valid) == 40
    shares = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert shares.tolist() == [100, 300]
    assert train[0].shape == (65,)
    # per-split blends use whole datasets
    tr, va, te = build_gpt_datasets(
        cfg, [100, 10, None], blend_per_split=[[(1.0, str(tmp_path / "a"))], [(1.0, str(tmp_path / "b"))], None]
    )
    assert isinstance(tr, GPTDataset) and tr.document_range == (0, 300) and te is None
    assert va.document_range == (0, 200)
    with pytest.raises(ConfigError, match="needs"):
        BlendedDataset([tr, va], [0.5, 0.5], 10_000_000)


def test_mock_dataset_in_memory() -> None:
    mock = MockIndexedDataset(num_documents=50, max_length=40, seed=2)
    g = GPTDataset(mock, GPTDatasetConfig(sequence_length=16), num_samples=100)
    assert len(g) >= 100 and g[3].shape == (17,)
    again = GPTDataset(
        MockIndexedDataset(num_documents=50, max_length=40, seed=2),
        GPTDatasetConfig(sequence_length=16),
        num_samples=100,
    )
    assert np.array_equal(g[3], again[3])


def test_bad_configs() -> None:
    with pytest.raises(ConfigError):
        GPTDatasetConfig(ordering="random")
    with pytest.raises(ConfigError):
        GPTDatasetConfig(sequence_length=1)
    with pytest.raises(ConfigError):
        GPTDataset(MockIndexedDataset(10), GPTDatasetConfig(), document_range=(5, 5))
