"""Datasets and per-rank micro-batch iterators for a run (built on mcore-data).

Every data-parallel rank reads its own micro-batches of each global batch (Megatron's sampler order, so the union
over ranks of one step's samples does not depend on dp), starting at ``consumed_samples`` for exact resume.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mcore_data import GPTDataset, GPTDatasetConfig, MockIndexedDataset, build_gpt_datasets, parse_blend
from mcore_data.tokenizer import Tokenizer, TokenizerSpec, build_tokenizer
from mcore_data.torch import BatchConfig, TorchGPTDataset
from mcore_train.config import TrainConfig
from mcore_train.errors import ConfigError

__all__ = ["RunData", "build_run_data", "MicroBatchIterator", "build_tokenizer_for"]

logger = logging.getLogger(__name__)


def build_tokenizer_for(config: TrainConfig) -> Tokenizer:
    return build_tokenizer(TokenizerSpec(config.data.tokenizer, config.data.tokenizer_model))


@dataclass
class RunData:
    tokenizer: Tokenizer
    train: Any
    valid: Any
    test: Any


def _sizes(config: TrainConfig, train_iters: int) -> list[int]:
    gb, tr = config.training.global_batch_size, config.training
    train = train_iters * gb
    evals = (train_iters // tr.eval_interval + 1) if tr.eval_interval else 1
    valid = evals * tr.eval_iters * gb if tr.eval_iters else 0
    test = tr.eval_iters * gb
    return [train, valid, test]


def build_run_data(config: TrainConfig, train_iters: int, llava: Any = None) -> RunData:
    """Tokenizer and train/valid/test datasets sized for ``train_iters`` steps (built once, cached on disk); with
    ``llava`` (the run's LlavaConfig) the image-text datasets of ``data.path``."""
    d = config.data
    tokenizer = build_tokenizer_for(config)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(
            [f"model.vocab_size={config.model.vocab_size} is smaller than the tokenizer's vocabulary "
             f"({tokenizer.vocab_size}); set model.vocab_size >= {tokenizer.vocab_size}"]
        )  # fmt: skip
    if llava is not None:
        from mcore_data.errors import MCoreDataError
        from mcore_train.multimodal import multimodal_datasets

        try:
            return RunData(tokenizer, *multimodal_datasets(config, llava, tokenizer, _sizes(config, train_iters)))
        except (MCoreDataError, FileNotFoundError) as e:
            raise ConfigError([f"data: {e}"]) from None
    ds_config = GPTDatasetConfig(
        sequence_length=d.seq_length, random_seed=d.seed, ordering=d.ordering, split=d.split, cache_dir=d.cache_dir
    )
    sizes = _sizes(config, train_iters)
    if d.mock:
        low = MockIndexedDataset(num_documents=2000, max_length=4 * d.seq_length, vocab_size=tokenizer.vocab_size,
                                 seed=d.seed, eod=tokenizer.eod)  # fmt: skip
        splits = [
            GPTDataset(
                low,
                GPTDatasetConfig(d.seq_length, d.seed + k, d.ordering, d.split, None),
                split=name,
                num_samples=size or 1,
            )
            for k, (name, size) in enumerate(zip(("train", "valid", "test"), sizes))
        ]
        return RunData(tokenizer, *splits)
    try:  # the files were checked by TrainConfig.check_layout; this catches one removed since
        if d.path:
            train, valid, test = build_gpt_datasets(ds_config, sizes, blend=parse_blend(d.path))
        else:
            per_split = [parse_blend(p) if p else None for p in (d.train_path, d.valid_path, d.test_path)]
            train, valid, test = build_gpt_datasets(ds_config, sizes, blend_per_split=per_split)
    except FileNotFoundError as e:
        raise ConfigError([f"data: {e}"]) from None
    if train is None:
        raise ConfigError([f"data: the train split is empty (split={d.split!r}, path={d.path})"])
    return RunData(tokenizer, train, valid, test)


class MicroBatchIterator:
    """Yields this rank's micro-batches (dicts of tensors on ``device``) from ``consumed_samples`` on; multimodal
    items are decoded in ``workers`` DataLoader processes when ``workers > 0`` (the same batches, bit for bit)."""

    def __init__(
        self,
        dataset: Any,
        batch_config: BatchConfig,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        consumed_samples: int,
        device: torch.device,
        workers: int = 0,
    ) -> None:
        from mcore_data.multimodal_torch import MultimodalDataset

        # multimodal items are dicts of tensors already (pixels, tokens, labels, loss_mask, image_positions, ...)
        self.ds: Any = dataset if isinstance(dataset, MultimodalDataset) else TorchGPTDataset(dataset, batch_config)
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.next_sample = consumed_samples  # global index of the first sample of the next micro-batch round
        self.device = device
        self.workers = workers if isinstance(dataset, MultimodalDataset) else 0
        self._loader: Iterator[dict[str, torch.Tensor]] | None = None
        self.wait_seconds = 0.0
        """Host seconds spent in ``next()`` so far: reading, decoding and collating (or waiting for the workers), and
        starting the copy to the device."""
        self.images = 0
        """Images (tiles) in the micro-batches read so far."""

    def _from_workers(self) -> dict[str, torch.Tensor]:
        if self._loader is None:  # started on first use (no worker processes for an iterator never read)
            from mcore_data.multimodal_torch import build_multimodal_dataloader

            rng = torch.get_rng_state()  # the DataLoader draws its workers' seed from the global RNG (dropout's)
            self._loader = iter(build_multimodal_dataloader(
                self.ds, self.mbs, consumed_samples=self.next_sample, dp_rank=self.dp_rank, dp_size=self.dp_size,
                num_workers=self.workers, pin_memory=self.device.type == "cuda"))  # fmt: skip
            torch.set_rng_state(rng)
        batch = next(self._loader)
        self.next_sample += self.mbs * self.dp_size
        return self._count({k: v.to(self.device, non_blocking=True) for k, v in batch.items()})

    def _count(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if "pixels" in batch:
            self.images += int(batch["pixels"].shape[0])
        return batch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        try:
            return self._next()
        finally:
            self.wait_seconds += time.perf_counter() - start

    def _next(self) -> dict[str, torch.Tensor]:
        if self.workers:
            return self._from_workers()
        lo = self.next_sample + self.dp_rank * self.mbs
        if self.next_sample + self.mbs * self.dp_size > len(self.ds):
            raise StopIteration
        items = [self.ds[(lo + i)] for i in range(self.mbs)]
        self.next_sample += self.mbs * self.dp_size
        batch = self._collate(items)
        if self.device.type == "cuda":
            # from pinned memory the copy is asynchronous: the host does not wait for the GPU to drain its queue
            return self._count({k: v.pin_memory().to(self.device, non_blocking=True) for k, v in batch.items()})
        return self._count({k: v.to(self.device) for k, v in batch.items()})

    def _collate(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if "pixels" in items[0]:  # the images of a micro-batch are concatenated (any number per sample)
            from mcore_data.multimodal_torch import collate_multimodal

            return collate_multimodal(items)
        return {k: torch.stack([it[k] for it in items]) for k in items[0]}
