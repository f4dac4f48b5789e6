"""The optional torch adapter: dict batches, masks, DataLoader use and exact resume."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mcore_data import GPTDataset, GPTDatasetConfig, MockIndexedDataset  # noqa: E402
from mcore_data.torch import BatchConfig, TorchGPTDataset, build_dataloader  # noqa: E402


def _gpt() -> GPTDataset:
    return GPTDataset(
        MockIndexedDataset(num_documents=80, max_length=30, seed=1, eod=0),
        GPTDatasetConfig(sequence_length=32),
        num_samples=64,
    )


def test_item_fields_and_masks() -> None:
    g = _gpt()
    cfg = BatchConfig(
        eod_id=0, eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True, document_boundaries=True
    )
    item = TorchGPTDataset(g, cfg)[5]
    text = g[5]
    assert torch.equal(item["tokens"], torch.from_numpy(text[:-1]))
    assert torch.equal(item["labels"], torch.from_numpy(text[1:]))
    tokens = text[:-1]
    assert item["loss_mask"][torch.from_numpy(tokens == 0)].sum() == 0
    assert item["loss_mask"][torch.from_numpy(tokens != 0)].min() == 1
    eods = np.flatnonzero(tokens == 0)
    pos = item["position_ids"].numpy()
    for e in eods[eods < 31]:
        assert pos[e + 1] == 0
    mask = item["attention_mask"][0].numpy()
    assert (mask.shape == (32, 32) and mask[0, 1] and not mask[1, 0]) or (len(eods) and eods[0] == 0)
    if len(eods) and eods[0] < 30:
        e = eods[0]
        assert mask[e + 1, e]  # no attention across the document boundary
    assert item["doc_starts"][0] == 0 and item["num_documents"] >= 1


def test_dataloader_resume_is_exact() -> None:
    g = _gpt()
    full = [b["tokens"] for b in build_dataloader(g, 4, dp_size=2, dp_rank=1)]
    resumed = [b["tokens"] for b in build_dataloader(g, 4, dp_size=2, dp_rank=1, consumed_samples=24)]
    assert len(resumed) == len(full) - 3
    for a, b in zip(full[3:], resumed):
        assert torch.equal(a, b)
    assert full[0].shape == (4, 32)
    assert torch.equal(full[0][0], torch.from_numpy(g[4][:-1]))
