"""Tensor-parallel layers: ``ColumnParallelLinear``, ``RowParallelLinear`` and ``VocabParallelEmbedding``.

Activations are ``[sequence, batch, hidden]`` (any leading shape works without sequence parallelism). With
``sequence_parallel=True`` the activations outside the TP region are split along dimension 0 across the TP group:
a column-parallel layer all-gathers its input, a row-parallel layer (and the embedding) reduce-scatters its output.
Parameters whose gradients are partial per rank under sequence parallelism (the row-parallel bias) carry the
attribute ``sequence_parallel = True``; :func:`allreduce_sequence_parallel_grads` sums them.

Each weight is initialised from the full weight (see :mod:`mcore_parallel.tensor.init`), so the unsharded weight is
identical for every TP size. Parameters carry ``tensor_model_parallel``, ``partition_dim`` and ``partition_stride``
so checkpoint and export code knows how they are split.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mcore_parallel.state import Group
from mcore_parallel.tensor import _comm
from mcore_parallel.tensor.init import InitMethod, block_sizes, init_sharded_, normal_init
from mcore_parallel.tensor.mappings import (
    copy_to_tp_region,
    gather_from_tp_region,
    linear,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
    scatter_to_tp_region,
    sequence_parallel_linear,
    sequence_parallel_row_linear,
)
from mcore_parallel.tensor.wgrad import fuses_wgrad

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "padded_vocab_size",
    "allreduce_sequence_parallel_grads",
    "set_tp_attributes",
]


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {d}")
    return n // d


def set_tp_attributes(
    param: torch.Tensor,
    partition_dim: int,
    global_shape: tuple[int, ...],
    stride: int = 1,
    blocks: Sequence[int] | None = None,
) -> None:
    """Mark ``param`` as split along ``partition_dim`` across the TP group.

    ``global_shape`` is the full, unpadded shape (vocabulary padding rows are not part of it); ``stride`` > 1 means
    the full tensor is ``stride`` equal blocks along that dimension, each split across the group (a gated MLP's fused
    input projection). ``blocks`` gives the global sizes of unequal blocks instead (a Mamba mixer's ``[z, x, B, C,
    dt]``), stored as ``partition_blocks`` (``partition_stride`` stays 1; readers of the layout use
    :func:`mcore_parallel.shard_info`).
    """
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    param.partition_dim = partition_dim  # type: ignore[attr-defined]
    param.partition_stride = stride  # type: ignore[attr-defined]
    param.global_shape = tuple(global_shape)  # type: ignore[attr-defined]
    if blocks is not None:
        dim = partition_dim % len(global_shape)
        param.partition_blocks = block_sizes(global_shape[dim], stride, blocks)  # type: ignore[attr-defined]


def _column_blocks(out_features: int, stride: int, blocks: Sequence[int] | None, tp_size: int) -> tuple[int, ...]:
    """The global sizes of the output blocks of a column-parallel layer, each checked to split over ``tp_size``."""
    if blocks is None and out_features % stride:
        raise ValueError(f"ColumnParallelLinear out_features={out_features} is not divisible by stride={stride}")
    try:
        sizes = block_sizes(out_features, stride, blocks)
    except ValueError as e:
        raise ValueError(f"ColumnParallelLinear out_features={out_features}: {e}") from None
    for i, b in enumerate(sizes):
        if blocks is not None:
            _divide(b, tp_size, f"ColumnParallelLinear block {i} of blocks={sizes}")
        else:
            _divide(b, tp_size, "ColumnParallelLinear out_features" + (f" / stride {stride}" if stride > 1 else ""))
    return sizes


def padded_vocab_size(vocab_size: int, tp_size: int, multiple: int = 128) -> int:
    """Smallest size ≥ ``vocab_size`` divisible by ``multiple * tp_size`` (Megatron's vocabulary padding)."""
    if vocab_size < 1 or tp_size < 1 or multiple < 1:
        raise ValueError(f"vocab_size={vocab_size}, tp_size={tp_size}, multiple={multiple} must all be positive")
    m = multiple * tp_size
    return -(-vocab_size // m) * m


class ColumnParallelLinear(nn.Module):
    """``Y = X Aᵀ + b`` with ``A`` split by output rows: each rank computes ``out_features / tp`` columns of ``Y``.

    ``gather_output`` all-gathers ``Y`` along the last dimension (otherwise the output stays split, ready for a
    :class:`RowParallelLinear`). With ``sequence_parallel`` the input is ``[s / tp, b, h]`` and is all-gathered.
    ``stride`` > 1 splits each of ``stride`` equal blocks of the output separately (gate and up halves of a gated
    MLP stay paired on every rank); ``blocks`` does the same for blocks of the given sizes (a Mamba mixer's ``[z, x,
    B, C, dt]``: each rank's output is its part of every block, in order). ``pad_rows`` output rows at the end are padding (zero, never drawn: vocabulary
    padding of an output layer). ``skip_weight_allocation`` creates no weight: pass ``weight=`` to ``forward``
    (an output layer tied to the embedding).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp: Group,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        seed: int | None = None,
        stride: int = 1,
        blocks: Sequence[int] | None = None,
        pad_rows: int = 0,
        skip_weight_allocation: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: sequence_parallel and gather_output cannot both be set")
        if pad_rows and (stride != 1 or blocks is not None):
            raise ValueError("ColumnParallelLinear: pad_rows needs stride=1 and no blocks")
        self.in_features, self.out_features = in_features, out_features
        self.tp, self.gather_output = tp, gather_output
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.blocks = _column_blocks(out_features, stride, blocks, tp.size)
        self.out_per_rank = sum(self.blocks) // tp.size
        real = (out_features - pad_rows, in_features)
        self.weight: nn.Parameter | None
        if skip_weight_allocation:
            self.register_parameter("weight", None)
        else:
            self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, dtype=dtype, device=device))
            set_tp_attributes(self.weight, 0, real, stride, blocks)
            init = init_method or normal_init()
            init_sharded_(self.weight, real, 0, tp.rank, tp.size, init, seed, pad_rows, stride, blocks)
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.zeros(self.out_per_rank, dtype=dtype, device=device))
            set_tp_attributes(self.bias, 0, real[:1], stride, blocks)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        if weight is None:
            raise ValueError("ColumnParallelLinear was built with skip_weight_allocation: pass weight= to forward")
        # weight-gradient accumulation into main_grad (DDP's gradient_accumulation_fusion) only for an owned weight:
        # a weight passed in (the tied output layer) gets gradients from elsewhere too
        fuse = self.training and self.weight is not None and weight is self.weight and fuses_wgrad(self.weight)
        if self.sequence_parallel:
            y = sequence_parallel_linear(x, weight, self.bias, self.tp, fuse)
        else:
            y = linear(copy_to_tp_region(x, self.tp), weight, self.bias, fuse)
        return gather_from_tp_region(y, self.tp) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features} (per rank {self.out_per_rank}), tp={self.tp.size}, "
            f"bias={self.bias is not None}, gather_output={self.gather_output}, sp={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """``Y = X Aᵀ + b`` with ``A`` split by input columns: each rank holds ``in_features / tp`` of them.

    The partial products are summed across the TP group (reduce-scattered along the sequence with
    ``sequence_parallel``); the bias is added once, after the reduction. ``input_is_parallel=False`` splits a
    replicated input first.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp: Group,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        seed: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel and tp.size > 1:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.tp, self.input_is_parallel = tp, input_is_parallel
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.in_per_rank = _divide(in_features, tp.size, "RowParallelLinear in_features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, dtype=dtype, device=device))
        set_tp_attributes(self.weight, 1, (out_features, in_features))
        init_sharded_(self.weight, (out_features, in_features), 1, tp.rank, tp.size, init_method or normal_init(), seed)
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
            self.bias.sequence_parallel = self.sequence_parallel  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp)
        fuse = self.training and fuses_wgrad(self.weight)
        if self.sequence_parallel:
            y = sequence_parallel_row_linear(x, self.weight, self.tp, fuse)
        else:
            y = reduce_from_tp_region(linear(x, self.weight, None, fuse), self.tp)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features} (per rank {self.in_per_rank}), out={self.out_features}, tp={self.tp.size}, "
            f"bias={self.bias is not None}, sp={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows across the TP group.

    The table is padded to :func:`padded_vocab_size` rows (padding rows are zero and never looked up). Each rank looks
    up the ids in its range and the results are summed across the group (reduce-scattered along dimension 0 with
    ``sequence_parallel``, so the input ids must then be ``[s, b]``). Ids must lie in ``[0, num_embeddings)``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp: Group,
        pad_to_multiple_of: int = 128,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        seed: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tp = num_embeddings, embedding_dim, tp
        self.padded_num_embeddings = padded_vocab_size(num_embeddings, tp.size, pad_to_multiple_of)
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.rows_per_rank = self.padded_num_embeddings // tp.size
        self.vocab_start = tp.rank * self.rows_per_rank
        self.vocab_end = self.vocab_start + self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim, dtype=dtype, device=device))
        set_tp_attributes(self.weight, 0, (num_embeddings, embedding_dim))
        init_sharded_(
            self.weight,
            (num_embeddings, embedding_dim),
            0,
            tp.rank,
            tp.size,
            init_method or normal_init(),
            seed,
            padded_rows=self.padded_num_embeddings - num_embeddings,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            out = F.embedding(ids, self.weight)
        else:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local = (ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp_region(out, self.tp)
        return reduce_from_tp_region(out, self.tp)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings} (padded {self.padded_num_embeddings}, per rank {self.rows_per_rank}), "
            f"{self.embedding_dim}, tp={self.tp.size}, sp={self.sequence_parallel}"
        )


def allreduce_sequence_parallel_grads(module: nn.Module, tp: Group) -> None:
    """Sum, across the TP group, the gradients of parameters marked ``sequence_parallel`` (norms, row biases).

    Under sequence parallelism each rank sees a different chunk of the sequence, so these replicated parameters get
    only a partial gradient; call this after backward (the DDP wrapper does it for you).
    """
    if tp.size == 1:
        return
    grads = [p.grad for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    _comm.all_reduce(flat, tp)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
