"""nox sessions for the mcore monorepo.

Packages are discovered from ``packages/*/pyproject.toml``: adding a package means adding a folder.

Sessions:
- ``lint``: ruff check and ruff format --check.
- ``typecheck``: mypy over every package's source, with everything installed.
- ``tests(<pkg>)``: installs only that package, its declared sibling packages and its ``test`` extra (if any), then
  runs ``tests/<pkg>/``. An undeclared cross-package import fails here.
- ``integration``: installs the packages with exactly the README's install line (the block after
  ``<!-- install -->``), runs the README's and docs' runnable command blocks (``tests/integration/
  test_readme_commands.py``) in that environment, then adds every ``test`` extra and runs the rest of
  ``tests/integration/``.
- ``kernels``: the Triton kernels of mcore-parallel, mcore-models and mcore-infer run by Triton's interpreter on the CPU
  (``TRITON_INTERPRET=1``, float32) against their references: the kernel test modules, with the ``gpu`` extra
  (Triton) installed. The other sessions have no Triton, so there these tests check the PyTorch fallbacks.
- ``demo``: the main job (see README).

torch is pinned to the CPU build through ``.ci/constraints.txt`` (used only here and in CI). It is installed once,
into ``.nox/_torch`` (about 1 GB), and every session's venv sees it through a ``.pth`` file instead of unpacking its
own copy: the sessions' venvs hold only the mcore packages and their other dependencies (tens to a few hundred MB
each). ``.nox/_torch`` is kept between runs while the pin and the Python version stay the same. Every other package a
session installs is its own, so the per-package isolation of ``tests(<pkg>)`` is unchanged (all mcore packages but
mcore-data need torch, and mcore-data's tests install it).

With ``MCORE_NOX_DISCARD_VENVS=1`` (set by ``.ci/run``) each session deletes its venv when it ends and
``.nox/_torch`` is deleted when nox exits, so the whole run needs the disk of torch plus one session's venv.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import nox
import tomllib

ROOT = Path(__file__).parent
CONSTRAINTS = ROOT / ".ci" / "constraints.txt"
TEST_DEPS = ["pytest>=8", "pytest-timeout>=2.2", "pytest-xdist>=3.5"]
WORKERS = ["-n", "2"] if (os.cpu_count() or 1) >= 2 else []
"""pytest-xdist's worker processes for the package and kernel tests (not the integration tests: the README's
command blocks build on each other in order): two, so a 2-core machine keeps
both cores busy through the single-process tests (most of them run one thread, ``OMP_NUM_THREADS=1``); not more,
since the multi-process tests start their own ranks and each worker holds its own pools of them."""
TORCH_BASE = ROOT / ".nox" / "_torch"
README = ROOT / "README.md"
INSTALL_MARKER = "<!-- install -->"

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "typecheck", "tests", "kernels", "integration"]

KERNEL_TESTS = [
    "tests/models/test_swiglu.py",
    "tests/models/test_qkv_rope.py",
    "tests/models/test_ssd_triton.py",
    "tests/models/test_mamba_decode_triton.py",
    "tests/models/test_mamba_conv_triton.py",
    "tests/models/test_mamba_norm_triton.py",
    "tests/parallel/test_fp8_cast_triton.py",
    "tests/models/test_fp8_swiglu.py",
    "tests/infer/test_small_gemv.py",
    "tests/infer/test_add_norm.py",
    "tests/infer/test_fused_mlp.py",
    "tests/infer/test_norm_gemv.py",
    "tests/infer/test_norm_linear.py",
    "tests/infer/test_fused_rope.py",
    "tests/infer/test_attention_fold.py",
    "tests/infer/test_attention_launch.py",
    "tests/infer/test_argmax.py",
    "tests/infer/test_embed_rope.py",
    "tests/infer/test_decode.py",
    "tests/infer/test_decode_fusions.py",
    "tests/infer/test_mamba_decode_kernel.py",
    "tests/infer/test_hybrid_decode_plan.py",
    "tests/infer/test_gated_norm_gemv.py",
]
"""The test modules whose cases run the Triton kernels under ``TRITON_INTERPRET=1`` (the ``kernels`` session)."""


def _packages() -> dict[str, dict]:
    found = {}
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())["project"]
        found[data["name"]] = {"dir": pyproject.parent, "project": data}
    return found


PACKAGES = _packages()


def _requirement_name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].strip().lower()


def _local_closure(name: str) -> list[str]:
    """The package and every sibling it (transitively) declares, dependencies first."""
    order: list[str] = []

    def visit(n: str) -> None:
        if n in order:
            return
        for req in PACKAGES[n]["project"].get("dependencies", []):
            dep = _requirement_name(req)
            if dep in PACKAGES:
                visit(dep)
        order.append(n)

    visit(name)
    return order


def _discard_venvs() -> bool:
    return os.environ.get("MCORE_NOX_DISCARD_VENVS") == "1"


def _purelib(python: Path) -> str:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def _torch_pin() -> str:
    pins = [line.strip() for line in CONSTRAINTS.read_text().splitlines() if line.strip().startswith("torch==")]
    return pins[0] if pins else "torch"


_torch_base_ready = False


def _torch_base(session: nox.Session) -> str:
    """Install the pinned torch once into ``.nox/_torch`` (reused while pin and Python match); its site-packages."""
    global _torch_base_ready
    python = TORCH_BASE / "bin" / "python"
    stamp = TORCH_BASE / "mcore-torch-stamp.txt"
    wanted = f"{sys.version}\n{CONSTRAINTS.read_text()}"
    TORCH_BASE.parent.mkdir(parents=True, exist_ok=True)
    with open(TORCH_BASE.parent / "_torch.lock", "w") as lock:  # two nox runs at once: one installs, one waits
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _torch_base_ready and not (python.exists() and stamp.exists() and stamp.read_text() == wanted):
            shutil.rmtree(TORCH_BASE, ignore_errors=True)
            session.log(
                f"installing {_torch_pin()} into {TORCH_BASE.relative_to(ROOT)} once, for every session "
                "(a ~200 MB wheel, ~1 GB unpacked; a minute or two)"
            )
            session.run_install(sys.executable, "-m", "venv", str(TORCH_BASE), external=True)
            session.run_install(str(python), "-m", "pip", "install", "-c", str(CONSTRAINTS), "torch", external=True)
            stamp.write_text(wanted)
    if not _torch_base_ready and _discard_venvs():
        atexit.register(shutil.rmtree, TORCH_BASE, ignore_errors=True)
    _torch_base_ready = True
    return _purelib(python)


def _share_torch(session: nox.Session) -> None:
    """Let this session's venv import (and pip see as installed) the torch of ``.nox/_torch``."""
    if session.virtualenv.venv_backend == "none":  # nox --no-venv: use the interpreter's own torch
        return
    base = _torch_base(session)
    bin_dir = Path(session.virtualenv.bin)
    Path(_purelib(bin_dir / "python"), "_mcore_shared_torch.pth").write_text(base + "\n")
    # the console scripts of the shared packages (torchrun, ...), run by this venv's python
    for dist in importlib.metadata.distributions(path=[base]):
        for ep in dist.entry_points.select(group="console_scripts"):
            module, _, attr = ep.value.partition(":")
            script = bin_dir / ep.name
            if not script.exists():
                script.write_text(
                    f"#!{bin_dir / 'python'}\nimport sys\nfrom {module} import {attr.split('.')[0]}\n"
                    f"sys.exit({attr}())\n"
                )
                script.chmod(0o755)


