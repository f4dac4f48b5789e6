"""``data.packing=true`` through the real training loop (CPU, gloo, float32, mock documents packed into rows): it
trains, attention really stays inside documents (the loss differs from unpacked), tp2 + SP and pp2 train like one
process, compiled layers like eager, and Mamba layers are refused."""

from __future__ import annotations

import pytest
import torch

from mcore_parallel.testing import run_distributed
from mcore_train import ConfigError, load_config, pretrain
from mcore_train.trainer import setup

from ._util import config

PACKED = ["data.packing=true", "data.eod_mask_loss=true", "training.train_iters=3", "training.device=cpu"]


def _losses(overrides: list[str]) -> list[float]:
    return pretrain(config(*overrides)).losses


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return _losses(PACKED)


def test_packed_batches_carry_documents_and_train(reference: list[float]) -> None:
    run = setup(config(*PACKED))
    batch = next(run.train_iterators()[0])
    assert batch["document_ids"].shape == batch["tokens"].shape and int(batch["document_ids"].max()) > 0
    pos, docs = batch["position_ids"], batch["document_ids"]
    assert torch.all(pos[:, 1:][docs[:, 1:] != docs[:, :-1]] == 0)  # positions restart at each document
    assert len(reference) == 3 and all(x == x for x in reference) and reference[-1] < reference[0]
    unpacked = _losses([p for p in PACKED if p != "data.packing=true"])
    assert unpacked[0] != pytest.approx(reference[0], abs=1e-6)  # the mask changed what attention sees


LAYOUTS = {
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pp=2"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_packed_layouts_train_like_one_process(name: str, reference: list[float]) -> None:
    got = run_distributed(_losses, 2, [*PACKED, *LAYOUTS[name]], timeout=300)[0]
    assert got == pytest.approx(reference, rel=1e-5, abs=1e-6), name


def test_packed_recompute_and_compiled_layers_train_like_eager(reference: list[float]) -> None:
    assert _losses([*PACKED, "model.recompute=full"]) == pytest.approx(reference, rel=1e-5, abs=1e-6)
    torch._dynamo.reset()
    assert _losses([*PACKED, "training.compile=layers"]) == pytest.approx(reference, rel=1e-5, abs=1e-5)


def test_packing_refuses_mamba_layers() -> None:
    cfg = load_config(recipe="hybrid-tiny", overrides=["data.mock=true", "data.seq_length=16", *PACKED[:2],
                                                       "training.device=cpu"])  # fmt: skip
    with pytest.raises(ConfigError, match="data.packing"):
        setup(cfg)
