"""Gradient-accumulation fusion under activation recompute: the fused weight gradient lands in the parameter's
``main_grad`` when ``torch.utils.checkpoint`` re-runs the forward.

The checkpoint's backward unpacks the tensors saved by the re-run forward, which it stores detached: a weight taken
from ``ctx.saved_tensors`` then has none of the parameter's attributes (``main_grad``), which failed with
``AttributeError: 'Tensor' object has no attribute 'main_grad'`` (``model.recompute=full`` with
``parallel.gradient_accumulation_fusion=true``). Every linear autograd function of ``mcore_parallel.tensor`` is covered:
the plain one (tp1), the overlapped sequence-parallel pair (tp2 + SP, NCCL-style collectives on gloo) and the
symmetric-memory pair (tp2 + SP through mcore's exchange, which runs on CPU too).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from mcore_parallel import ParallelConfig, ParallelState
from mcore_parallel.tensor import ColumnParallelLinear, RowParallelLinear, with_symmetric_memory
from mcore_parallel.testing import run_distributed

S, B, H, F = 8, 2, 16, 24


def _block(state: ParallelState, sp: bool) -> tuple[ColumnParallelLinear, RowParallelLinear]:
    up = ColumnParallelLinear(H, F, tp=state.tp, sequence_parallel=sp, bias=True, seed=1).train()
    down = RowParallelLinear(F, H, tp=state.tp, sequence_parallel=sp, bias=False, seed=2).train()
    return up, down


def _run(up: ColumnParallelLinear, down: RowParallelLinear, x: torch.Tensor, g: torch.Tensor, recompute: bool) -> None:
    def f(t: torch.Tensor) -> torch.Tensor:
        return down(torch.nn.functional.gelu(up(t)))

    y = checkpoint(f, x, use_reentrant=False) if recompute else f(x)
    (y * g).sum().backward()


def _check(tp: int, exchange: str | None, recompute: bool) -> None:
    sp = tp > 1
    state = ParallelState.initialize(ParallelConfig(tp=tp, sequence_parallel=sp))
    if exchange is not None:
        state = dataclasses.replace(state, tp=with_symmetric_memory(state.tp, exchange=exchange))
    torch.manual_seed(0)
    x_full, g_full = torch.randn(S, B, H), torch.randn(S, B, H)
    x, g = (t.chunk(tp, 0)[state.tp.rank] if sp else t for t in (x_full, g_full))

    plain = _block(state, sp)
    _run(*plain, x.clone().requires_grad_(), g, recompute=False)

    fused = _block(state, sp)
    weights = [m.weight for m in fused]
    for w in weights:
        assert w is not None
        w.main_grad = torch.full_like(w, 0.25)  # what DDP attaches, holding an earlier micro-batch
        w.fuse_wgrad_accumulation = True
    for _ in range(2):  # two micro-batches accumulate
        _run(*fused, x.clone().requires_grad_(), g, recompute)
        for w in weights:
            assert w is not None and w.grad_added_to_main_grad, "the flag must be on the parameter, for DDP's hook"
            w.grad, w.grad_added_to_main_grad = None, False
    for p, q in zip(plain, fused, strict=True):
        assert p.weight is not None and p.weight.grad is not None
        torch.testing.assert_close(q.weight.main_grad, 0.25 + 2 * p.weight.grad, rtol=1e-5, atol=1e-5)  # type: ignore[union-attr]
    assert fused[0].bias is not None and plain[0].bias is not None and plain[0].bias.grad is not None
    torch.testing.assert_close(fused[0].bias.grad, 2 * plain[0].bias.grad)  # unfused: autograd accumulates it


@pytest.mark.parametrize("recompute", [False, True], ids=["eager", "recompute"])
def test_fused_wgrad_tp1(recompute: bool) -> None:
    _check(1, None, recompute)


@pytest.mark.parametrize("exchange", [None, "mcore"], ids=["collectives", "p2p"])
@pytest.mark.parametrize("recompute", [False, True], ids=["eager", "recompute"])
def test_fused_wgrad_tp2_sequence_parallel(exchange: Any, recompute: bool) -> None:
    run_distributed(_check, 2, 2, exchange, recompute)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_bf16_wgrad_under_recompute_on_cuda() -> None:
    """The CUDA path: bf16 products accumulated into the float32 ``main_grad`` by the GEMM, under checkpoint."""
    state = ParallelState.initialize(ParallelConfig(), device="cuda")
    torch.manual_seed(0)
    x, g = torch.randn(S, B, H, device="cuda"), torch.randn(S, B, H, device="cuda")
    plain = [m.to("cuda") for m in _block(state, False)]
    _run(*plain, x.clone().requires_grad_(), g, recompute=False)
    fused = [m.to(device="cuda", dtype=torch.bfloat16) for m in _block(state, False)]
    for m in fused:
        m.weight.main_grad = torch.zeros_like(m.weight, dtype=torch.float32)
        m.weight.fuse_wgrad_accumulation = True
    _run(*fused, x.bfloat16().requires_grad_(), g.bfloat16(), recompute=True)
    for p, q in zip(plain, fused, strict=True):
        assert q.weight.grad_added_to_main_grad and q.weight.main_grad.dtype == torch.float32
        torch.testing.assert_close(q.weight.main_grad, p.weight.grad, rtol=3e-2, atol=3e-2)
