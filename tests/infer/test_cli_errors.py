"""``mcore-infer``: a user's mistake (a checkpoint that is missing or damaged, a bad engine option) is one message on
stderr and exit code 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcore_infer.cli import main
from mcore_models.checkpoint import save_weights
from mcore_parallel import ParallelState
from tests.infer._tiny import tiny_model


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(["generate", "--device", "cpu", "--max-tokens", "2", *argv, "hi"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def test_a_missing_checkpoint_is_one_message_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = _run(capsys, "--checkpoint", str(tmp_path / "nowhere"))
    assert rc == 2 and f"mcore-infer: error: {tmp_path / 'nowhere'}" in err


def test_a_damaged_checkpoint_names_the_chunk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save_weights(tiny_model(), ParallelState.initialize(), tmp_path)
    chunk = next(p for p in sorted((path / "model").rglob("c/*")) if p.is_file())
    chunk.unlink()
    rc, err = _run(capsys, "--checkpoint", str(path))
    assert rc == 2 and f"{chunk}: missing chunk" in err, err


def test_a_bad_engine_option_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save_weights(tiny_model(), ParallelState.initialize(), tmp_path)
    rc, err = _run(capsys, "--checkpoint", str(path), "--block-size", "3")
    assert rc == 2 and "block_size=3 must be a power of two" in err
    rc, err = _run(capsys, "--checkpoint", str(path), "--l2-prefetch", "--l2-prefetch-up-mb", "-1")
    assert rc == 2 and "l2_prefetch_up_mb=-1.0 must be >= 0" in err
    rc, err = _run(capsys, "--checkpoint", str(path), "--l2-prefetch", "--l2-prefetch-up-mb", "nan")
    assert rc == 2 and "l2_prefetch_up_mb=nan must be >= 0" in err


def test_a_decode_plan_as_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--decode-kernels`` takes a decode plan as JSON (inline or a file) besides the preset names; a value that is
    neither is refused by argparse (exit code 2) with what is wrong."""
    path = save_weights(tiny_model(), ParallelState.initialize(), tmp_path)
    plan = '{"preset": "attention", "fused_mlp": true}'
    rc, err = _run(capsys, "--checkpoint", str(path), "--decode-kernels", plan)
    assert rc == 0, err
    for value, message in [
        ('{"preset": "row", "fuse": 1}', "unknown fields ['fuse']"),
        ('{"preset": "row"', "not valid JSON"),
        ("fastest", "not a preset (auto, none, attention, row, norm_linear), a JSON plan or a JSON file"),
        ('{"preset": "row", "fused_mlp": true}', "fused_mlp runs the whole MLP, swiglu_down only its down projection"),
    ]:
        with pytest.raises(SystemExit) as exited:
            main(["generate", "--checkpoint", str(path), "--decode-kernels", value, "hi"])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and message in err and "Traceback" not in err, err
