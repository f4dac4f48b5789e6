"""The README's main job, short: prepare the demo corpus, pretrain the tiny recipe, checkpoint, sample text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mcore_parallel.checkpoint import latest_checkpoint, read_metadata


def _cli(*args: str, cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, "-m", "mcore_train.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def test_demo_pretrain_end_to_end(tmp_path: Path) -> None:
    prefix = _cli("prepare-demo", "--out", str(tmp_path / "data"), "--max-files", "60", cwd=tmp_path).split()[-1]
    out = _cli("pretrain", "--recipe", "tiny", f"data.path={prefix}", f"checkpoint.dir={tmp_path / 'run'}",
               "training.train_iters=40", "training.global_batch_size=8", "training.eval_interval=20", "checkpoint.save_interval=20",
               "logging.log_interval=10", "training.generate_at_end=20", cwd=tmp_path)  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 8 and losses[-1] < losses[0] - 1.0, losses  # steps 1, 2, 4, 8, 10, ..., 40: the loss falls
    assert any("valid_loss" in r for r in records)
    meta = read_metadata(latest_checkpoint(tmp_path / "run"))
    assert meta["step"] == 40 and meta["model"]["num_layers"] == 4 and meta["tokenizer"]["kind"] == "byte"
    assert "sample (temperature " in out and "resolved configuration" in out
    # the trained checkpoint through the serving CLI (its engine flags parsed into an EngineConfig on the way)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    gen = subprocess.run([sys.executable, "-m", "mcore_infer.cli", "generate", "--checkpoint", str(tmp_path / "run"),
                          "--device", "cpu", "--decode-kernels", "attention", "--max-tokens", "8", "The ", "A"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert gen.returncode == 0, gen.stderr[-4000:]
    lines = gen.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith("'") and len(line) > 2 for line in lines), gen.stdout
