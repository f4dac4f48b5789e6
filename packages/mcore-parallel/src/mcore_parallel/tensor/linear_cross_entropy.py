"""Output projection fused with vocabulary-parallel cross-entropy, a chunk of tokens at a time.

``linear_vocab_parallel_cross_entropy(hidden, weight, target, tp)`` equals
``vocab_parallel_cross_entropy(F.linear(hidden, weight), target, tp)`` but never holds the logits of more than
``chunk_tokens`` tokens: the forward pass keeps only each token's log-sum-exp, and the backward pass recomputes each
chunk's logits from ``hidden`` and ``weight`` to form the softmax gradient. The saved state is ``hidden``, ``weight``,
``target`` and one float per token, instead of a ``[tokens, V / tp]`` softmax.

The collectives per chunk are those of :func:`~mcore_parallel.tensor.vocab_parallel_cross_entropy`: an all-reduce
MAX of the row maxima, then one all-reduce SUM of the stacked per-token sums. The hidden gradient is this rank's
partial sum over its vocabulary shard; the mapping that brought ``hidden`` into the TP region (``copy_to_tp_region``
or the sequence-parallel all-gather) reduces it across the group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mcore_parallel.state import Group
from mcore_parallel.tensor import _comm
from mcore_parallel.tensor.cross_entropy import local_targets, shard_columns, shifted_loss, softmax_to_grad_

__all__ = ["linear_vocab_parallel_cross_entropy"]


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax arithmetic runs in float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, valid_cols: int, math_dtype: torch.dtype) -> torch.Tensor:
    """``hidden @ weight.T`` in the input dtype, as a fresh ``math_dtype`` tensor with padding columns at -inf."""
    x = torch.mm(hidden, weight.t()).to(math_dtype)  # a new tensor either way: safe to modify in place
    if valid_cols < x.shape[-1]:
        x[:, valid_cols:] = float("-inf")
    return x


class _LinearVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        group: Group,
        vocab_size: int,
        label_smoothing: float,
        chunk_tokens: int,
    ) -> torch.Tensor:
        part = weight.shape[0]
        start, valid_cols = shard_columns(part, group.rank, vocab_size)
        math_dtype = _math_dtype(hidden.dtype)
        h2 = hidden.reshape(-1, hidden.shape[-1])
        t1 = target.reshape(-1)
        n = h2.shape[0]
        loss = torch.empty(n, dtype=math_dtype, device=hidden.device)
        lse = torch.empty(n, dtype=math_dtype, device=hidden.device)
        for lo in range(0, n, chunk_tokens):
            hi = min(n, lo + chunk_tokens)
            x = _chunk_logits(h2[lo:hi], weight, valid_cols, math_dtype)
            row_max = x.max(dim=-1).values
            _comm.all_reduce(row_max, group, op=dist.ReduceOp.MAX)
            shifted = x.sub_(row_max.unsqueeze(-1))
            outside, local_t = local_targets(t1[lo:hi], start, part)
            chunk_loss, log_z, _ = shifted_loss(shifted, outside, local_t, valid_cols, group, vocab_size,
                                                label_smoothing)  # fmt: skip
            loss[lo:hi] = chunk_loss
            lse[lo:hi] = log_z + row_max
        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.group, ctx.vocab_size, ctx.label_smoothing, ctx.chunk_tokens = (
            group,
            vocab_size,
            label_smoothing,
            chunk_tokens,
        )
        return loss.view(target.shape)

    @staticmethod
    def backward(
        ctx: Any, grad_loss: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None, None]:
        hidden, weight, target, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_hidden or need_weight):
            return None, None, None, None, None, None, None
        group: Group = ctx.group
        part = weight.shape[0]
        start, valid_cols = shard_columns(part, group.rank, ctx.vocab_size)
        math_dtype = lse.dtype
        h2 = hidden.reshape(-1, hidden.shape[-1])
        t1 = target.reshape(-1)
        g1 = grad_loss.reshape(-1).to(math_dtype)
        n = h2.shape[0]

        grad_hidden = torch.empty_like(h2) if need_hidden else None
        acc_dtype = _math_dtype(weight.dtype)
        grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_weight else None
        for lo in range(0, n, ctx.chunk_tokens):
            hi = min(n, lo + ctx.chunk_tokens)
            hc = h2[lo:hi]
            grad = _chunk_logits(hc, weight, valid_cols, math_dtype)
            grad.sub_(lse[lo:hi].unsqueeze(-1)).exp_()  # softmax; padding columns are exp(-inf) = 0
            outside, local_t = local_targets(t1[lo:hi], start, part)
            softmax_to_grad_(grad, outside, local_t, valid_cols, ctx.vocab_size, ctx.label_smoothing)
            grad.mul_(g1[lo:hi].unsqueeze(-1))
            g = grad.to(hidden.dtype)

            if grad_hidden is not None:
                torch.mm(g, weight, out=grad_hidden[lo:hi])
            if grad_weight is not None:
                if g.dtype == acc_dtype:
                    grad_weight.addmm_(g.t(), hc)
                else:
                    grad_weight += torch.mm(g.t(), hc)
        return (
            None if grad_hidden is None else grad_hidden.view(hidden.shape),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def linear_vocab_parallel_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    tp: Group,
    *,
    vocab_size: int | None = None,
    label_smoothing: float = 0.0,
    chunk_tokens: int = 4096,
) -> torch.Tensor:
    """Per-token cross-entropy of ``hidden @ weight.T`` (vocabulary-parallel), without materialising all logits.

    ``hidden`` is ``[..., h]``, identical on every rank of ``tp`` (already passed through ``copy_to_tp_region`` or
    the sequence-parallel all-gather, whose backward reduces its gradient). ``weight`` is this rank's
    ``[V_padded / tp, h]`` shard of the output projection (no bias), in the dtype of ``hidden``. ``target`` holds
    global token ids in ``[0, vocab_size)`` with shape ``hidden.shape[:-1]``; ``vocab_size`` is the true vocabulary
    (default: every row of every shard is real). The matmuls run in the input dtype and the softmax in float32; at
    most ``chunk_tokens`` tokens' logits exist at a time, in both passes.

    Returns the loss with the shape of ``target``, in float32 (float64 for float64 inputs). Equals
    ``vocab_parallel_cross_entropy(F.linear(hidden, weight), target, tp, vocab_size=..., label_smoothing=...)``.
    """
    if hidden.dim() < 1 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [..., h] and weight [V_local, h]; got shapes {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden size {hidden.shape[-1]} (last dim of hidden) must equal weight.shape[1]={weight.shape[1]}"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden dtype {hidden.dtype} must equal weight dtype {weight.dtype}")
    if not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden dtype {hidden.dtype} must be a floating-point dtype")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal hidden shape without its last dim {tuple(hidden.shape[:-1])}"
        )
    if target.dtype.is_floating_point or target.dtype == torch.bool:
        raise ValueError(f"target must hold integer token ids, got dtype {target.dtype}")
    full = weight.shape[0] * tp.size
    vocab_size = full if vocab_size is None else vocab_size
    if not 0 < vocab_size <= full:
        raise ValueError(f"vocab_size={vocab_size} must be in (0, {full}] (the padded vocabulary of the weight)")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be at least 1")
    return _LinearVocabParallelCrossEntropy.apply(hidden, weight, target, tp, vocab_size, label_smoothing, chunk_tokens)
