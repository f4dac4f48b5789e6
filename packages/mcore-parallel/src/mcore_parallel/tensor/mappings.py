"""Autograd-correct communication at the edges of tensor- and sequence-parallel regions.

Tensor-parallel regions split the last (hidden) dimension; sequence-parallel regions split dimension 0, the
sequence dimension of mcore's ``[sequence, batch, hidden]`` activations. Each function is the identity when the
group has one member, so a TP=1 model pays nothing.

| function | forward | backward |
|---|---|---|
| ``copy_to_tp_region`` | identity | all-reduce |
| ``reduce_from_tp_region`` | all-reduce | identity |
| ``scatter_to_tp_region`` | split last dim | all-gather last dim |
| ``gather_from_tp_region`` | all-gather last dim | split last dim |
| ``scatter_to_sp_region`` | split dim 0 | all-gather dim 0 |
| ``gather_from_sp_region`` | all-gather dim 0 | reduce-scatter dim 0 (or split, see below) |
| ``reduce_scatter_to_sp_region`` | reduce-scatter dim 0 | all-gather dim 0 |
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore_parallel.state import Group
from mcore_parallel.tensor import _comm
from mcore_parallel.tensor.p2p import PeerWorkspace, gather_matmul, matmul_scatter
from mcore_parallel.tensor.wgrad import keep_owner as _keep_owner
from mcore_parallel.tensor.wgrad import weight_grad
from mcore_parallel.tensor.wgrad import wgrad_owner as _owner

__all__ = [
    "copy_to_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "gather_from_tp_region",
    "scatter_to_sp_region",
    "gather_from_sp_region",
    "reduce_scatter_to_sp_region",
    "sequence_parallel_linear",
    "sequence_parallel_row_linear",
    "SymmetricExchange",
    "with_symmetric_memory",
]


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _comm.all_reduce(g.clone(), ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _comm.all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _comm.split(x, group, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _comm.all_gather(g, ctx.group, ctx.dim), None, None


class _Gather(torch.autograd.Function):
    """All-gather forward; backward either splits (replicated consumers) or reduce-scatters (partial grads)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int, reduce_grad: bool) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.reduce_grad = group, dim, reduce_grad
        return _comm.all_gather(x, group, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.reduce_grad:
            return _comm.reduce_scatter(g, ctx.group, ctx.dim), None, None, None
        return _comm.split(g, ctx.group, ctx.dim), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _comm.reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _comm.all_gather(g, ctx.group, ctx.dim), None, None


def _other_rows(lo: int, hi: int, total: int) -> list[tuple[int, int]]:
    """The non-empty row ranges of ``[0, total)`` outside this rank's own ``[lo, hi)``."""
    return [(a, b) for a, b in ((0, lo), (hi, total)) if b > a]


class _LinearMainGrad(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose weight gradient is accumulated into ``weight.main_grad`` (see
    :func:`weight_grad`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        _keep_owner(ctx, weight, True)
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        grad_x = g.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = (
            weight_grad(_owner(ctx, weight), g2, x.reshape(-1, x.shape[-1]), True) if ctx.needs_input_grad[1] else None
        )
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fuse_wgrad: bool) -> torch.Tensor:
    """``F.linear``; with ``fuse_wgrad`` (training, a weight the layer owns) through :class:`_LinearMainGrad`,
    outside ``torch.compile`` graphs."""
    if fuse_wgrad and torch.is_grad_enabled():
        return _eager(_LinearMainGrad.apply, x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


class _SequenceParallelLinear(torch.autograd.Function):
    """``linear(all_gather_sequence(x), weight, bias)`` for a column-parallel layer under sequence parallelism, with
    the communication overlapped: in forward, this rank's own rows are multiplied while the other ranks' rows are
    gathered; in backward, the input gradient is reduce-scattered while the weight gradient is computed (the plain
    composition of gather and linear communicates, then computes, and in backward computes both GEMMs first)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group, fuse: bool
    ) -> torch.Tensor:
        full, handle = _comm.all_gather_start(x, group)
        y = torch.empty((full.shape[0], *x.shape[1:-1], weight.shape[0]), dtype=x.dtype, device=x.device)
        # 2-D views: rows of the sequence-major layout, this rank's rows first (while the others' arrive)
        x2, f2, y2 = x.reshape(-1, x.shape[-1]), full.view(-1, x.shape[-1]), y.view(-1, weight.shape[0])
        w_t = weight.t()

        def gemm(src: torch.Tensor, dst: torch.Tensor) -> None:
            if bias is None:
                torch.mm(src, w_t, out=dst)
            else:
                torch.addmm(bias, src, w_t, out=dst)

        lo, hi = group.rank * x2.shape[0], (group.rank + 1) * x2.shape[0]
        gemm(x2, y2[lo:hi])
        if handle is not None:
            handle.wait()
        for a, b in _other_rows(lo, hi, y2.shape[0]):
            gemm(f2[a:b], y2[a:b])
        ctx.save_for_backward(full, weight)
        ctx.group, ctx.has_bias, ctx.fuse = group, bias is not None, fuse
        _keep_owner(ctx, weight, fuse)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        full, weight = ctx.saved_tensors
        grad_x = handle = None
        if ctx.needs_input_grad[0]:
            grad_x, handle = _comm.reduce_scatter_start(g.matmul(weight), ctx.group)
        g2 = g.reshape(-1, g.shape[-1])
        full2 = full.reshape(-1, full.shape[-1])
        grad_w = weight_grad(_owner(ctx, weight), g2, full2, ctx.fuse) if ctx.needs_input_grad[1] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if handle is not None:
            handle.wait()
        return grad_x, grad_w, grad_b, None, None


class _SequenceParallelRowLinear(torch.autograd.Function):
    """``reduce_scatter_sequence(linear(x, weight))`` for a row-parallel layer under sequence parallelism, with the
    communication overlapped: in forward, the rows bound for each rank are multiplied and reduced to that rank in turn
    (the next block's GEMM runs while the previous block is reduced); in backward, this rank's rows of the input
    gradient are multiplied while the other ranks' output gradients are all-gathered. Every row is computed by one
    GEMM as in the plain composition, so the results are the same."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: Group, fuse: bool) -> torch.Tensor:
        if x.shape[0] % group.size:
            raise ValueError(f"dimension 0 of size {x.shape[0]} is not divisible by the group size {group.size}")
        x2 = x.reshape(-1, x.shape[-1])
        n = x2.shape[0] // group.size
        parts, handles = [], []
        for k in range(group.size):  # the same order on every rank: collectives must match
            part = torch.mm(x2[k * n : (k + 1) * n], weight.t())
            handles.append(dist.reduce(part, dst=group.ranks[k], group=group.pg, async_op=True))
            parts.append(part)
        for h in handles:
            h.wait()
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.fuse = group, fuse
        _keep_owner(ctx, weight, fuse)
        return parts[group.rank].view(x.shape[0] // group.size, *x.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        group = ctx.group
        full, handle = _comm.all_gather_start(g, group)
        g_own = g.reshape(-1, g.shape[-1])
        n = g_own.shape[0]
        lo, hi = group.rank * n, (group.rank + 1) * n
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous whatever x is
            gx2 = grad_x.view(-1, x.shape[-1])
            torch.mm(g_own, weight, out=gx2[lo:hi])  # while the other ranks' rows arrive
        if handle is not None:
            handle.wait()
        f2 = full.view(-1, g.shape[-1])
        if grad_x is not None:
            for a, b in _other_rows(lo, hi, f2.shape[0]):
                torch.mm(f2[a:b], weight, out=gx2[a:b])
        grad_w = (
            weight_grad(_owner(ctx, weight), f2, x.reshape(-1, x.shape[-1]), ctx.fuse)
            if ctx.needs_input_grad[1]
            else None
        )
        return grad_x, grad_w, None, None


@dataclass(frozen=True)
class SymmetricExchange:
    """How a group's sequence-parallel linears exchange through symmetric memory, carried by the group value
    (``Group.exchange``, set by :func:`with_symmetric_memory`): PyTorch's fused ops (traced by ``torch.compile`` when
    ``in_graph``) or, with a ``workspace``, mcore's own exchange (:mod:`.p2p`) behind the same signatures (``ops``)."""

    in_graph: bool
    workspace: PeerWorkspace | None = None
    ops: tuple[Any, Any] | None = None


def _mcore_ops(ws: PeerWorkspace) -> tuple[Any, Any]:
    """mcore's exchange with the signatures of ``symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``."""

    def gather(a: torch.Tensor, bs: list[torch.Tensor], dim: int, group_name: str, return_A: bool = True) -> Any:
        full, y = gather_matmul(ws, a, bs[0])
        return full, [y]

    def scatter(a: torch.Tensor, b: torch.Tensor, op: str, dim: int, group_name: str) -> torch.Tensor:
        return matmul_scatter(ws, a, b)

    return gather, scatter


EXCHANGES = ("torch", "mcore")


def with_symmetric_memory(group: Group, in_graph: bool = False, exchange: str = "torch", chunks: int = 2) -> Group:
    """``group`` with its sequence-parallel linears routed through symmetric memory: buffers of the group's GPUs
    that every rank can address, exchanged by peer-to-peer copies on the copy engines, pipelined with the GEMM, so
    the exchange does not compete with the GEMM's persistent kernels for SMs (with NCCL kernels, 2x H200 profiles
    showed the collectives serialised behind the GEMMs). GPUs of one host with peer access only; the results equal
    the NCCL path's up to summation order.

    Returns a new :class:`~mcore_parallel.Group` value carrying the exchange (``group.exchange``); layers built with it
    use the exchange, layers built with the original group keep the NCCL path. Nothing global changes (apart from
    PyTorch's own registration of the group for its symmetric-memory ops).

    ``exchange="torch"`` uses PyTorch's fused ops (``torch.ops.symm_mem.fused_all_gather_matmul`` /
    ``fused_matmul_reduce_scatter``, "async TP"); ``exchange="mcore"`` uses mcore's own (:mod:`mcore_parallel.tensor.
    p2p`: one barrier per exchange instead of three, no copy of the local shard on the compute stream; each peer's
    rows pulled in ``chunks`` pieces, each multiplied or added as it arrives). The mcore exchange also runs on CPU
    (shared-memory buffers over gloo), for tests.

    ``in_graph`` (PyTorch's ops only, experimental) lets ``torch.compile`` trace these linears into compiled layers
    (the fused ops are PyTorch custom ops with shape functions) instead of leaving the graph at each of them.
    """
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange={exchange!r} must be one of {', '.join(EXCHANGES)}")
    if chunks < 1:
        raise ValueError(f"chunks={chunks} must be at least 1")
    if in_graph and exchange != "torch":
        raise ValueError("in_graph=True traces PyTorch's fused ops: use exchange='torch'")
    if group.size == 1:
        return group
    if group.pg is None:
        raise ValueError(f"the {group.kind} group has no process group: symmetric memory needs torch.distributed")
    if exchange == "mcore":
        ws = PeerWorkspace(group, chunks)
        return dataclasses.replace(group, exchange=SymmetricExchange(False, ws, _mcore_ops(ws)))
    from torch.distributed import _symmetric_memory

    _symmetric_memory.enable_symm_mem_for_group(group.pg.group_name)
    return dataclasses.replace(group, exchange=SymmetricExchange(in_graph))


def _symmetric(group: Group) -> SymmetricExchange | None:
    ex = group.exchange
    return ex if isinstance(ex, SymmetricExchange) and group.pg is not None else None


def _fused_ops(ops: tuple[Any, Any] | None) -> tuple[Any, Any]:
    """(all-gather then matmul, matmul then reduce-scatter) with the signatures of the ``symm_mem`` ops: mcore's
    exchange (``ops``, also a seam for CPU tests) or PyTorch's."""
    return ops or (torch.ops.symm_mem.fused_all_gather_matmul, torch.ops.symm_mem.fused_matmul_reduce_scatter)


class _SymmetricColumnLinear(torch.autograd.Function):
    """``linear(all_gather_sequence(x), weight, bias)`` through the fused symmetric-memory ops (see
    :func:`with_symmetric_memory`); backward reduce-scatters the input gradient the same way."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        ops: tuple[Any, Any] | None,
        name: str,
        size: int,
        fuse: bool,
    ) -> torch.Tensor:
        gather_mm, _ = _fused_ops(ops)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # sequence-major rows: gathering rows gathers the sequence
        full, (y,) = gather_mm(x2, [weight.t()], 0, name, return_A=True)
        if bias is not None:
            y = y + bias
        ctx.save_for_backward(full, weight)
        ctx.ops, ctx.name, ctx.has_bias, ctx.x_shape, ctx.fuse = ops, name, bias is not None, x.shape, fuse
        _keep_owner(ctx, weight, fuse)
        return y.view(x.shape[0] * size, *x.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        full, weight = ctx.saved_tensors
        _, mm_scatter = _fused_ops(ctx.ops)
        g2 = g.reshape(-1, g.shape[-1]).contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = mm_scatter(g2, weight, "sum", 0, ctx.name).view(ctx.x_shape)
        grad_w = weight_grad(_owner(ctx, weight), g2, full, ctx.fuse) if ctx.needs_input_grad[1] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None


class _SymmetricRowLinear(torch.autograd.Function):
    """``reduce_scatter_sequence(linear(x, weight))`` through the fused symmetric-memory ops; backward all-gathers
    the output gradient while multiplying it."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, ops: tuple[Any, Any] | None, name: str, size: int, fuse: bool
    ) -> torch.Tensor:
        if x.shape[0] % size:
            raise ValueError(f"dimension 0 of size {x.shape[0]} is not divisible by the group size {size}")
        _, mm_scatter = _fused_ops(ops)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        y = mm_scatter(x2, weight.t(), "sum", 0, name)
        ctx.save_for_backward(x2, weight)
        ctx.ops, ctx.name, ctx.x_shape, ctx.fuse = ops, name, x.shape, fuse
        _keep_owner(ctx, weight, fuse)
        return y.view(x.shape[0] // size, *x.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, weight = ctx.saved_tensors
        gather_mm, _ = _fused_ops(ctx.ops)
        g2 = g.reshape(-1, g.shape[-1]).contiguous()
        full, (grad_x2,) = gather_mm(g2, [weight], 0, ctx.name, return_A=True)
        grad_x = grad_x2.view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        grad_w = weight_grad(_owner(ctx, weight), full, x2, ctx.fuse) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None, None, None


def sequence_parallel_row_linear(
    x: torch.Tensor, weight: torch.Tensor, group: Group, fuse_wgrad: bool = False
) -> torch.Tensor:
    """Row-parallel linear (no bias) of ``[s, b, in / tp]`` → this rank's sequence chunk ``[s / tp, b, out]`` of the
    sum over ``group``; equals ``reduce_scatter_to_sp_region(F.linear(x, weight), group)`` with the communication
    overlapped."""
    if group.size == 1:
        return linear(x, weight, None, fuse_wgrad)
    ex = _symmetric(group)
    if ex is not None:
        name = str(group.pg.group_name)  # type: ignore[union-attr]
        return _through(ex, _SymmetricRowLinear.apply, x, weight, ex.ops, name, group.size, fuse_wgrad)
    return _eager(_SequenceParallelRowLinear.apply, x, weight, group, fuse_wgrad)


def sequence_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group, fuse_wgrad: bool = False
) -> torch.Tensor:
    """Column-parallel linear of a sequence-parallel input ``[s / tp, b, h]`` → ``[s, b, out / tp]``; equals
    ``F.linear(gather_from_sp_region(x, group), weight, bias)`` with the backward communication overlapped."""
    if group.size == 1:
        return linear(x, weight, bias, fuse_wgrad)
    ex = _symmetric(group)
    if ex is not None:
        name = str(group.pg.group_name)  # type: ignore[union-attr]
        return _through(ex, _SymmetricColumnLinear.apply, x, weight, bias, ex.ops, name, group.size, fuse_wgrad)
    return _eager(_SequenceParallelLinear.apply, x, weight, bias, group, fuse_wgrad)


def _through(ex: SymmetricExchange, fn: Any, *args: Any) -> torch.Tensor:
    """A symmetric-memory linear: traced by ``torch.compile`` when its exchange is ``in_graph``, else eager."""
    return fn(*args) if ex.in_graph else _eager(fn, *args)


@torch.compiler.disable
def _eager(fn: Any, *args: Any) -> torch.Tensor:
    """Run a collective's autograd function outside ``torch.compile``: the compiled layers of
    ``training.compile=layers`` break their graphs here. Traced in-place collectives trained wrongly on GPUs (tp2 + SP
    on 2x H200: the loss stalled near its initial value, while gloo on CPU matched), so the collectives and their
    backward always run eagerly; the elementwise work between them is still compiled."""
    return fn(*args)


def copy_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a TP region with a replicated input: gradients from every rank are summed in backward."""
    return x if group.size == 1 else _eager(_Copy.apply, x, group)


def reduce_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a TP region by summing the partial results of every rank."""
    return x if group.size == 1 else _eager(_Reduce.apply, x, group)


def scatter_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's slice of the last dimension."""
    return x if group.size == 1 else _eager(_Split.apply, x, group, -1)


def gather_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Concatenate every rank's slice of the last dimension."""
    return x if group.size == 1 else _eager(_Gather.apply, x, group, -1, False)


def scatter_to_sp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's chunk of the sequence (dimension 0)."""
    return x if group.size == 1 else _eager(_Split.apply, x, group, 0)


def gather_from_sp_region(x: torch.Tensor, group: Group, tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather the sequence (dimension 0).

    With ``tensor_parallel_output_grad`` (the default, used in front of a column-parallel layer) the gradient arriving
    in backward is a per-rank partial sum and is reduce-scattered; otherwise it is already complete and only split.
    """
    return x if group.size == 1 else _eager(_Gather.apply, x, group, 0, tensor_parallel_output_grad)


def reduce_scatter_to_sp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum partial results over the group and keep this rank's chunk of the sequence (dimension 0)."""
    return x if group.size == 1 else _eager(_ReduceScatter.apply, x, group, 0)