def _install(
    session: nox.Session,
    names: list[str],
    extras: dict[str, list[str]] | None = None,
    *,
    local: bool = True,
) -> None:
    """Install local packages (siblings resolved from this checkout) and the requirements of chosen extras.

    Extras are installed as plain requirement strings in a second step: pip does not match a sibling's exact pin
    (``mcore-models==0.1.0``) to a local directory given with extras (``packages/mcore-models[test]``).
    ``local=False`` installs only the extras (the packages are already there).
    """
    session.log(f"installing {', '.join(TEST_DEPS)} and hatchling")
    session.install("-c", str(CONSTRAINTS), "hatchling>=1.18", *TEST_DEPS, silent=False)
    if local:
        session.log(f"installing {', '.join(names)} from this checkout, with their dependencies (torch shared)")
        dirs = [str(PACKAGES[n]["dir"]) for n in names]
        session.install("-c", str(CONSTRAINTS), "--no-build-isolation", *dirs, silent=False)
    wanted: list[str] = []
    for n in names:
        optional = PACKAGES[n]["project"].get("optional-dependencies", {})
        for extra in (extras or {}).get(n, []):
            wanted += [r for r in optional.get(extra, []) if _requirement_name(r) not in PACKAGES]
    if wanted:
        session.log(f"installing the test extras: {', '.join(sorted(set(wanted)))}")
        session.install("-c", str(CONSTRAINTS), *sorted(set(wanted)), silent=False)


