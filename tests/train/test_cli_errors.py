"""``mcore-train``'s exit codes: a user's mistake is one message and exit code 2, an internal fault a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_parallel.errors import LaunchEnvironmentError
from mcore_train import api
from mcore_train.cli import main

BAD_LAYOUT = ["pretrain", "--recipe", "tiny", "parallel.tp=3", "optimizer.lrr=1"]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")


@pytest.fixture(autouse=True)
def _one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


def test_a_config_error_is_one_message_and_exit_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(BAD_LAYOUT) == 2
    err = capsys.readouterr().err
    assert err.startswith("mcore-train: error: invalid training configuration for 1 rank(s) (2 problems)"), err
    assert "optimizer.lrr: unknown key" in err and "world size 1 is not divisible by tp*cp*pp = 3*1*1 = 3" in err
    assert main(["show-config", "--recipe", "tiny", "optimizer.lrr=1"]) == 2
    assert "optimizer.lrr: unknown key" in capsys.readouterr().err


def test_a_missing_data_path_is_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pretrain", "--recipe", "tiny", f"data.path={tmp_path / 'nothing'}"]) == 2
    err = capsys.readouterr().err
    assert f"data.path: no dataset at prefix '{tmp_path / 'nothing'}'" in err and "Traceback" not in err, err


def test_errors_of_every_package_are_exit_code_2_and_faults_raise(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["pretrain", "--recipe", "tiny", "data.mock=true"]

    def raise_(error: Exception) -> None:
        def pretrain(config: object) -> None:
            raise error

        monkeypatch.setattr(api, "pretrain", pretrain)

    raise_(LaunchEnvironmentError("MASTER_ADDR is not set"))
    assert main(args) == 2
    assert capsys.readouterr().err == "mcore-train: error: MASTER_ADDR is not set\n"
    from mcore_data.errors import IndexFormatError
    from mcore_models.errors import ConversionError

    for error in (IndexFormatError("x.idx", "bad magic"), ConversionError("no such key")):
        raise_(error)
        assert main(args) == 2
        assert capsys.readouterr().err == f"mcore-train: error: {error}\n"
    raise_(RuntimeError("an internal fault"))
    with pytest.raises(RuntimeError, match="an internal fault"):  # uncaught: Python prints it and exits 1
        main(args)


def test_only_rank_0_prints(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(BAD_LAYOUT) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(BAD_LAYOUT) == 2
    err = capsys.readouterr().err
    assert "invalid training configuration for 2 rank(s)" in err and "world size 2 is not divisible" in err
    monkeypatch.setenv("RANK", "5")  # a launcher environment that cannot be: also a listed mistake
    assert main(BAD_LAYOUT) == 2
    assert "rank 5 is outside [0, 2)" in capsys.readouterr().err


def test_the_installed_command_prints_no_traceback(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "mcore_train.cli", "pretrain", "--recipe", "tiny", "parallel.tp=3",
           f"data.path={tmp_path / 'nothing'}"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS} | {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "world size 1 is not divisible by tp*cp*pp = 3*1*1 = 3" in proc.stderr
    assert f"no dataset at prefix '{tmp_path / 'nothing'}'" in proc.stderr


class _Exited(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


@pytest.mark.parametrize("fails", [False, True], ids=["finished", "user-error"])
def test_a_distributed_run_leaves_its_group_and_exits_without_finalizing(
    fails: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rank that ran a process group destroys it when pretrain returns (or raises a user's error), and the
    console entry point ends the process with ``os._exit`` and main's code after flushing: a gloo group left for the
    interpreter's finalization aborted finished torchrun ranks now and then (exit -6, the run reported failed). A run
    without a process group exits normally."""
    import torch.distributed as dist

    from mcore_train import cli

    def distributed_pretrain(config: object) -> None:  # what a multi-rank pretrain leaves behind: a live group
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
        if fails:
            raise LaunchEnvironmentError("a user's mistake")

    def exit_now(code: int) -> None:
        raise _Exited(code)

    monkeypatch.setattr(api, "pretrain", distributed_pretrain)
    monkeypatch.setattr(cli, "_LEFT_GROUP", False)
    monkeypatch.setattr(os, "_exit", exit_now)
    monkeypatch.setattr(sys, "argv", ["mcore-train", "pretrain", "--recipe", "tiny", "data.mock=true"])
    with pytest.raises(_Exited) as exited:
        cli.entry()
    assert exited.value.code == (2 if fails else 0) and not dist.is_initialized()
    assert ("a user's mistake" in capsys.readouterr().err) == fails
    monkeypatch.setattr(api, "pretrain", lambda config: None)
    monkeypatch.setattr(cli, "_LEFT_GROUP", False)
    with pytest.raises(SystemExit) as normal:
        cli.entry()
    assert normal.value.code == 0
