"""Ring attention on GPUs through NCCL (one rank per GPU; run through the device tool, skipped without two GPUs):
cp2 (and cp4 with four GPUs), both K/V exchanges, MHA and GQA, bf16 through the flash blocks and float32 through the
exact blocks, output and every gradient against one-process causal attention in float64 of the same rounded
inputs."""

from __future__ import annotations

import pytest
import torch

from mcore_parallel import ParallelConfig, ParallelState
from mcore_parallel.context_parallel import cp_split
from mcore_parallel.testing import run_distributed
from tests.models.test_ring_attention import _reference

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpus = pytest.mark.skipif(GPUS < 2, reason="needs at least 2 CUDA GPUs")
S, B, HEADS, D = 512, 2, 8, 64


def _check(cp: int, groups: int, comm: str, dtype: torch.dtype) -> float:
    from mcore_models.transformer.ring_attention import fused_blocks, ring_attention

    torch.backends.cuda.matmul.allow_tf32 = False
    state = ParallelState.initialize(ParallelConfig(cp=cp))
    g = torch.Generator().manual_seed(5)
    full = [torch.randn(S, B, n, D, generator=g).to(dtype).double().requires_grad_() for n in (HEADS, groups, groups)]
    dout = torch.randn(S, B, HEADS * D, generator=g).to(dtype).double()
    want = _reference(*full)
    want.backward(dout)
    local = [cp_split(t.detach(), state.cp, dim=0).to("cuda", dtype).requires_grad_() for t in full]
    probe = local[0].permute(1, 2, 0, 3)[:, :, None]
    assert fused_blocks(probe) == (dtype == torch.bfloat16)  # bf16: flash blocks; float32: exact blocks
    got = ring_attention(*local, state.cp, comm)
    got.backward(cp_split(dout, state.cp, dim=0).to("cuda", dtype))
    worst = 0.0
    for a, b in [(got, want), *((lt.grad, t.grad) for lt, t in zip(local, full, strict=True))]:
        assert a is not None and b is not None
        b = cp_split(b.detach(), state.cp, dim=0)
        worst = max(worst, float((a.double().cpu() - b).abs().max() / b.abs().max()))
    return worst


@needs_gpus
@pytest.mark.parametrize("cp", [c for c in (2, 4) if c <= GPUS])
@pytest.mark.parametrize("comm", ["p2p", "allgather"])
@pytest.mark.parametrize("groups", [HEADS, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16-flash", "fp32-exact"])
def test_ring_attention_through_nccl(cp: int, comm: str, groups: int, dtype: torch.dtype) -> None:
    worst = run_distributed(_check, cp, cp, groups, comm, dtype, backend="nccl")
    assert max(worst) < (2e-2 if dtype == torch.bfloat16 else 1e-4), worst
