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


# ---------------------------------------------------------------------------------------------- fused (compiled)
# The same loss in three fused passes over the (bf16) logits instead of ~9 eager float32 ones, and no float32 softmax
# kept for backward: the logits themselves are saved. Each pass is its own torch.compile'd function; the two
# all-reduces run eagerly between them (collectives stay out of compiled graphs).


def _masked(logits: torch.Tensor, valid_cols: int) -> torch.Tensor:
    """The logits in (at least) float32, columns past the true vocabulary at -inf."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    if valid_cols < x.shape[-1]:
        col = torch.arange(x.shape[-1], device=x.device)
        x = x.masked_fill(col >= valid_cols, float("-inf"))
    return x


def _row_max(logits: torch.Tensor, valid_cols: int) -> torch.Tensor:
    return _masked(logits, valid_cols).amax(dim=-1)


def _row_stats(
    logits: torch.Tensor, row_max: torch.Tensor, local_t: torch.Tensor, outside: torch.Tensor, valid_cols: int
) -> torch.Tensor:
    """[2, ...]: the target's shifted logit (0 where the target is on another rank) and the sum of exp(shifted)."""
    shifted = _masked(logits, valid_cols) - row_max.unsqueeze(-1)
    picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    return torch.stack([picked, shifted.exp().sum(dim=-1)])


def _logits_grad(
    logits: torch.Tensor,
    row_max: torch.Tensor,
    log_z: torch.Tensor,
    local_t: torch.Tensor,
    outside: torch.Tensor,
    grad_loss: torch.Tensor,
    valid_cols: int,
) -> torch.Tensor:
    """(softmax - one-hot target) * grad_loss, in the logits' dtype."""
    x = _masked(logits, valid_cols)
    softmax = (x - (row_max + log_z).unsqueeze(-1)).exp()
    col = torch.arange(x.shape[-1], device=x.device)
    hit = (col == local_t.unsqueeze(-1)) & ~outside.unsqueeze(-1)
    return ((softmax - hit.to(x.dtype)) * grad_loss.unsqueeze(-1)).to(logits.dtype)


_COMPILED: dict[str, Any] = {}


def _compiled(name: str) -> Any:
    if name not in _COMPILED:
        fn: Any = {"row_max": _row_max, "row_stats": _row_stats, "logits_grad": _logits_grad}[name]
        _COMPILED[name] = torch.compile(fn, dynamic=False)
    return _COMPILED[name]


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, group: Group, vocab_size: int) -> torch.Tensor:
        part = logits.shape[-1]
        start, valid_cols = shard_columns(part, group.rank, vocab_size)
        row_max = _compiled("row_max")(logits, valid_cols)
        _comm.all_reduce(row_max, group, op=dist.ReduceOp.MAX)
        outside, local_t = local_targets(target, start, part)
        stats = _comm.all_reduce(_compiled("row_stats")(logits, row_max, local_t, outside, valid_cols), group)
        log_z = stats[1].log()
        ctx.save_for_backward(logits, row_max, log_z, local_t, outside)
        ctx.valid_cols = valid_cols
        return log_z - stats[0]

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, row_max, log_z, local_t, outside = ctx.saved_tensors
        grad = _compiled("logits_grad")(
            logits, row_max, log_z, local_t, outside, grad_loss.contiguous(), ctx.valid_cols
        )
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp: Group,
    *,
    vocab_size: int | None = None,
    label_smoothing: float = 0.0,
    fused: bool = False,
) -> torch.Tensor:
    """Per-token cross-entropy (float32, shape of ``target``) of vocabulary-parallel ``logits``.

    ``logits`` is this rank's ``[..., V_padded / tp]`` slice (any float dtype; the math runs in float32), ``target``
    holds global token ids in ``[0, vocab_size)``. ``vocab_size`` is the true vocabulary (default: every column is
    real). Mask or average the result yourself (e.g. with a loss mask).

    ``fused`` (no label smoothing) runs the math as three ``torch.compile``'d passes over the logits (row max, the
    target logit and normaliser, and in backward the gradient), keeping the logits instead of a float32 softmax for
    backward; the all-reduces run eagerly between them. The same loss and gradients up to float32 rounding.
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
    if fused:
        if label_smoothing > 0:
            raise ValueError("vocab_parallel_cross_entropy(fused=True) has no label smoothing; use fused=False")
        return _FusedVocabParallelCrossEntropy.apply(logits, target, tp, vocab_size)
    return _VocabParallelCrossEntropy.apply(logits, target, tp, vocab_size, label_smoothing)
