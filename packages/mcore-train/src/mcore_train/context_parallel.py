"""Context parallelism in the training step: each cp rank runs the model on its chunks of every sample.

The data-parallel iterator gives the cp ranks of one data-parallel rank the same micro-batches; each keeps chunks
``r`` and ``2cp-1-r`` (of ``2cp``) of the tokens, labels, loss mask and position ids
(:func:`mcore_parallel.context_parallel.cp_split`), and the position ids go to the model, so RoPE rotates every
token by its place in the whole sequence (packed sequences, ``data.packing``: in its document, and the document ids
are split too; the ring masks other documents with every rank's ids, gathered once per micro-batch). Attention spans the whole sequence through the ring
(:mod:`mcore_models.transformer.ring_attention`); everything else is per token.

The loss: a rank's loss is the sum of its tokens' losses over the loss tokens of the *whole* micro-batch, times
``cp``. The gradient reduction averages over dp x cp, so the ``1/cp`` cancels that factor and the gradient is the
one of the full sequences' mean loss; the step's reported loss (the sum over the reporting ranks divided by dp and
cp) is that mean too, the same number as at cp = 1.
"""

from __future__ import annotations

from typing import Any

import torch

from mcore_models.transformer.ring_attention import ring_document_mask
from mcore_parallel import Group
from mcore_parallel.context_parallel import cp_split
from mcore_parallel.ddp import DistributedDataParallel

__all__ = ["cp_batch", "cp_forward_step"]

SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "document_ids")


def cp_batch(batch: dict[str, torch.Tensor], cp: Group) -> dict[str, torch.Tensor]:
    """This cp rank's chunks of a micro-batch (``[b, s]`` tensors → ``[b, s / cp]``)."""
    other = sorted(set(batch) - set(SEQUENCE_KEYS))
    if other:
        raise ValueError(f"context parallelism splits {', '.join(SEQUENCE_KEYS)}; the batch also has {other}")
    return {k: cp_split(v, cp, dim=1) for k, v in batch.items()}


def cp_forward_step(batch: dict[str, torch.Tensor], chunk: Any, cp: Group) -> tuple[torch.Tensor, Any]:
    """The schedule's forward step at cp > 1 (the module docstring): this rank's chunks through ``chunk``, and the
    loss function of its share."""
    loss_tokens = batch["loss_mask"].sum().clamp(min=1.0)
    local = cp_batch(batch, cp)
    model = chunk.module if isinstance(chunk, DistributedDataParallel) else chunk
    tokens = local["tokens"] if model.pre_process else None
    labels = local["labels"] if model.post_process else None
    if "document_ids" in local:  # packed sequences: ring attention masks other documents across the ring
        mask = ring_document_mask(local["document_ids"], cp)
        output = chunk(tokens, local["position_ids"], labels=labels, document_ids=mask)
    else:
        output = chunk(tokens, local["position_ids"], labels=labels)

    def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = (per_token * local["loss_mask"]).sum() / loss_tokens * cp.size
        return loss, {"loss": loss.detach()}

    return output, loss_func
