"""Imports in each package's source may only name packages it declares, and siblings follow the one-way graph.

Static: every ``import`` in ``packages/*/src`` (including lazy imports inside functions) is resolved to its top-level
module and checked against the package's declared dependencies (siblings: ``dependencies`` only; third-party:
``dependencies`` or an optional extra).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
# The design's one-way graph: which siblings each package may depend on.
ALLOWED = {
    "mcore-parallel": set(),
    "mcore-data": set(),
    "mcore-models": {"mcore-parallel"},
    "mcore-train": {"mcore-parallel", "mcore-models", "mcore-data"},
    "mcore-infer": {"mcore-parallel", "mcore-models", "mcore-data"},
    "mcore-export": {"mcore-parallel", "mcore-models"},
}
# distribution name -> import name, where they differ
IMPORT_NAMES = {"pyyaml": "yaml", "pillow": "PIL", "scikit-learn": "sklearn"}


def _req_name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower()


def _packages() -> dict[str, dict]:
    out = {}
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        out[project["name"]] = {"dir": pyproject.parent, "project": project}
    return out


PACKAGES = _packages()


def _imports(src: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for n in names:
                found.setdefault(n.split(".")[0], []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_package_is_in_the_design_graph() -> None:
    assert set(PACKAGES) == set(ALLOWED)


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_declared_siblings_follow_the_one_way_graph(name: str) -> None:
    deps = {_req_name(r) for r in PACKAGES[name]["project"].get("dependencies", [])}
    siblings = deps & set(PACKAGES)
    assert siblings <= ALLOWED[name], f"{name} declares {sorted(siblings - ALLOWED[name])}, against the design graph"


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_imports_name_only_declared_packages(name: str) -> None:
    project = PACKAGES[name]["project"]
    own = name.replace("-", "_")
    required = {_req_name(r) for r in project.get("dependencies", [])}
    optional = {_req_name(r) for reqs in project.get("optional-dependencies", {}).values() for r in reqs}
    sibling_modules = {p.replace("-", "_"): p for p in PACKAGES}
    declared_modules = {IMPORT_NAMES.get(d, d.replace("-", "_")) for d in required | optional}
    problems = []
    for module, where in _imports(PACKAGES[name]["dir"] / "src").items():
        if module == own or module in sys.stdlib_module_names or module == "__future__":
            continue
        if module in sibling_modules:
            if sibling_modules[module] not in required:
                problems.append(f"{where[0]} imports {module}, but {name} does not declare {sibling_modules[module]}")
        elif module not in declared_modules:
            problems.append(f"{where[0]} imports {module}, which {name} declares neither as dependency nor extra")
    assert not problems, "\n".join(problems)
