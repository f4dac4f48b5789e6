"""The command blocks of README.md and docs/*.md marked runnable run as written, in order, on CPU.

A block is marked by the line ``<!-- runnable -->`` right before its ```bash fence (an HTML comment: invisible where
the Markdown is rendered). The marked blocks of one file run one after another, each with ``bash -euo pipefail``, in
one working directory that stands for the root of a fresh clone: the checkout's top-level folders and files are
linked in, but none of what the commands write (``data/``, ``runs/``, ...), so a block sees exactly what the blocks
before it in the same file wrote. One test per block; after a failing block the file's later blocks are skipped.

The ``integration`` nox session runs this module in a venv that holds pytest and exactly the README's install line
(the block after ``<!-- install -->``; see ``noxfile.py``) and nothing else, so a command that needs a package the
install line does not bring fails here. Outside that session it runs in whatever environment pytest has.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- runnable -->"
BLOCK_TIMEOUT_S = 900
# What the documented commands write at the clone's root: never linked in from the checkout.
WRITTEN = {"data", "runs", "exports", "ckpts", "engines", "out", "build", "dist"}


@dataclass(frozen=True)
class Block:
    doc: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    text: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}"


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def runnable_blocks(path: Path) -> list[Block]:
    """The blocks of one Markdown file marked runnable, in file order; a marker not before a bash fence is an error."""
    lines = path.read_text().splitlines()
    doc = str(path.relative_to(ROOT))
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        if i + 1 >= len(lines) or not re.fullmatch(r"```(bash|sh|console)?", lines[i + 1].strip()):
            raise ValueError(f"{doc}:{i + 1}: {MARKER} must be followed by a ```bash fence")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{doc}:{i + 2}: unclosed code block after {MARKER}")
        blocks.append(Block(doc, i + 2, "\n".join(lines[i + 2 : end]) + "\n"))
    return blocks


ALL_BLOCKS = [block for path in _docs() for block in runnable_blocks(path)]
_workdirs: dict[str, Path] = {}
_failed: dict[str, str] = {}


def _workdir(doc: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if doc not in _workdirs:
        work = tmp_path_factory.mktemp(re.sub(r"\W", "_", doc))
        for entry in ROOT.iterdir():
            if not entry.name.startswith(".") and entry.name not in WRITTEN and entry.name != "__pycache__":
                (work / entry.name).symlink_to(entry)
        _workdirs[doc] = work
    return _workdirs[doc]


def run_block(block: Block, cwd: Path, timeout: float = BLOCK_TIMEOUT_S) -> tuple[int, str]:
    """Run a block with bash in its own process group; afterwards kill whatever it left running (a server)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as in a user's shell
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this venv, as if activated
    log = cwd / f".block-{block.line}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block.text], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = -1
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return rc, log.read_text(errors="replace")


def test_the_readme_marks_its_cpu_commands() -> None:
    """The marker is found where it is meant to be (a typo in it would silently untest a block)."""
    readme = [b for b in ALL_BLOCKS if b.doc == "README.md"]
    commands = "".join(b.text for b in readme)
    for command in ("mcore-data preprocess", "mcore-train pretrain", "mcore-infer serve", "mcore-export hf"):
        assert command in commands, f"no runnable README block runs {command}"
    for path in _docs():
        text = path.read_text()
        assert text.count("runnable -->") == text.count(MARKER), f"{path.name}: a misspelt {MARKER}"


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 60)
@pytest.mark.parametrize("block", ALL_BLOCKS, ids=str)
def test_runnable_block(block: Block, tmp_path_factory: pytest.TempPathFactory) -> None:
    if block.doc in _failed:
        pytest.skip(f"an earlier block of {block.doc} failed: {_failed[block.doc]}")
    _failed[block.doc] = str(block)  # cleared below when the block passes
    rc, output = run_block(block, _workdir(block.doc, tmp_path_factory))
    status = "timed out" if rc == -1 else f"exit code {rc}"
    assert rc == 0, f"{block} {status}:\n{block.text}\n--- output (last 6000 characters) ---\n{output[-6000:]}"
    del _failed[block.doc]
