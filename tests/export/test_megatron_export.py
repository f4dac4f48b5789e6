"""``mcore-export megatron``: an mcore checkpoint as a Megatron-Core ``torch_dist`` checkpoint.

Round trips: Megatron fixture -> ``import-megatron`` -> mcore -> ``megatron`` -> (a) read back with PyTorch's
distributed-checkpoint reader and imported again, (b) loaded by megatron-core's own ``dist_checkpointing.load`` into
its GPT model (a subprocess: ``fixtures/megatron_forward.py``), both giving the fixture's recorded megatron logits.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mcore_export.cli import main
from mcore_export.megatron import export_megatron, import_megatron
from mcore_export.megatron.reader import open_checkpoint
from tests.export.test_megatron import FIXTURES, TOL, expected, mcore_logits

FORWARD = Path(__file__).parent / "fixtures" / "megatron_forward.py"


def _export(name: str, tmp: Path, tp: int) -> Path:
    ckpt = import_megatron(FIXTURES / name, tmp / "mcore")
    assert main(["megatron", "--checkpoint", str(ckpt), "--out", str(tmp / "megatron"), "--tp", str(tp)]) == 0
    return tmp / "megatron"


@pytest.mark.parametrize(("name", "tp"), [("gpt2_legacy_tp1", 2), ("llama_dist_tp1", 1), ("moe_dist_tp1", 1)])
def test_export_reads_back_as_the_same_model(name: str, tp: int, tmp_path: Path) -> None:
    out = _export(name, tmp_path, tp)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "0"
    ckpt = open_checkpoint(out)
    assert ckpt.format == "torch_dist" and ckpt.args.tensor_model_parallel_size == tp
    assert ckpt.tensors["embedding.word_embeddings.weight"].size[0] == 64  # Megatron's padded vocabulary
    assert ckpt.tensors["decoder.layers.self_attention.linear_qkv.weight"].size[0] == 2  # layers stacked
    again = import_megatron(out, tmp_path / "again")
    e = expected(name)
    got = mcore_logits(again, e["tokens"])
    torch.testing.assert_close(got, mcore_logits(tmp_path / "mcore", e["tokens"]), rtol=0, atol=0)  # bit for bit
    torch.testing.assert_close(got, e["logits"], **TOL)


def test_export_pads_the_vocabulary_for_tp(tmp_path: Path) -> None:
    ckpt = import_megatron(FIXTURES / "gpt2_legacy_tp1", tmp_path / "mcore", vocab_size=60)
    export_megatron(ckpt, tmp_path / "megatron", tp=4, make_vocab_size_divisible_by=48)
    meg = open_checkpoint(tmp_path / "megatron")
    assert meg.args.padded_vocab_size == 192
    assert meg.tensors["embedding.word_embeddings.weight"].size[0] == 192  # 60 -> the next multiple of 48 * 4
    rows = meg.read("embedding.word_embeddings.weight")
    assert rows[60:].abs().max() == 0


def test_bad_layout_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = import_megatron(FIXTURES / "gpt2_legacy_tp1", tmp_path / "mcore")
    code = main(["megatron", "--checkpoint", str(ckpt), "--out", str(tmp_path / "m"), "--tp", "3"])
    err = capsys.readouterr().err
    assert code == 2 and "tp=3" in err and "Traceback" not in err
    assert not (tmp_path / "m").exists()


def _megatron_core() -> str | None:
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return None
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:  # an unpacked wheel on PYTHONPATH
        import megatron.core

        return str(megatron.core.__version__)


MOE_NEEDS = (0, 17)  # megatron-core 0.16's MoE router calls Transformer Engine's GEMM unconditionally


@pytest.mark.skipif(_megatron_core() is None, reason="megatron-core is not installed (mcore-export's test extra)")
@pytest.mark.parametrize("name", ["gpt2_legacy_tp1", "llama_dist_tp1", "moe_dist_tp1"])
def test_megatron_core_loads_the_export(name: str, tmp_path: Path) -> None:
    version = tuple(int(x) for x in (_megatron_core() or "0.0").split(".")[:2])
    if name.startswith("moe") and version < MOE_NEEDS:
        pytest.skip(f"megatron-core {_megatron_core()}: its MoE forward needs Transformer Engine on CPU")
    out = _export(name, tmp_path, 2 if name.startswith("gpt2") else 1)
    e = expected(name)
    torch.save(e["tokens"], tmp_path / "tokens.pt")
    env = {**os.environ, "MASTER_PORT": str(29500 + os.getpid() % 400), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(FORWARD), str(out / "iter_0000000"), str(tmp_path / "tokens.pt"),
                          str(tmp_path / "logits.pt")], capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), e["logits"], **TOL)
