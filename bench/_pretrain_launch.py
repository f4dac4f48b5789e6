"""Shared by the bench scripts that start ``mcore-train pretrain`` under torchrun and read its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def launch_pretrain(world: int, overrides: list[str], log_dir: Path, timeout: float) -> list[dict[str, Any]]:
    """Run ``torchrun -m mcore_train.cli pretrain`` on ``world`` processes; the logged records that carry a loss.

    Exits with the run's output tail when it fails.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "mcore_train.cli", "pretrain", *overrides, f"logging.dir={log_dir}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"launch failed ({' '.join(overrides)}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]
