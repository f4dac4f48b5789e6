"""The fused output projection + vocab-parallel cross-entropy against unfused references.

Single process in float64 against ``F.linear`` + ``F.cross_entropy`` over the unpadded columns (loss, hidden grad,
weight grad to 1e-10, including padding rows and label smoothing, for chunk sizes that do and do not divide the token
count); float32 against the existing ``vocab_parallel_cross_entropy``; bf16 loosely against float32; gloo TP 2 and 4
(with and without sequence parallelism) against the float64 reference; and a dispatch-mode check that no tensor of
more than ``chunk_tokens * V_local`` elements (beyond the hidden- and weight-sized gradients) is ever created, while
the unfused path does create the full ``[tokens, V_local]`` logits.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mcore_parallel import Group, ParallelConfig, ParallelState
from mcore_parallel.tensor import (
    copy_to_tp_region,
    gather_from_sp_region,
    linear_vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy,
)
from mcore_parallel.tensor._comm import all_gather
from mcore_parallel.testing import run_distributed

S, B, H = 8, 3, 8
V_PAD, VOCAB = 48, 30  # at TP 4 the last shard (rows 36..47) is all padding, the third one partly
F64: dict[str, Any] = dict(rtol=0.0, atol=1e-10)
BF16: dict[str, Any] = dict(rtol=3e-2, atol=3e-2)


def _data(seed: int, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 hidden [S, B, H], padded weight [V_PAD, H] (padding rows random: they must be ignored), targets, and
    a random per-token loss weight (so the incoming loss gradient is not uniform)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, dtype=torch.float64, generator=g)
    weight = 0.7 * torch.randn(V_PAD, H, dtype=torch.float64, generator=g)
    target = torch.randint(0, vocab, (S, B), generator=g)
    target[0, 0], target[0, 1] = 0, vocab - 1  # both ends of the vocabulary
    mask = torch.rand(S, B, dtype=torch.float64, generator=g) * (torch.rand(S, B, generator=g) > 0.2)
    return hidden, weight, target, mask


def _reference(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, vocab: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unfused loss, hidden grad and (padded) weight grad in the dtype of the inputs."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logits = F.linear(h, w)[..., :vocab]
    loss = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), reduction="none", label_smoothing=eps)
    loss = loss.view(target.shape)
    (loss * mask.to(loss.dtype)).sum().backward()
    assert h.grad is not None and w.grad is not None
    return loss.detach(), h.grad, w.grad


def _fused(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor,
    tp: Group,
    vocab: int | None,
    eps: float,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss = linear_vocab_parallel_cross_entropy(
        h, w, target, tp, vocab_size=vocab, label_smoothing=eps, chunk_tokens=chunk
    )
    (loss * mask.to(loss.dtype)).sum().backward()
    assert h.grad is not None and w.grad is not None
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 7, 1000], ids=["chunk1", "chunk7", "chunk-all"])
@pytest.mark.parametrize("eps", [0.0, 0.1], ids=["no-smoothing", "smoothing"])
@pytest.mark.parametrize("vocab", [VOCAB, None], ids=["padded", "unpadded"])
def test_matches_float64_reference(chunk: int, eps: float, vocab: int | None) -> None:
    hidden, weight, target, mask = _data(11 + chunk, VOCAB if vocab else V_PAD)
    loss, gh, gw = _fused(hidden, weight, target, mask, Group.single("tp"), vocab, eps, chunk)
    ref_loss, ref_gh, ref_gw = _reference(hidden, weight, target, mask, vocab or V_PAD, eps)
    assert loss.dtype == torch.float64 and loss.shape == (S, B)
    assert gh.dtype == torch.float64 and gw.dtype == torch.float64
    torch.testing.assert_close(loss, ref_loss, **F64)
    torch.testing.assert_close(gh, ref_gh, **F64)
    torch.testing.assert_close(gw, ref_gw, **F64)
    if vocab is not None:
        assert torch.all(gw[vocab:] == 0)  # padding rows get exactly zero gradient


@pytest.mark.parametrize("eps", [0.0, 0.1], ids=["no-smoothing", "smoothing"])
def test_float32_matches_unfused_vocab_parallel_cross_entropy(eps: float) -> None:
    hidden, weight, target, mask = (t.float() if t.is_floating_point() else t for t in _data(3))
    tp = Group.single("tp")
    loss, gh, gw = _fused(hidden, weight, target, mask, tp, VOCAB, eps, 5)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    ref = vocab_parallel_cross_entropy(F.linear(h, w), target, tp, vocab_size=VOCAB, label_smoothing=eps)
    (ref * mask).sum().backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, h.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-5)


def _bf16_check(device: str) -> None:
    hidden, weight, target, mask = _data(5)
    hb, wb = hidden.to(device, torch.bfloat16), weight.to(device, torch.bfloat16)
    target, mask = target.to(device), mask.to(device)
    for eps in (0.0, 0.1):
        loss, gh, gw = _fused(hb, wb, target, mask, Group.single("tp"), VOCAB, eps, 7)
        ref_loss, ref_gh, ref_gw = _reference(hb.float(), wb.float(), target, mask, VOCAB, eps)
        assert loss.dtype == torch.float32 and gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
        torch.testing.assert_close(loss, ref_loss, **BF16)
        torch.testing.assert_close(gh.float(), ref_gh, **BF16)
        torch.testing.assert_close(gw.float(), ref_gw, **BF16)


def test_bf16_matches_float32_reference() -> None:
    _bf16_check("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    _bf16_check("cuda")
    hidden, weight, target, mask = (t.cuda() for t in _data(9))
    for eps in (0.0, 0.1):
        got = _fused(hidden, weight, target, mask, Group.single("tp"), VOCAB, eps, 7)
        for a, e in zip(got, _reference(hidden, weight, target, mask, VOCAB, eps)):
            torch.testing.assert_close(a, e, **F64)


def _distributed(tp: int, sp: bool, eps: float) -> None:
    state = ParallelState.initialize(ParallelConfig(tp=tp, sequence_parallel=sp))
    r, n = state.tp.rank, state.tp.size
    hidden, weight, target, mask = _data(100 + tp)
    ref_loss, ref_gh, ref_gw = _reference(hidden, weight, target, mask, VOCAB, eps)

    w_local = weight.chunk(n, 0)[r].clone().requires_grad_()
    if sp:  # this rank's sequence chunk, all-gathered; backward reduce-scatters the partial hidden grads
        h_local = hidden.chunk(n, 0)[r].clone().requires_grad_()
        x = gather_from_sp_region(h_local, state.tp, tensor_parallel_output_grad=True)
    else:  # replicated; backward all-reduces the partial hidden grads
        h_local = hidden.clone().requires_grad_()
        x = copy_to_tp_region(h_local, state.tp)
    loss = linear_vocab_parallel_cross_entropy(
        x, w_local, target, state.tp, vocab_size=VOCAB, label_smoothing=eps, chunk_tokens=5
    )
    (loss * mask).sum().backward()
    assert h_local.grad is not None and w_local.grad is not None
    torch.testing.assert_close(loss.detach(), ref_loss, **F64)
    torch.testing.assert_close(h_local.grad, ref_gh.chunk(n, 0)[r] if sp else ref_gh, **F64)
    torch.testing.assert_close(all_gather(w_local.grad, state.tp, 0), ref_gw, **F64)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("eps", [0.0, 0.1], ids=["no-smoothing", "smoothing"])
def test_tensor_parallel_matches_reference(tp: int, sp: bool, eps: float) -> None:
    run_distributed(_distributed, tp, tp, sp, eps)


class _RecordSizes(TorchDispatchMode):
    """Records (op, numel, dtype) of every tensor an op returns, separately for the current ``phase``."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.seen: dict[str, list[tuple[str, int, torch.dtype]]] = {"forward": [], "backward": []}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.seen[self.phase].append((str(func), t.numel(), t.dtype))
        return out