def readme_install_line() -> str:
    """The README's install command: the fenced block right after ``<!-- install -->``, continuations joined."""
    lines = README.read_text().splitlines()
    start = lines.index(INSTALL_MARKER) + 1
    if not lines[start].startswith("```"):
        raise ValueError(f"README.md: {INSTALL_MARKER} must be followed by a fenced code block")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    command = "\n".join(lines[start + 1 : end]).replace("\\\n", " ")
    commands = [c for c in command.splitlines() if c.strip() and not c.lstrip().startswith("#")]
    if len(commands) != 1 or shlex.split(commands[0], comments=True)[:2] != ["pip", "install"]:
        raise ValueError(f"README.md: the {INSTALL_MARKER} block must hold one `pip install ...` command")
    return commands[0]


@contextlib.contextmanager
def _venv_scope(session: nox.Session) -> Iterator[None]:
    """Run a session body; afterwards, pass or fail, delete its venv when MCORE_NOX_DISCARD_VENVS=1."""
    try:
        yield
    finally:
        location = getattr(session.virtualenv, "location", None)
        if _discard_venvs() and location and Path(location).is_dir():
            session.log(f"discarding venv {location} (MCORE_NOX_DISCARD_VENVS=1)")
            shutil.rmtree(location, ignore_errors=True)


def _short(name: str) -> str:
    return name.removeprefix("mcore-")


@nox.session
def lint(session: nox.Session) -> None:
    with _venv_scope(session):
        session.install("ruff>=0.6", silent=False)
        session.run("ruff", "check", ".")
        session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    with _venv_scope(session):
        _share_torch(session)
        names = list(PACKAGES)
        _install(session, names, {n: ["test"] for n in names})
        session.install("mypy>=1.10", "types-PyYAML", silent=False)
        session.run("mypy", *[str(p["dir"] / "src") for p in PACKAGES.values()])


@nox.session(name="tests")
@nox.parametrize("package", [_short(n) for n in PACKAGES], ids=[_short(n) for n in PACKAGES])
def tests(session: nox.Session, package: str) -> None:
    with _venv_scope(session):
        name = f"mcore-{package}"
        _share_torch(session)
        _install(session, _local_closure(name), {name: ["test"]})
        session.run("pytest", *WORKERS, f"tests/{package}", *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session
def kernels(session: nox.Session) -> None:
    with _venv_scope(session):
        _share_torch(session)
        names = _local_closure("mcore-infer")
        _install(session, names, {"mcore-infer": ["test", "gpu"], "mcore-models": ["test", "gpu"]})
        env = {"OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
        session.run("pytest", *WORKERS, *KERNEL_TESTS, *session.posargs, env=env)


@nox.session
def integration(session: nox.Session) -> None:
    """The README's install line alone, its runnable command blocks; then every test extra and the other tests."""
    with _venv_scope(session):
        _share_torch(session)
        session.log(f"installing {', '.join(TEST_DEPS)} (nothing else before the README's install line)")
        session.install(*TEST_DEPS, silent=False)
        line = readme_install_line()
        session.log(f"the README's install line: {line}")
        session.run_install("bash", "-c", line, external=True, env={"PIP_CONSTRAINT": str(CONSTRAINTS)})
        env = {"OMP_NUM_THREADS": "1"}
        readme_test = "tests/integration/test_readme_commands.py"
        # exit code 5 (nothing selected) lets `nox -s integration -- -k X` pick tests from either run
        session.run("pytest", readme_test, *session.posargs, env=env, success_codes=[0, 5])
        names = list(PACKAGES)
        _install(session, names, {n: ["test"] for n in names}, local=False)
        args = ["tests/integration", f"--ignore={readme_test}", *session.posargs]
        session.run("pytest", *args, env=env, success_codes=[0, 5])


@nox.session
def demo(session: nox.Session) -> None:
    """The main job (README quick start): prepare the demo corpus, pretrain the tiny recipe on CPU, sample text."""
    with _venv_scope(session):
        _share_torch(session)
        _install(session, _local_closure("mcore-train"))
        run_dir = os.environ.get("MCORE_DEMO_DIR", "runs/demo")
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        session.run("mcore-train", "prepare-demo", "--out", "data/demo", env=env)
        session.run(
            "mcore-train",
            "pretrain",
            "--recipe",
            "tiny",
            "data.path=data/demo/stdlib_text",
            f"checkpoint.dir={run_dir}",
            "checkpoint.auto_resume=false",
            *session.posargs,
            env=env,
        )
