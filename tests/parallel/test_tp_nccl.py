"""The TP parity checks of ``test_tp_layers`` on GPUs with NCCL (run through the device tool; skipped without GPUs)."""

from __future__ import annotations

import pytest
import torch

from mcore_parallel.testing import run_distributed
from tests.parallel import test_tp_layers as t

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpus = pytest.mark.skipif(GPUS < 2, reason="needs at least 2 CUDA GPUs")
TPS = [tp for tp in (2, 4, 8) if tp <= GPUS]
DTYPES = [torch.float32, torch.bfloat16]


@needs_gpus
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_tp_layers_nccl(tp: int, sp: bool, dtype: torch.dtype) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    run_distributed(t._column, tp, tp, sp, dtype, False, "cuda", backend="nccl")
    if not sp:
        run_distributed(t._column, tp, tp, sp, dtype, True, "cuda", backend="nccl")
        run_distributed(t._row, tp, tp, sp, dtype, False, "cuda", backend="nccl")
    run_distributed(t._row, tp, tp, sp, dtype, True, "cuda", backend="nccl")
    run_distributed(t._embedding, tp, tp, sp, dtype, "cuda", backend="nccl")
    for smoothing in (0.0, 0.1):
        run_distributed(t._cross_entropy, tp, tp, dtype, smoothing, "cuda", backend="nccl")


@needs_gpus
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("exchange", ["torch", "mcore"])
def test_sequence_parallel_linears_through_symmetric_memory(tp: int, dtype: torch.dtype, exchange: str) -> None:
    """``parallel.tp_comm=symmetric_memory`` / ``p2p``: PyTorch's fused all-gather-matmul / matmul-reduce-scatter
    ops, or mcore's exchange, on the GPUs' symmetric buffers give the float64 reference's outputs and gradients."""
    torch.backends.cuda.matmul.allow_tf32 = False
    for kind in ("column", "row"):
        run_distributed(t._symmetric, tp, kind, tp, dtype, "cuda", exchange, backend="nccl")


@needs_gpus
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_mcore_exchange_over_many_calls_on_gpus(tp: int, dtype: torch.dtype) -> None:
    """mcore's exchange on GPUs over many calls (both workspace slots reused, the workspace grown mid-run): the
    copies run on a side stream, so a missing wait between streams or ranks shows up here as wrong numbers."""
    torch.backends.cuda.matmul.allow_tf32 = False
    run_distributed(t._exchange_stack, tp, tp, dtype, "cuda", backend="nccl")
