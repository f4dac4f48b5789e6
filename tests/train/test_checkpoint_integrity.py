"""Damaged or wrong checkpoints never load silently: each gives one clear error naming the file."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from mcore_parallel.checkpoint import CheckpointFormatError, latest_checkpoint
from mcore_parallel.errors import MCoreParallelError
from mcore_train import pretrain
from tests.train._util import config


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("good") / "run"
    pretrain(config("training.train_iters=2", f"checkpoint.dir={root}"))
    return root


@pytest.fixture
def run_dir(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(saved, copy)
    return copy


def _chunk(run_dir: Path, state: str = "exp_avg") -> Path:
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None
    array = sorted(p.parent for p in (ckpt / "optimizer").glob(f"*/{state}/zarr.json"))[0]
    return sorted(p for p in (array / "c").rglob("*") if p.is_file())[0]


def _resume(run_dir: Path, *overrides: str) -> None:
    pretrain(config("training.train_iters=3", f"checkpoint.dir={run_dir}", *overrides))


def _fails(match: str, run_dir: Path, *overrides: str) -> CheckpointFormatError:
    with pytest.raises(CheckpointFormatError, match=match) as info:
        _resume(run_dir, *overrides)
    assert isinstance(info.value, MCoreParallelError)  # the CLI turns these into one message, exit code 2
    return info.value


@pytest.mark.parametrize("state", ["master", "exp_avg"])
def test_missing_chunk_is_an_error_naming_it(run_dir: Path, state: str) -> None:
    chunk = _chunk(run_dir, state)
    chunk.unlink()
    _fails(f"{chunk}: missing chunk", run_dir)


def test_truncated_chunk_is_an_error_naming_it(run_dir: Path) -> None:
    chunk = _chunk(run_dir)
    chunk.write_bytes(chunk.read_bytes()[:-9])
    size = chunk.stat().st_size
    _fails(f"{chunk}: truncated chunk \\({size} bytes, expected {size + 9}\\)", run_dir)


def test_too_long_chunk_is_an_error_naming_it(run_dir: Path) -> None:
    chunk = _chunk(run_dir)
    chunk.write_bytes(chunk.read_bytes() + b"\0")
    _fails(f"{chunk}: chunk of the wrong size", run_dir)


def test_flipped_bytes_fail_the_checksum(run_dir: Path) -> None:
    chunk = _chunk(run_dir, "master")
    data = bytearray(chunk.read_bytes())
    for i in range(16):
        data[i] ^= 0xFF
    chunk.write_bytes(bytes(data))
    _fails(f"{chunk}: checksum mismatch", run_dir)


def test_verify_off_skips_the_checksum_only(run_dir: Path) -> None:
    chunk = _chunk(run_dir, "master")
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0x01
    chunk.write_bytes(bytes(data))
    _resume(run_dir, "checkpoint.verify=off")  # loads (the user asked not to check)
    chunk.unlink()
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and ckpt.name == "step_0000003"


def test_every_missing_array_metadata_is_reported_at_once(run_dir: Path) -> None:
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None
    metas = sorted((ckpt / "optimizer").glob("*/exp_avg/zarr.json"))[:2]
    for meta in metas:
        meta.unlink()
    error = _fails("2 problems", run_dir)
    assert sorted(p.split(":")[0] for p in error.problems) == [str(m) for m in metas]


def test_missing_step_metadata(run_dir: Path) -> None:
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None
    (ckpt / "zarr.json").unlink()
    _fails(f"points at '{ckpt.name}', which is not a complete checkpoint \\(has no {ckpt / 'zarr.json'}\\)", run_dir)


@pytest.mark.parametrize("garbage", [b"\xff\xfe\x00garbage\n", b"", b"../../etc\n", b".tmp.x", b"a" * 300])
def test_garbage_in_latest(run_dir: Path, garbage: bytes) -> None:
    (run_dir / "latest").write_bytes(garbage)
    _fails(f"{run_dir / 'latest'}: does not name a checkpoint directory", run_dir)


def test_latest_naming_a_missing_checkpoint(run_dir: Path) -> None:
    (run_dir / "latest").write_text("step_9999999\n")
    _fails(
        f"{run_dir / 'latest'} points at 'step_9999999', which is not a complete checkpoint \\(does not exist", run_dir
    )


def test_newer_format_version_is_an_error(run_dir: Path) -> None:
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None
    meta = json.loads((ckpt / "zarr.json").read_text())
    meta["attributes"]["format_version"] = 99
    (ckpt / "zarr.json").write_text(json.dumps(meta))
    _fails(f"{ckpt / 'zarr.json'}: checkpoint format version 99 is newer than this mcore knows", run_dir)
    _fails("format version 99 is newer", run_dir, "checkpoint.finetune=true")


def test_load_path_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(CheckpointFormatError, match=f"{tmp_path / 'elsewhere'} is not a checkpoint"):
        pretrain(config("training.train_iters=3", f"checkpoint.load={tmp_path / 'elsewhere'}"))


def test_load_path_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFormatError, match=f"{tmp_path / 'nope'} does not exist"):
        pretrain(config("training.train_iters=3", f"checkpoint.load={tmp_path / 'nope'}"))


def test_explicit_load_of_a_good_checkpoint_or_run_dir(run_dir: Path, tmp_path: Path) -> None:
    ckpt = latest_checkpoint(run_dir)
    for load in (ckpt, run_dir):
        result = pretrain(config("training.train_iters=3", f"checkpoint.load={load}"))
        assert result.steps == 3 and len(result.losses) == 1  # resumed at step 2


def test_auto_resume_from_an_empty_dir_starts_fresh_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="mcore_train"):
        result = pretrain(config("training.train_iters=3", f"checkpoint.dir={tmp_path / 'empty'}"))
    assert result.steps == 3
    assert "starting from step 0" in caplog.text


def _cli(*argv: str) -> int:
    from mcore_train.cli import main

    return main(list(argv))


def test_verify_cli_good_and_damaged(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None
    assert _cli("checkpoint", "verify", str(run_dir)) == 0
    assert _cli("checkpoint", "verify", str(ckpt)) == 0
    capsys.readouterr()
    chunk, gone = _chunk(run_dir, "master"), _chunk(run_dir, "exp_avg")
    data = bytearray(chunk.read_bytes())
    data[3] ^= 0x10
    chunk.write_bytes(bytes(data))
    gone.unlink()
    meta = sorted((ckpt / "optimizer").glob("*/exp_avg_sq/zarr.json"))[-1]
    meta.unlink()
    assert _cli("checkpoint", "verify", str(ckpt)) == 2
    err = capsys.readouterr().err
    assert "3 problems" in err
    for needle in (f"{chunk}: checksum mismatch", f"{gone}: missing chunk", f"{meta}: missing"):
        assert needle in err
    assert _cli("checkpoint", "verify", "--no-checksums", str(ckpt)) == 2
    assert "2 problems" in capsys.readouterr().err


def test_verify_cli_bad_paths(tmp_path: Path, run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli("checkpoint", "verify", str(tmp_path / "nope")) == 2
    (tmp_path / "empty").mkdir()
    assert _cli("checkpoint", "verify", str(tmp_path / "empty")) == 2
    (run_dir / "latest").write_bytes(b"\x00\x01")
    assert _cli("checkpoint", "verify", str(run_dir)) == 2
    assert str(run_dir / "latest") in capsys.readouterr().err


def test_inspect_cli(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli("checkpoint", "inspect", "--json", str(run_dir)) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["latest"] == "step_0000002"
    (ckpt,) = info["checkpoints"]
    assert ckpt["step"] == 2 and ckpt["saved_layout"]["tp"] == 1 and ckpt["model"]["num_layers"] == 4
    names = {a["name"]: a for a in ckpt["arrays"]}
    emb = next(a for n, a in names.items() if n.startswith("model/") and "embedding" in n)
    assert emb["dtype"] in ("float32", "bfloat16") and emb["checksum"] and len(emb["shape"]) == 2
    assert any(n.endswith("/exp_avg") for n in names)
    assert _cli("checkpoint", "inspect", str(run_dir)) == 0
    assert "step 2" in capsys.readouterr().out
    assert _cli("checkpoint", "inspect", str(run_dir / "nope")) == 2


def test_pretrain_cli_reports_a_damaged_checkpoint_with_exit_code_2(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.train._util import TINY_MODEL

    base = ["pretrain", "--recipe", "tiny", *TINY_MODEL, "training.train_iters=3"]
    assert _cli(*base, f"checkpoint.load={tmp_path / 'nope'}") == 2
    assert f"{tmp_path / 'nope'} does not exist" in capsys.readouterr().err
    chunk = _chunk(run_dir)
    chunk.unlink()
    assert _cli(*base, f"checkpoint.dir={run_dir}") == 2
    err = capsys.readouterr().err
    assert f"{chunk}: missing chunk" in err and "Traceback" not in err


def test_finetune_loads_weights_and_checks_them(run_dir: Path, tmp_path: Path) -> None:
    ckpt = latest_checkpoint(run_dir)
    result = pretrain(config("training.train_iters=3", f"checkpoint.load={ckpt}", "checkpoint.finetune=true"))
    assert len(result.losses) == 3  # weights only: the schedule starts again
    chunk = sorted(p for p in (ckpt / "model").glob("*/c/*") if p.is_file() or p.is_dir())[0]
    target = chunk if chunk.is_file() else sorted(p for p in chunk.rglob("*") if p.is_file())[0]
    target.write_bytes(target.read_bytes()[:-1])
    with pytest.raises(CheckpointFormatError, match=f"{target}: truncated chunk"):
        pretrain(config("training.train_iters=3", f"checkpoint.load={ckpt}", "checkpoint.finetune=true"))


def test_an_interrupted_finetune_resumes_its_own_checkpoint(run_dir: Path, tmp_path: Path) -> None:
    """checkpoint.load gives a fine-tune its starting weights; rerun after an interruption, the same command
    continues from the fine-tune's own checkpoint.dir (step 2 of 4), not from the loaded weights again."""
    ckpt, own = latest_checkpoint(run_dir), tmp_path / "finetune"
    common = [f"checkpoint.load={ckpt}", "checkpoint.finetune=true", f"checkpoint.dir={own}"]
    straight = pretrain(config("training.train_iters=4", *common[:2]))
    first = pretrain(config("training.train_iters=4", "training.exit_interval=2", *common))
    assert first.steps == 2 and latest_checkpoint(own) is not None
    rest = pretrain(config("training.train_iters=4", *common))
    assert rest.steps == 4 and len(rest.losses) == 2  # steps 3 and 4 only
    assert [*first.losses, *rest.losses] == straight.losses


def test_verify_sample_resumes_a_good_checkpoint_and_catches_a_sampled_chunk(run_dir: Path) -> None:
    _resume(run_dir, "checkpoint.verify=sample")
    chunk = _chunk(run_dir, "master")
    assert chunk.name == "0"  # a first chunk: always sampled
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0x01
    chunk.write_bytes(bytes(data))
    _fails(f"{chunk}: checksum mismatch", run_dir, "checkpoint.verify=sample")
