"""Pipeline schedules: no pipelining, forward-only, 1F1B and interleaved 1F1B (virtual pipeline stages).

Entry point: :func:`forward_backward`. The protocol follows Megatron-Core:

- ``forward_step_func(data_iterator, model_chunk) -> (output_tensor, loss_func)``. Before calling it the schedule
  calls ``model_chunk.set_input_tensor(t)`` with the activation received from the previous stage (``None`` on the
  first stage, where the chunk embeds its own tokens).
- On the last stage ``loss_func(output_tensor) -> (loss, reported)``: ``loss`` is a scalar, ``reported`` a dict
  collected into the returned list (one per micro-batch). The schedule backpropagates ``loss / num_microbatches``
  (times ``grad_scale_func`` for fp16 loss scaling), so gradients are the mean over micro-batches; DDP then
  averages over data-parallel ranks.
- Chunks wrapped in :class:`~mcore_parallel.ddp.DistributedDataParallel` reduce nothing until the backward of their
  last micro-batch (``set_is_last_microbatch``); after the last backward the schedule calls ``finish_grad_sync()``
  on each (``finalize_grads=True``). Plain modules get their sequence-parallel and shared-embedding gradients
  summed instead.

Deadlocks: every exchange is a blocking batched send/receive. ``p2p_timeout`` (seconds) turns a wait that never
completes into :class:`~mcore_parallel.pipeline.p2p.PipelineTimeoutError` naming the stage and micro-batch; tests
also rely on the ``run_distributed`` timeout, which kills hung ranks.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mcore_parallel.pipeline.embedding import allreduce_shared_embedding_grads
from mcore_parallel.pipeline.p2p import P2PCommunicator
from mcore_parallel.state import ParallelState
from mcore_parallel.tensor.layers import allreduce_sequence_parallel_grads

__all__ = ["forward_backward", "LossFunc", "ForwardStepFunc"]

logger = logging.getLogger(__name__)

LossFunc = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]
ForwardStepFunc = Callable[[Any, nn.Module], tuple[torch.Tensor, LossFunc]]


class _Runner:
    """Runs forward and backward steps of micro-batches on model chunks; shared by every schedule."""

    def __init__(
        self,
        forward_step_func: ForwardStepFunc,
        data_iterator: Any,
        chunks: list[nn.Module],
        num_microbatches: int,
        forward_only: bool,
        grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None,
        p2p: P2PCommunicator,
    ) -> None:
        self.step_func, self.chunks, self.m = forward_step_func, chunks, num_microbatches
        self.forward_only, self.grad_scale_func, self.p2p = forward_only, grad_scale_func, p2p
        if isinstance(data_iterator, (list, tuple)):
            if len(data_iterator) != len(chunks):
                raise ValueError(
                    f"got {len(data_iterator)} data iterators for {len(chunks)} model chunks; pass one per chunk "
                    "(or a single object shared by all chunks)"
                )
            self.iters = list(data_iterator)
        else:
            self.iters = [data_iterator] * len(chunks)
        self.reported: list[dict[str, Any]] = []
        self.backward_count = [0] * len(chunks)

    def forward(self, c: int, x: torch.Tensor | None, mb: int, is_last_stage: bool) -> torch.Tensor:
        chunk = self.chunks[c]
        self.p2p.context = f"forward of micro-batch {mb}, chunk {c}"
        set_input = getattr(chunk, "set_input_tensor", None)
        if set_input is not None:
            set_input(x)
        elif x is not None:
            raise TypeError(
                f"model chunk {c} ({type(chunk).__name__}) receives activations from the previous pipeline stage but "
                "has no set_input_tensor(tensor) method; add one that makes forward use that tensor as its input"
            )
        output, loss_func = self.step_func(self.iters[c], chunk)
        if not is_last_stage:
            return output
        loss, reported = loss_func(output)
        self.reported.append(reported)
        if self.forward_only:
            return loss
        if loss.dim() != 0:
            raise ValueError(f"loss_func must return a scalar loss, got shape {tuple(loss.shape)}")
        loss = loss / self.m
        return self.grad_scale_func(loss) if self.grad_scale_func is not None else loss

    def backward(
        self, c: int, x: torch.Tensor | None, y: torch.Tensor, dy: torch.Tensor | None, mb: int
    ) -> torch.Tensor | None:
        self.p2p.context = f"backward of micro-batch {mb}, chunk {c}"
        self.backward_count[c] += 1
        set_last = getattr(self.chunks[c], "set_is_last_microbatch", None)
        if set_last is not None:
            set_last(self.backward_count[c] == self.m)
        if dy is None and y.dim() != 0:
            raise RuntimeError(f"internal schedule error: no output gradient for micro-batch {mb}, chunk {c}")
        torch.autograd.backward(y, grad_tensors=dy)
        return None if x is None else x.grad

    def begin(self) -> None:
        if not self.forward_only:
            for chunk in self.chunks:
                set_last = getattr(chunk, "set_is_last_microbatch", None)
                if set_last is not None:
                    set_last(False)

    def finalize(self, state: ParallelState) -> None:
        plain = []
        for chunk in self.chunks:
            finish = getattr(chunk, "finish_grad_sync", None)
            if finish is not None:
                finish()
            else:
                plain.append(chunk)
        for chunk in plain:
            allreduce_sequence_parallel_grads(chunk, state.tp)
        allreduce_shared_embedding_grads(plain, state)


def forward_backward(
    forward_step_func: ForwardStepFunc,
    data_iterator: Any,
    model_chunks: list[nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    state: ParallelState,
    dtype: torch.dtype = torch.float32,
    forward_only: bool = False,
    *,
    grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
    p2p_timeout: float | None = None,
    finalize_grads: bool = True,
) -> list[dict[str, Any]]:
    """Run ``num_microbatches`` forward (and backward) passes over this rank's model chunks.

    Picks the schedule from the layout: no pipelining when ``pp == 1``, interleaved 1F1B when more than one chunk is
    given (one per virtual stage, ``len(model_chunks) == vpp``), otherwise 1F1B. ``seq_length`` is the full sequence
    (divided by tp here under sequence parallelism), ``dtype`` that of the activations exchanged between stages.
    ``data_iterator`` is passed to ``forward_step_func`` as is, or one per chunk when it is a list. Returns the
    ``reported`` dicts of every micro-batch on the last stage, ``[]`` elsewhere.
    """
    if not model_chunks:
        raise ValueError("model_chunks is empty; pass this rank's model chunk(s)")
    pp, m = state.pp.size, num_microbatches
    if m < 1:
        raise ValueError(f"num_microbatches={m} must be >= 1")
    if pp > 1 and m < pp:
        raise ValueError(f"num_microbatches={m} must be >= the number of pipeline stages pp={pp}")
    if len(model_chunks) > 1 and pp == 1:
        raise ValueError(f"{len(model_chunks)} model chunks given without pipeline parallelism (pp=1); pass one")
    if len(model_chunks) > 1 and len(model_chunks) != state.vpp_size:
        raise ValueError(f"{len(model_chunks)} model chunks given but ParallelConfig.vpp={state.vpp_size}")
    if len(model_chunks) > 1 and m % pp:
        raise ValueError(
            f"the interleaved schedule needs num_microbatches ({m}) to be a multiple of pp ({pp}); use "
            f"{(m // pp + 1) * pp} or {max(pp, m // pp * pp)} micro-batches"
        )
    seq = seq_length // state.tp.size if state.sequence_parallel else seq_length
    if state.sequence_parallel and seq_length % state.tp.size:
        raise ValueError(f"seq_length={seq_length} must be divisible by tp={state.tp.size} under sequence parallelism")
    p2p = P2PCommunicator(state, (seq, micro_batch_size, hidden_size), dtype, timeout=p2p_timeout)
    run = _Runner(forward_step_func, data_iterator, list(model_chunks), m, forward_only, grad_scale_func, p2p)
    run.begin()
    ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
    with ctx:
        if pp == 1:
            _no_pipelining(run)
        elif len(model_chunks) == 1:
            _one_f_one_b(run, state, p2p)
        else:
            _interleaved(run, state, p2p)
    if not forward_only and finalize_grads:
        run.finalize(state)
    return run.reported


def _no_pipelining(run: _Runner) -> None:
    for mb in range(run.m):
        y = run.forward(0, None, mb, is_last_stage=True)
        if not run.forward_only:
            run.backward(0, None, y, None, mb)


def _one_f_one_b(run: _Runner, state: ParallelState, p2p: P2PCommunicator) -> None:
    m, last = run.m, state.is_last_stage
    warmup = m if run.forward_only else min(state.pp.size - state.pp.rank - 1, m)
    remaining = m - warmup
    saved: deque[tuple[torch.Tensor | None, torch.Tensor]] = deque()
    for mb in range(warmup):
        x = p2p.recv_forward()
        y = run.forward(0, x, mb, last)
        p2p.send_forward(y)
        if not run.forward_only:
            saved.append((x, y))
    x = p2p.recv_forward() if remaining else None
    for i in range(remaining):
        mb, final = warmup + i, i == remaining - 1
        y = run.forward(0, x, mb, last)  # forward_only never gets here: it runs every micro-batch as warm-up
        dy = p2p.send_forward_recv_backward(y)
        saved.append((x, y))
        bx, by = saved.popleft()
        dx = run.backward(0, bx, by, dy, i)
        if final:
            p2p.send_backward(dx)
        else:
            x = p2p.send_backward_recv_forward(dx)
    if not run.forward_only:
        for i in range(warmup):
            dy = p2p.recv_backward()
            bx, by = saved.popleft()
            p2p.send_backward(run.backward(0, bx, by, dy, remaining + i))


def _interleaved(run: _Runner, state: ParallelState, p2p: P2PCommunicator) -> None:
    """Megatron's interleaved 1F1B. Virtual micro-batch ``k`` runs chunk ``(k % (pp*vpp)) // pp`` (reversed for
    backward) on micro-batch ``(k // (pp*vpp)) * pp + k % pp``. Received tensors are matched to the virtual
    micro-batch that consumes them by order (each neighbour sends in the same order this rank consumes)."""
    pp, r, v, m = state.pp.size, state.pp.rank, len(run.chunks), run.m
    total, first, last = m * v, r == 0, r == pp - 1

    def chunk_of(k: int, forward: bool) -> int:
        c = (k % (pp * v)) // pp
        return c if forward else v - 1 - c

    def mb_of(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    if run.forward_only or m == pp:
        warmup = total
    else:
        warmup = min((pp - r - 1) * 2 + (v - 1) * pp, total)
    all_warmup, remaining = warmup == total, total - warmup
    fwd_need = deque(k for k in range(total) if not (first and chunk_of(k, True) == 0))
    bwd_need = deque(k for k in range(total) if not (last and chunk_of(k, False) == v - 1))
    inputs: dict[int, torch.Tensor] = {}
    grads: dict[int, torch.Tensor] = {}
    saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}

    def store(got: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
        if got[0] is not None:
            inputs[fwd_need.popleft()] = got[0]
        if got[1] is not None:
            grads[bwd_need.popleft()] = got[1]

    def fwd(k: int) -> torch.Tensor | None:
        c, mb = chunk_of(k, True), mb_of(k)
        x = inputs.pop(k, None)
        if (x is None) != (first and c == 0):
            raise RuntimeError(f"internal schedule error: input of micro-batch {mb}, chunk {c} on stage {r}")
        is_last = last and c == v - 1
        y = run.forward(c, x, mb, is_last)
        if not run.forward_only:
            saved[(c, mb)] = (x, y)
        return None if is_last else y

    def bwd(k: int) -> torch.Tensor | None:
        c, mb = chunk_of(k, False), mb_of(k)
        x, y = saved.pop((c, mb))
        dx = run.backward(c, x, y, grads.pop(k, None), mb)
        return None if (first and c == 0) else dx

    if not first:
        store(p2p.communicate(recv_prev=True))
    for k in range(warmup):
        y = fwd(k)
        recv_prev = not (first and chunk_of(k + 1, True) == 0) and k != total - 1
        if k == warmup - 1 and not run.forward_only and not all_warmup:
            store(p2p.communicate(send_next=y, recv_prev=recv_prev, recv_next=not last))
        else:
            store(p2p.communicate(send_next=y, recv_prev=recv_prev))
    for i in range(remaining):
        fk = i + warmup
        y = fwd(fk)
        dx = bwd(i)
        recv_prev = not (first and chunk_of(fk - (pp - 1), True) == v - 1) and i != remaining - 1
        recv_next = not (last and chunk_of(i - (pp - 1), False) == 0)
        store(p2p.communicate(send_next=y, send_prev=dx, recv_prev=recv_prev, recv_next=recv_next))
    if not run.forward_only:
        if all_warmup and not last:
            store(p2p.communicate(recv_next=True))
        for k in range(remaining, total):
            dx = bwd(k)
            recv_next = not (last and chunk_of(k + 1, False) == v - 1) and k != total - 1
            store(p2p.communicate(send_prev=dx, recv_next=recv_next))
    leftover = len(fwd_need) + len(inputs) + len(grads) + len(saved) + (0 if run.forward_only else len(bwd_need))
    if leftover:
        raise RuntimeError(
            f"internal schedule error on stage {r}: {len(fwd_need)} inputs and {len(bwd_need)} gradients never "
            f"arrived, {len(inputs) + len(grads)} arrived unused, {len(saved)} micro-batches without backward"
        )
