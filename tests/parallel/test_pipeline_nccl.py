"""The runtime parity checks on GPUs with NCCL: tp2, pp2 and dp2 with the distributed optimizer, each against the
one-process CPU run (run through the device tool on 2 GPUs; skipped without them)."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.test_pipeline_model import Spec, assert_matches_reference

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
ADAM = dict(optimizer="adam", lr=1e-2, clip_grad=0.3, adam_eps=1e-6)
CASES = {
    "tp2-sp": Spec(tp=2, sp=True, micro=2, optimizer=ADAM),
    "pp2-1f1b": Spec(pp=2, micro=3, optimizer=ADAM),
    "pp2xvpp2": Spec(pp=2, vpp=2, micro=4, optimizer=ADAM),
    "dp2-distopt": Spec(micro=2, dist_opt=True, optimizer=ADAM),
}


@pytest.mark.skipif(GPUS < 2, reason="needs at least 2 CUDA GPUs")
@pytest.mark.parametrize("name", list(CASES))
def test_runtime_parity_nccl(name: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    assert_matches_reference(CASES[name], 2, rtol=1e-4, atol=1e-5, backend="nccl")
