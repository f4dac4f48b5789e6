"""The main job (README quick start) runs under torchrun and matches the single-process run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("nproc,extra", [(2, []), (4, ["--no-sequence-parallel"])], ids=["tp2-sp", "tp4"])
def test_tp_demo_under_torchrun(nproc: int, extra: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += [str(ROOT / "examples" / "tp_demo.py"), "--steps", "25", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK: tensor-parallel training matches the single-process run" in proc.stdout
    assert f"tensor parallel size {nproc}" in proc.stdout
