"""Packed rows (``BatchConfig(document_ids=True, reset_position_ids=True)``): the rows in sample order are the
document stream with no token dropped, ``document_ids`` change exactly after every EOD, positions restart there, the
loss mask follows ``eod_mask_loss``, and a document longer than a row spans rows as one document in each."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mcore_data import GPTDataset, GPTDatasetConfig, MockIndexedDataset  # noqa: E402
from mcore_data.errors import ConfigError  # noqa: E402
from mcore_data.torch import BatchConfig, TorchGPTDataset, build_dataloader  # noqa: E402

SEQ = 32
EOD = 0


def _dataset(max_length: int) -> tuple[MockIndexedDataset, GPTDataset]:
    low = MockIndexedDataset(num_documents=60, max_length=max_length, vocab_size=50, seed=3, eod=EOD)
    return low, GPTDataset(low, GPTDatasetConfig(sequence_length=SEQ, random_seed=5), num_samples=40)


def _packed(g: GPTDataset, eod_mask_loss: bool = True) -> TorchGPTDataset:
    cfg = BatchConfig(eod_id=EOD, eod_mask_loss=eod_mask_loss, reset_position_ids=True, document_ids=True)
    return TorchGPTDataset(g, cfg)


@pytest.mark.parametrize("max_length", [10, 3 * SEQ], ids=["short-documents", "documents-longer-than-a-row"])
def test_rows_in_sample_order_are_the_document_stream(max_length: int) -> None:
    low, g = _dataset(max_length)
    ds = _packed(g)
    order = np.argsort(g.shuffle_index[: len(g)])  # sample index -> the item that serves it
    rows = [ds[int(i)] for i in order]
    stream = np.concatenate([low.get(int(d)) for d in g.document_index])
    got = torch.cat([r["tokens"] for r in rows]).numpy()
    assert np.array_equal(got, stream[: len(got)])  # every token, in order, none dropped
    labels = torch.cat([r["labels"] for r in rows]).numpy()
    assert np.array_equal(labels, stream[1 : len(got) + 1])


@pytest.mark.parametrize("max_length", [10, 3 * SEQ], ids=["short-documents", "documents-longer-than-a-row"])
def test_document_ids_and_positions_restart_after_every_eod(max_length: int) -> None:
    _, g = _dataset(max_length)
    ds = _packed(g)
    whole_rows = 0
    for i in range(len(ds)):
        item = ds[i]
        tokens, docs, pos = item["tokens"].numpy(), item["document_ids"].numpy(), item["position_ids"].numpy()
        assert docs.shape == (SEQ,) and docs.dtype == np.int64 and docs[0] == 0
        step = np.diff(docs)
        assert set(step.tolist()) <= {0, 1}
        assert np.array_equal(step == 1, tokens[:-1] == EOD)  # a new document right after each EOD, nowhere else
        starts = np.flatnonzero(np.concatenate(([True], step == 1)))
        for a, b in zip(starts, [*starts[1:], SEQ]):
            assert np.array_equal(pos[a:b], np.arange(b - a))
        whole_rows += int(docs[-1] == 0 and EOD not in tokens[:-1])
    if max_length > SEQ:
        assert whole_rows > 0  # rows inside one long document: one document, positions 0..s-1


def test_loss_mask_at_eod_as_configured() -> None:
    _, g = _dataset(10)
    for mask_eod in (True, False):
        item = _packed(g, mask_eod)[4]
        at_eod = item["tokens"] == EOD
        assert at_eod.any()
        assert torch.all(item["loss_mask"][at_eod] == (0.0 if mask_eod else 1.0))
        assert torch.all(item["loss_mask"][~at_eod] == 1.0)


def test_document_ids_collate_and_need_eod() -> None:
    _, g = _dataset(10)
    cfg = BatchConfig(eod_id=EOD, reset_position_ids=True, document_ids=True)
    batch = next(iter(build_dataloader(g, 4, config=cfg)))
    assert batch["document_ids"].shape == (4, SEQ) and "attention_mask" not in batch  # no s x s mask
    with pytest.raises(ConfigError, match="eod_id"):
        BatchConfig(document_ids=True)
