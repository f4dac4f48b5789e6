"""nox sessions for the mcore monorepo.

Packages are discovered from ``packages/*/pyproject.toml``: adding a package means adding a folder.

Sessions:
- ``lint``: ruff check and ruff format --check.
- ``typecheck``: mypy over every package's source, with everything installed.
- ``tests-<pkg>``: installs only that package, its declared sibling packages and its ``test`` extra (if any), then
  runs ``tests/<pkg>/``. An undeclared cross-package import fails here.
- ``integration``: everything installed, runs ``tests/integration/``.
- ``demo``: the main job (see README).

torch is pinned to the CPU build through ``.ci/constraints.txt`` (used only here and in CI).

Every session's venv holds its own torch (about 1 GB). With ``MCORE_NOX_DISCARD_VENVS=1`` (set by ``.ci/run``) each
session deletes its venv when it ends, so the whole run needs the disk of one venv, not of nine.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import nox
import tomllib

ROOT = Path(__file__).parent
CONSTRAINTS = ROOT / ".ci" / "constraints.txt"
TEST_DEPS = ["pytest>=8", "pytest-timeout>=2.2"]

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "typecheck", "tests", "integration"]


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


def _install(session: nox.Session, names: list[str], extras: dict[str, list[str]] | None = None) -> None:
    """Install local packages (siblings resolved from this checkout) and the requirements of chosen extras.

    Extras are installed as plain requirement strings in a second step: pip does not match a sibling's exact pin
    (``mcore-models==0.1.0``) to a local directory given with extras (``packages/mcore-models[test]``).
    """
    session.install("-c", str(CONSTRAINTS), "hatchling>=1.18", *TEST_DEPS)
    session.install("-c", str(CONSTRAINTS), "--no-build-isolation", *[str(PACKAGES[n]["dir"]) for n in names])
    wanted: list[str] = []
    for n in names:
        optional = PACKAGES[n]["project"].get("optional-dependencies", {})
        for extra in (extras or {}).get(n, []):
            wanted += [r for r in optional.get(extra, []) if _requirement_name(r) not in PACKAGES]
    if wanted:
        session.install("-c", str(CONSTRAINTS), *sorted(set(wanted)))


@contextlib.contextmanager
def _venv_scope(session: nox.Session) -> Iterator[None]:
    """Run a session body; afterwards, pass or fail, delete its venv when MCORE_NOX_DISCARD_VENVS=1."""
    try:
        yield
    finally:
        location = getattr(session.virtualenv, "location", None)
        if os.environ.get("MCORE_NOX_DISCARD_VENVS") == "1" and location and Path(location).is_dir():
            session.log(f"discarding venv {location} (MCORE_NOX_DISCARD_VENVS=1)")
            shutil.rmtree(location, ignore_errors=True)


def _short(name: str) -> str:
    return name.removeprefix("mcore-")


@nox.session
def lint(session: nox.Session) -> None:
    with _venv_scope(session):
        session.install("ruff>=0.6")
        session.run("ruff", "check", ".")
        session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    with _venv_scope(session):
        names = list(PACKAGES)
        _install(session, names, {n: ["test"] for n in names})
        session.install("mypy>=1.10", "types-PyYAML")
        session.run("mypy", *[str(p["dir"] / "src") for p in PACKAGES.values()])


@nox.session(name="tests")
@nox.parametrize("package", [_short(n) for n in PACKAGES], ids=[_short(n) for n in PACKAGES])
def tests(session: nox.Session, package: str) -> None:
    with _venv_scope(session):
        name = f"mcore-{package}"
        _install(session, _local_closure(name), {name: ["test"]})
        session.run("pytest", f"tests/{package}", *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session
def integration(session: nox.Session) -> None:
    with _venv_scope(session):
        names = list(PACKAGES)
        _install(session, names, {n: ["test"] for n in names})
        session.run("pytest", "tests/integration", *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session
def demo(session: nox.Session) -> None:
    """The main job (README quick start): prepare the demo corpus, pretrain the tiny recipe on CPU, sample text."""
    with _venv_scope(session):
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
