"""Optional PyTorch adapter: dict batches for training, usable with ``torch.utils.data.DataLoader``.

Imports torch when used (``pip install 'mcore-data[torch]'``). Each item has ``tokens``, ``labels``, ``loss_mask``,
``position_ids`` and, when asked, ``attention_mask`` (causal, [1, s, s] bool, True = masked as in Megatron),
``document_ids`` (packed sequences: each token's document, from the EOD tokens, O(s)) and document starts.
:func:`build_dataloader` is resumable: it starts at a sample offset.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from mcore_data.blended import SampleDataset
from mcore_data.errors import ConfigError, MissingDependencyError

__all__ = ["BatchConfig", "ResumableSampler", "TorchGPTDataset", "build_dataloader"]


def _torch() -> Any:
    try:
        import torch
    except ImportError as e:
        raise MissingDependencyError("torch", "torch") from e
    return torch


@dataclass
class BatchConfig:
    """What each item carries."""

    eod_id: int | None = None
    """End-of-document token id (needed by the three flags below)."""
    eod_mask_loss: bool = False
    """Zero the loss on EOD tokens."""
    reset_position_ids: bool = False
    """Restart position ids after every EOD."""
    reset_attention_mask: bool = False
    """Block attention across documents (implies ``attention_mask``)."""
    attention_mask: bool = False
    """Return a causal ``attention_mask`` [1, s, s] (True = masked)."""
    document_ids: bool = False
    """Return ``document_ids`` [s] (int64): for packed sequences, the index in the row of each token's document; a
    document ends at its EOD token (which belongs to it), so the next token starts the next one. With
    ``reset_position_ids`` the positions restart at the same boundaries. Fixed size: batches collate."""
    document_boundaries: bool = False
    """Return ``doc_starts`` (padded with -1 to ``max_documents``) and ``num_documents``."""
    max_documents: int = 64
    """Room for document starts per sample."""
    pad_id: int = -1
    """Padding id in samples; its positions get loss 0."""

    def __post_init__(self) -> None:
        if (
            self.eod_mask_loss or self.reset_position_ids or self.reset_attention_mask or self.document_ids
        ) and self.eod_id is None:
            raise ConfigError("eod_mask_loss / reset_position_ids / reset_attention_mask / document_ids need eod_id")


class TorchGPTDataset:
    """A map-style torch dataset over a :class:`~mcore_data.gpt_dataset.GPTDataset` or ``BlendedDataset``."""

    def __init__(self, dataset: SampleDataset, config: BatchConfig | None = None) -> None:
        self.dataset = dataset
        self.config = config or BatchConfig()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        torch = _torch()
        cfg = self.config
        text, starts = self.dataset.sample_with_boundaries(int(i))
        tokens_np = text[:-1]
        labels_np = text[1:]
        s = len(tokens_np)
        loss_mask = (labels_np != cfg.pad_id).astype(np.float32)
        if cfg.eod_mask_loss:
            loss_mask[tokens_np == cfg.eod_id] = 0.0
        position_ids = np.arange(s, dtype=np.int64)
        doc_id = np.zeros(s, dtype=np.int64)
        if cfg.reset_position_ids or cfg.reset_attention_mask or cfg.document_ids:
            eods = np.flatnonzero(tokens_np == cfg.eod_id)
            eods = eods[eods < s - 1]
            seg_starts = np.concatenate(([0], eods + 1))
            seg = np.searchsorted(seg_starts, np.arange(s), side="right") - 1
            doc_id = seg.astype(np.int64)
            if cfg.reset_position_ids:
                position_ids = np.arange(s) - seg_starts[seg]
        item: dict[str, Any] = {
            "tokens": torch.from_numpy(np.ascontiguousarray(np.where(tokens_np < 0, 0, tokens_np))),
            "labels": torch.from_numpy(np.ascontiguousarray(np.where(labels_np < 0, 0, labels_np))),
            "loss_mask": torch.from_numpy(loss_mask),
            "position_ids": torch.from_numpy(position_ids.astype(np.int64)),
        }
        if cfg.document_ids:
            item["document_ids"] = torch.from_numpy(doc_id)
        if cfg.attention_mask or cfg.reset_attention_mask:
            causal = np.tril(np.ones((s, s), dtype=bool))
            if cfg.reset_attention_mask:
                causal &= doc_id[:, None] == doc_id[None, :]
            item["attention_mask"] = torch.from_numpy(~causal[None])
        if cfg.document_boundaries:
            st = starts[starts < s][: cfg.max_documents]
            padded = np.full(cfg.max_documents, -1, dtype=np.int64)
            padded[: len(st)] = st
            item["doc_starts"] = torch.from_numpy(padded)
            item["num_documents"] = torch.tensor(len(st), dtype=torch.int64)
        return item


class ResumableSampler:
    """Yields batches of sample indices for one data-parallel rank, starting at ``consumed_samples``.

    Global batch ``k`` covers samples ``[k*micro_batch_size*dp_size, ...)``; rank ``r`` takes its contiguous
    ``micro_batch_size`` slice, like Megatron's ``MegatronPretrainingSampler``. Resuming with the consumed sample
    count continues exactly where training stopped.
    """

    def __init__(
        self, total: int, consumed_samples: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank {dp_rank} outside 0..{dp_size - 1}")
        if consumed_samples > total:
            raise ConfigError(f"consumed_samples {consumed_samples} is past the end ({total} samples)")
        self.total, self.consumed = total, consumed_samples
        self.mbs, self.rank, self.size = micro_batch_size, dp_rank, dp_size

    def __len__(self) -> int:
        return (self.total - self.consumed) // (self.mbs * self.size)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.mbs * self.size
        for start in range(self.consumed, self.total - step + 1, step):
            lo = start + self.rank * self.mbs
            yield list(range(lo, lo + self.mbs))


def build_dataloader(
    dataset: SampleDataset,
    micro_batch_size: int,
    *,
    consumed_samples: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
    num_workers: int = 0,
    config: BatchConfig | None = None,
) -> Any:
    """A ``DataLoader`` of dict batches for this rank, resuming after ``consumed_samples`` samples."""
    torch = _torch()
    ds = TorchGPTDataset(dataset, config)
    sampler = ResumableSampler(len(ds), consumed_samples, micro_batch_size, dp_rank, dp_size)
    return torch.utils.data.DataLoader(
        ds, batch_sampler=sampler, num_workers=num_workers, pin_memory=False, persistent_workers=num_workers > 0
    )
