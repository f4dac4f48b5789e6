"""``vocab_parallel_cross_entropy(fused=True)``: the loss as three compiled passes over the logits (row max, target
logit and normaliser, gradient) with eager all-reduces between them, against ``F.cross_entropy`` over the unpadded
vocabulary in float64 (one process, and gloo TP 2 and 4 where the last shard is all padding), and the unfused path in
bf16; what it keeps for backward (the logits, not a float32 softmax)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcore_parallel import Group, ParallelConfig, ParallelState
from mcore_parallel.tensor import vocab_parallel_cross_entropy
from mcore_parallel.tensor._comm import all_gather
from mcore_parallel.testing import run_distributed

S, B, V_PAD, VOCAB = 6, 3, 48, 30


def _data(seed: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(S, B, V_PAD, generator=g)).to(dtype)
    target = torch.randint(0, VOCAB, (S, B), generator=g)
    target[0, 0], target[0, 1] = 0, VOCAB - 1
    weight = torch.rand(S, B, generator=g, dtype=torch.float64)  # a non-uniform incoming loss gradient
    return logits, target, weight


def _reference(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.detach().double().requires_grad_()
    loss = F.cross_entropy(x[..., :VOCAB].reshape(-1, VOCAB), target.reshape(-1), reduction="none").view(S, B)
    (loss * weight).sum().backward()
    assert x.grad is not None
    return loss.detach(), x.grad


def _fused(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, tp: Group, **kw: object):  # type: ignore[no-untyped-def]
    x = logits.detach().clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(x, target, tp, vocab_size=VOCAB, **kw)  # type: ignore[arg-type]
    (loss * weight.to(loss.dtype)).sum().backward()
    assert x.grad is not None
    return loss.detach(), x.grad


def test_one_rank_matches_float64_reference() -> None:
    logits, target, weight = _data(1)
    loss, grad = _fused(logits, target, weight, Group.single("tp"), fused=True)
    ref_loss, ref_grad = _reference(logits, target, weight)
    assert loss.dtype == torch.float64 and grad.dtype == torch.float64
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-10)
    assert torch.all(grad[..., VOCAB:] == 0)  # padding columns get exactly zero gradient


def test_bf16_matches_the_unfused_path() -> None:
    logits, target, weight = _data(2, torch.bfloat16)
    tp = Group.single("tp")
    loss, grad = _fused(logits, target, weight, tp, fused=True)
    ref_loss, ref_grad = _fused(logits, target, weight, tp)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=1e-2, atol=1e-3)


def test_keeps_the_logits_not_a_float32_softmax_for_backward() -> None:
    logits, target, _ = _data(3, torch.bfloat16)
    saved: list[tuple[int, torch.dtype]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((t.numel(), t.dtype))
        return t

    for fused in (True, False):
        saved.clear()
        x = logits.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            vocab_parallel_cross_entropy(x, target, Group.single("tp"), vocab_size=VOCAB, fused=fused)
        big = [dtype for n, dtype in saved if n == logits.numel()]
        assert big == ([torch.bfloat16] if fused else [torch.float32]), (fused, saved)


def test_label_smoothing_is_refused() -> None:
    logits, target, _ = _data(4)
    with pytest.raises(ValueError, match="no label smoothing"):
        vocab_parallel_cross_entropy(logits, target, Group.single("tp"), label_smoothing=0.1, fused=True)


def _distributed(tp: int) -> None:
    state = ParallelState.initialize(ParallelConfig(tp=tp))
    r, n = state.tp.rank, state.tp.size
    logits, target, weight = _data(10 + tp)
    ref_loss, ref_grad = _reference(logits, target, weight)
    loss, grad = _fused(logits.chunk(n, -1)[r], target, weight, state.tp, fused=True)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-10)
    torch.testing.assert_close(all_gather(grad.contiguous(), state.tp, -1), ref_grad, rtol=0, atol=1e-10)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_float64_reference(tp: int) -> None:
    run_distributed(_distributed, tp, tp)
