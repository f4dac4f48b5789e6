"""Cross-entropy over vocabulary-parallel logits, without gathering the full vocabulary on any rank.

Each rank holds ``logits[..., V_padded / tp]``. The softmax normaliser and the target logit are combined with two
small all-reduces (a max, then one sum of stacked per-token values), so the memory is that of the local shard. Columns
at or beyond the true ``vocab_size`` (vocabulary padding) are excluded, so the loss equals
``F.cross_entropy`` on the unpadded logits, including label smoothing over the true vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mcore_parallel.state import Group
from mcore_parallel.tensor import _comm

__all__ = ["vocab_parallel_cross_entropy"]


def shard_columns(part: int, rank: int, vocab_size: int) -> tuple[int, int]:
    """(first global column, columns inside the true vocabulary) of rank ``rank``'s ``part``-column shard."""
    start = rank * part
    return start, max(0, min(part, vocab_size - start))


def local_targets(target: torch.Tensor, start: int, part: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets outside this shard, targets as shard columns with the outside ones at 0)."""
    outside = (target < start) | (target >= start + part)
    return outside, (target - start).masked_fill(outside, 0)


def shifted_loss(
    shifted: torch.Tensor,
    outside: torch.Tensor,
    local_t: torch.Tensor,
    valid_cols: int,
    group: Group,
    vocab_size: int,
    label_smoothing: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loss from logits minus the global row max (``shifted``, exponentiated in place): one all-reduce
    SUM of the stacked per-token sums. Returns (loss, log of the normaliser, the normaliser)."""
    stats = [shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)]
    if label_smoothing > 0:
        stats.append(shifted[..., :valid_cols].sum(dim=-1))
    stats.insert(1, shifted.exp_().sum(dim=-1))
    stacked = _comm.all_reduce(torch.stack(stats), group)
    sum_exp = stacked[1]
    log_z = sum_exp.log()
    loss = log_z - stacked[0]
    if label_smoothing > 0:
        mean_log_prob = stacked[2] / vocab_size - log_z
        loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_prob
    return loss, log_z, sum_exp


def softmax_to_grad_(
    softmax: torch.Tensor,
    outside: torch.Tensor,
    local_t: torch.Tensor,
    valid_cols: int,
    vocab_size: int,
    label_smoothing: float,
) -> torch.Tensor:
    """The loss gradient w.r.t. the logits, in place of their ``softmax``: minus the (smoothed) one-hot target."""
    eps = label_smoothing
    hit = (~outside).to(softmax.dtype)
    softmax.scatter_add_(-1, local_t.unsqueeze(-1), (-(1.0 - eps) * hit).unsqueeze(-1))
    if eps > 0 and valid_cols:
        softmax[..., :valid_cols] -= eps / vocab_size
    return softmax


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        group: Group,
        vocab_size: int,
        label_smoothing: float,
    ) -> torch.Tensor:
        part = logits.shape[-1]
        start, valid_cols = shard_columns(part, group.rank, vocab_size)
        x = logits.float()
        if valid_cols < part:
            x = x.clone() if x is logits else x
            x[..., valid_cols:] = float("-inf")
        row_max = x.max(dim=-1).values
        _comm.all_reduce(row_max, group, op=dist.ReduceOp.MAX)
        exp = x - row_max.unsqueeze(-1)  # shifted logits, exponentiated in place below

        outside, local_t = local_targets(target, start, part)
        loss, _, sum_exp = shifted_loss(exp, outside, local_t, valid_cols, group, vocab_size, label_smoothing)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, outside)
        ctx.label_smoothing, ctx.vocab_size, ctx.valid_cols, ctx.in_dtype = (
            label_smoothing,
            vocab_size,
            valid_cols,
            logits.dtype,
        )
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        softmax, local_t, outside = ctx.saved_tensors
        # the saved softmax is not needed again: reused in place
        grad = softmax_to_grad_(softmax, outside, local_t, ctx.valid_cols, ctx.vocab_size, ctx.label_smoothing)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp: Group,
    *,
    vocab_size: int | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-token cross-entropy (float32, shape of ``target``) of vocabulary-parallel ``logits``.

    ``logits`` is this rank's ``[..., V_padded / tp]`` slice (any float dtype; the math runs in float32), ``target``
    holds global token ids in ``[0, vocab_size)``. ``vocab_size`` is the true vocabulary (default: every column is
    real). Mask or average the result yourself (e.g. with a loss mask).
    """
    full = logits.shape[-1] * tp.size
    vocab_size = full if vocab_size is None else vocab_size
    if not 0 < vocab_size <= full:
        raise ValueError(f"vocab_size={vocab_size} must be in (0, {full}] (the padded vocabulary of the logits)")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal logits shape without its last dim {tuple(logits.shape[:-1])}"
        )
    return _VocabParallelCrossEntropy.apply(logits, target, tp, vocab_size, label_smoothing)
