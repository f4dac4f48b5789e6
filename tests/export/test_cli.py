"""The ``mcore-export`` command line: each subcommand end to end, errors as exit code 2 with a message."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_export.cli import main, parse_size
from mcore_models.checkpoint import model_config_from_checkpoint
from tests.export._helpers import gpt2, llama, save


def test_hf_import_and_trtllm_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = save(llama(), tmp_path / "run")
    assert main(["hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--dtype", "fp32",
                 "--max-shard-size", "10KB"]) == 0  # fmt: skip
    assert capsys.readouterr().out.strip() == str(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert main(["import-hf", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"), "--tp", "2"]) == 0
    assert model_config_from_checkpoint(tmp_path / "ckpt").hidden_size == 32
    assert main(["trtllm", "--checkpoint", str(ckpt), "--out", str(tmp_path / "trt"), "--tp", "2", "--pp", "2",
                 "--dtype", "fp16"]) == 0  # fmt: skip
    cfg = json.loads((tmp_path / "trt" / "config.json").read_text())
    assert cfg["dtype"] == "float16" and cfg["mapping"]["world_size"] == 4
    assert sorted(p.name for p in (tmp_path / "trt").glob("rank*.safetensors")) == [
        f"rank{r}.safetensors" for r in range(4)
    ]


def test_errors_exit_2_with_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = save(gpt2(), tmp_path / "run")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "f").write_text("x")
    assert main(["hf", "--checkpoint", str(ckpt), "--out", str(tmp_path / "busy")]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["hf", "--checkpoint", str(ckpt), "--out", str(tmp_path / "busy"), "--overwrite"]) == 0
    assert main(["trtllm", "--checkpoint", str(ckpt), "--out", str(tmp_path / "t"), "--tp", "3"]) == 2
    assert "tp=3" in capsys.readouterr().err
    assert main(["hf", "--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    assert main(["import-hf", "--model", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o").exists() and not (tmp_path / "t").exists()


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500mb") == 5 * 10**8 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("1234") == 1234
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("5 parsecs")


def test_console_script_is_installed() -> None:
    exe = shutil.which("mcore-export") or str(Path(sys.executable).parent / "mcore-export")
    if not Path(exe).exists():
        pytest.skip("console script not on PATH")
    result = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True)
    assert "import-hf" in result.stdout and "trtllm" in result.stdout
