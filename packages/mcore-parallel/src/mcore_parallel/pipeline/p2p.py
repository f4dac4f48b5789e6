"""Point-to-point exchange of activations and their gradients between neighbouring pipeline stages.

Every exchange is one ``torch.distributed.batch_isend_irecv`` of up to four operations (send to the next stage,
receive from the previous one, send to the previous stage, receive from the next one) that is waited on as a
whole. The receiver allocates its buffer from the shape and dtype the schedule already knows
(``(seq / tp if sequence parallel else seq, micro_batch, hidden)``), so nothing but the tensor itself is sent.
Neighbours wrap around (the previous stage of rank 0 is rank pp-1), which the interleaved schedule needs.

Forward activations travel with tag 0 and gradients with tag 1 (used by gloo; NCCL matches operations in order, and
every rank posts them in the same order: forward-direction operations first). ``timeout`` bounds each wait: a
stage that never sends makes its neighbour raise :class:`PipelineTimeoutError` naming the stage and the step
instead of hanging.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from mcore_parallel.errors import MCoreParallelError
from mcore_parallel.state import ParallelState

__all__ = ["P2PCommunicator", "PipelineTimeoutError"]

logger = logging.getLogger(__name__)

_FORWARD_TAG = 0
_BACKWARD_TAG = 1


class PipelineTimeoutError(MCoreParallelError, TimeoutError):
    """A pipeline send or receive did not complete in time (a neighbour stage is hung or the schedule is wrong)."""


class P2PCommunicator:
    """Batched sends and receives between this pipeline stage and its neighbours.

    ``context`` is a free-form description of the current step (set by the schedule, e.g. ``"forward of
    micro-batch 3, chunk 1"``) that appears in timeout errors.
    """

    def __init__(
        self,
        state: ParallelState,
        tensor_shape: tuple[int, ...],
        dtype: torch.dtype,
        *,
        timeout: float | None = None,
    ) -> None:
        self.state = state
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = state.device
        self.timeout = timeout
        self.context = ""
        self.group = state.pp.pg

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device, requires_grad=True)

    def _check(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if tuple(t.shape) != self.tensor_shape or t.dtype != self.dtype:
            raise ValueError(
                f"pipeline stage {self.state.pp.rank} tried to {what} a tensor of shape {tuple(t.shape)} and dtype "
                f"{t.dtype}, but the schedule was given tensor_shape={self.tensor_shape}, dtype={self.dtype}; the "
                "stage output must be [seq (/ tp with sequence parallelism), micro_batch, hidden]"
            )
        return t.detach().contiguous()

    def communicate(
        self,
        *,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One batched exchange; returns ``(tensor from prev, tensor from next)`` (``None`` where not received).

        Received tensors require grad (an activation from the previous stage is the input of this stage's autograd
        graph). Does nothing when the pipeline has one stage.
        """
        if self.state.pp.size == 1:
            return None, None
        prev_rank, next_rank = self.state.pp_prev_rank, self.state.pp_next_rank
        ops: list[dist.P2POp] = []
        from_prev = self._empty() if recv_prev else None
        from_next = self._empty() if recv_next else None
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, self._check(send_next, "send"), next_rank, self.group, _FORWARD_TAG))
        if from_prev is not None:
            ops.append(dist.P2POp(dist.irecv, from_prev.data, prev_rank, self.group, _FORWARD_TAG))
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, self._check(send_prev, "send"), prev_rank, self.group, _BACKWARD_TAG))
        if from_next is not None:
            ops.append(dist.P2POp(dist.irecv, from_next.data, next_rank, self.group, _BACKWARD_TAG))
        if not ops:
            return None, None
        reqs = dist.batch_isend_irecv(ops)
        for req in reqs:
            self._wait(req, ops)
        return from_prev, from_next

    def _wait(self, req: dist.Work, ops: list[dist.P2POp]) -> None:
        if self.timeout is None:
            req.wait()
            return
        try:
            req.wait(datetime.timedelta(seconds=self.timeout))
        except RuntimeError as e:
            kinds = ", ".join(f"{'send to' if o.op is dist.isend else 'recv from'} rank {o.peer}" for o in ops)
            raise PipelineTimeoutError(
                f"pipeline stage {self.state.pp.rank} (global rank {self.state.rank}) waited more than "
                f"{self.timeout:g} s in {self.context or 'a pipeline exchange'} ({kinds}); a neighbour stage is "
                f"hung or its schedule does not match this one: {e}"
            ) from e

    # Non-interleaved helpers: they skip the exchange that does not exist on the first / last stage.
    def recv_forward(self) -> torch.Tensor | None:
        if self.state.is_first_stage:
            return None
        return self.communicate(recv_prev=True)[0]

    def send_forward(self, output: torch.Tensor | None) -> None:
        if not self.state.is_last_stage and output is not None:
            self.communicate(send_next=output)

    def recv_backward(self) -> torch.Tensor | None:
        if self.state.is_last_stage:
            return None
        return self.communicate(recv_next=True)[1]

    def send_backward(self, input_grad: torch.Tensor | None) -> None:
        if not self.state.is_first_stage and input_grad is not None:
            self.communicate(send_prev=input_grad)

    def send_forward_recv_backward(self, output: torch.Tensor | None) -> torch.Tensor | None:
        if self.state.is_last_stage:
            return None
        return self.communicate(send_next=output, recv_next=True)[1]

    def send_backward_recv_forward(self, input_grad: torch.Tensor | None) -> torch.Tensor | None:
        if self.state.is_first_stage:
            return None
        return self.communicate(send_prev=input_grad, recv_prev=True)[0]
