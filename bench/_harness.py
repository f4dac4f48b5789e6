"""What a benchmark suite is made of (for ``bench/run.py``): the context its commands run in, the outcome of one
command, and the tables a suite returns (each row with the command that measured it)."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PY = sys.executable
SHOWN_WORK = "/tmp/bench"  # how the work folder appears in the commands a result records


@dataclass
class Step:
    """The outcome of one command: its shown form, whether it succeeded, its JSON output and its log."""

    command: str
    ok: bool
    data: Any = None
    log: str = ""
    error: str | None = None


@dataclass
class Context:
    """Where a suite's commands run: a work folder, the children's environment, the GPUs the suite uses."""

    work: Path
    env: dict[str, str]
    gpus: int
    quick: bool
    dry_run: bool
    repo: Path
    gpu_gib: float | None = None
    """GPU 0's memory in GiB (``nvidia-smi``, read once by ``run.py``'s probe), None without it."""
    date: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).date().isoformat())
    steps: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)

    def path(self, name: str) -> str:
        return str(self.work / name)

    def show(self, cmd: Sequence[str]) -> str:
        """``cmd`` as a user would type it in the repository root."""
        return shlex.join("python" if c == PY else c.replace(str(self.work), SHOWN_WORK) for c in cmd)

    def run(self, cmd: Sequence[str], timeout: float, out: str | None = None) -> Step:
        """Run ``cmd`` in the repository root (output to a log in the work folder); ``out``: the JSON it writes."""
        shown = self.show(cmd)
        n = len(self.steps) + 1
        print(f"  [{n}] {shown}", flush=True)
        if self.dry_run:
            self.steps.append({"command": shown, "returncode": None})
            return Step(shown, False, error="not run (--dry-run)")
        log = self.work / f"step{n}.log"
        rc, seconds = _run(list(cmd), self.env, self.repo, log, timeout)
        text = log.read_text(errors="replace")
        data = None
        if out is not None and Path(out).exists():
            try:
                data = json.loads(Path(out).read_text())
            except json.JSONDecodeError:
                data = None
        ok = rc == 0 and (out is None or data is not None)
        tail = [line for line in text.strip().splitlines() if line.strip()][-3:]
        error = None if ok else f"exit status {rc}: " + " / ".join(tail)[-400:]
        self.steps.append({"command": shown, "returncode": rc, "seconds": round(seconds, 1), "log": str(log),
                           **({} if ok else {"tail": text[-4000:]})})  # fmt: skip
        print(
            f"      {'done' if ok else 'FAILED'} in {seconds:.0f} s" + ("" if ok else f"\n{text[-2500:]}"), flush=True
        )
        return Step(shown, ok, data, text, error)

    def importable(self, *modules: str) -> bool:
        """Whether the children's Python can import every one of ``modules``."""
        check = "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))"
        return subprocess.run([PY, "-c", check, *modules], env=self.env).returncode == 0

    def row(self, step: Step, measured: bool | None = None, **values: Any) -> dict[str, Any]:
        """A table row: ``values``, the command that measured them and the date (``measured``: whether it did;
        by default when the command succeeded or left its JSON)."""
        done = (step.ok or step.data is not None) if measured is None else measured
        r = {**values, "command": step.command, "measured": self.date if done else None}
        if not step.ok and step.error:
            r["error"] = step.error
        return r


def _run(cmd: list[str], env: dict[str, str], cwd: Path, log: Path, timeout: float) -> tuple[int, float]:
    """Exit status and seconds of ``cmd``; on timeout its whole process group (torchrun's workers too) is killed."""
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            f.write(f"\n[bench/run.py] killed after {timeout:.0f} s\n")
            rc = 124
    return rc, time.perf_counter() - start


Column = tuple[str, str, str]  # row key, header, format spec ("" for text)


def table(title: str, columns: Sequence[Column], rows: list[dict[str, Any]], notes: Sequence[str] = ()) -> dict:
    return {"title": title, "columns": [list(c) for c in columns], "rows": rows, "notes": list(notes)}


@dataclass(frozen=True)
class Suite:
    """A named benchmark: what it measures, against which anchor, and the function that runs it."""

    name: str
    summary: str
    anchor: str
    minutes: int
    """Wall time on one H200 (or the GPUs it needs), roughly."""
    gpus: int
    """GPUs it needs at the least (0: runs on a CPU too)."""
    build: Callable[[Context], list[dict[str, Any]]]
    use: Callable[[int], int] | None = None
    """GPUs it uses given the visible ones (default: exactly ``gpus``)."""

    def gpus_used(self, visible: int) -> int:
        return self.use(visible) if self.use is not None else self.gpus
