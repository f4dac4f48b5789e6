"""The runtime parity checks on GPUs with NCCL, each against the one-process run: on 2 GPUs tp2+SP, pp2 (1F1B and
interleaved), dp2 with the distributed optimizer (NCCL or peer-to-peer exchange) and dp2 all-reduce peer to peer; on
8 GPUs tp2·pp2·dp2, tp4·dp2 with SP, pp4 with
interleaving (vpp2) and dp8 with the distributed optimizer. Run through the device tool; skipped without the GPUs."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.test_pipeline_model import Spec, assert_matches_reference

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
ADAM = dict(optimizer="adam", lr=1e-2, clip_grad=0.3, adam_eps=1e-6)
CASES = {
    "tp2-sp": (Spec(tp=2, sp=True, micro=2, optimizer=ADAM), 2),
    "pp2-1f1b": (Spec(pp=2, micro=3, optimizer=ADAM), 2),
    "pp2xvpp2": (Spec(pp=2, vpp=2, micro=4, optimizer=ADAM), 2),
    "dp2-distopt": (Spec(micro=2, dist_opt=True, optimizer=ADAM), 2),
    "dp2-distopt-p2p": (Spec(micro=2, dist_opt=True, optimizer=ADAM, dp_exchange="p2p"), 2),
    "dp2-p2p": (Spec(micro=2, optimizer=ADAM, dp_exchange="p2p", bucket_size=1), 2),
    "tp2-pp2-dp2": (Spec(tp=2, pp=2, micro=3, optimizer=ADAM), 8),
    "tp4-dp2-sp": (Spec(tp=4, sp=True, micro=2, optimizer=ADAM), 8),
    "pp4xvpp2-dp2": (Spec(pp=4, vpp=2, layers=8, micro=8, optimizer=ADAM, steps=2), 8),
    "dp8-distopt": (Spec(micro=2, dist_opt=True, optimizer=ADAM), 8),
    "dp8-distopt-p2p": (Spec(micro=2, dist_opt=True, optimizer=ADAM, dp_exchange="p2p"), 8),
    "tp2-pp2-dp2-p2p": (Spec(tp=2, pp=2, micro=3, dist_opt=True, optimizer=ADAM, dp_exchange="p2p"), 8),
}


@pytest.mark.parametrize("name", list(CASES))
def test_runtime_parity_nccl(name: str) -> None:
    spec, world = CASES[name]
    if world > GPUS:
        pytest.skip(f"needs {world} CUDA GPUs, found {GPUS}")
    torch.backends.cuda.matmul.allow_tf32 = False
    assert_matches_reference(spec, world, rtol=1e-4, atol=1e-5, backend="nccl")