def _record(fn: Any, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[_RecordSizes, list[int]]:
    """Run ``fn(h, w)`` forward and backward under the recorder; also return the sizes of tensors saved for
    backward."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    rec = _RecordSizes()
    with rec, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(h, w)
        rec.phase = "backward"
        loss.sum().backward()
    return rec, saved


def test_memory_never_holds_more_than_a_chunk_of_logits() -> None:
    n_tok, h_size, v_local, vocab, chunk = 64, 8, 96, 90, 8
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n_tok, h_size, generator=g)
    weight = torch.randn(v_local, h_size, generator=g)
    target = torch.randint(0, vocab, (n_tok,), generator=g)
    tp = Group.single("tp")
    chunk_logits = chunk * v_local
    limit = max(chunk_logits, weight.numel(), hidden.numel())
    full_logits = n_tok * v_local
    assert full_logits > 4 * limit  # the sizes make the check meaningful

    def fused(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return linear_vocab_parallel_cross_entropy(
            h, w, target, tp, vocab_size=vocab, label_smoothing=0.1, chunk_tokens=chunk
        )

    def unfused(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(F.linear(h, w), target, tp, vocab_size=vocab, label_smoothing=0.1)

    rec, saved = _record(fused, hidden, weight)
    for phase in ("forward", "backward"):
        mms = [s for s in rec.seen[phase] if "mm" in s[0]]
        assert len(mms) >= n_tok // chunk, f"{phase}: the recorder did not see the chunked matmuls"
        too_big = [s for s in rec.seen[phase] if s[1] > limit]
        assert not too_big, f"{phase} created tensors over {limit} elements: {too_big}"
    assert max(s[1] for s in rec.seen["backward"] if "mm" in s[0]) <= limit
    assert max(saved) <= limit and sum(saved) <= hidden.numel() + weight.numel() + 2 * n_tok

    rec, saved = _record(unfused, hidden, weight)
    biggest = max(s[1] for s in rec.seen["forward"] if s[2] == torch.float32)
    assert biggest >= full_logits, "the unfused path should materialise the full float32 logits"
    assert max(saved) >= full_logits


def test_argument_errors() -> None:
    tp = Group.single("tp")
    h, w, t = torch.zeros(2, 3, 4), torch.zeros(8, 4), torch.zeros(2, 3, dtype=torch.long)
    fn = linear_vocab_parallel_cross_entropy
    with pytest.raises(ValueError, match="must equal weight.shape"):
        fn(h, torch.zeros(8, 5), t, tp)
    with pytest.raises(ValueError, match="weight \\[V_local, h\\]"):
        fn(h, torch.zeros(8), t, tp)
    with pytest.raises(ValueError, match="target shape"):
        fn(h, w, torch.zeros(3, 2, dtype=torch.long), tp)
    with pytest.raises(ValueError, match="integer token ids"):
        fn(h, w, torch.zeros(2, 3), tp)
    with pytest.raises(ValueError, match="dtype"):
        fn(h, w.double(), t, tp)
    with pytest.raises(ValueError, match="vocab_size=9 must be in"):
        fn(h, w, t, tp, vocab_size=9)
    with pytest.raises(ValueError, match="vocab_size=0 must be in"):
        fn(h, w, t, tp, vocab_size=0)
    with pytest.raises(ValueError, match="label_smoothing=1.0"):
        fn(h, w, t, tp, label_smoothing=1.0)
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        fn(h, w, t, tp, chunk_tokens=0)
