"""Shared check that a package installed as a user would get it (used by each package's test_install.py)."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import re
from pathlib import Path

LOCKSTEP = {"mcore-parallel", "mcore-models", "mcore-data", "mcore-train", "mcore-infer", "mcore-export"}


def check_installed(dist_name: str) -> None:
    module = importlib.import_module(dist_name.replace("-", "_"))
    version = md.version(dist_name)
    assert module.__version__ == version, f"{dist_name}: __version__ {module.__version__} != metadata {version}"
    # installed as a real distribution with its typing marker (not only importable from a source tree)
    direct = md.distribution(dist_name).read_text("direct_url.json") or ""
    if '"editable": true' not in direct.replace("'", '"'):  # a development install has no file list to check
        files = [str(f) for f in (md.files(dist_name) or [])]
        assert any(f.endswith("py.typed") for f in files), f"{dist_name}: py.typed is not installed"
    assert (Path(module.__file__).parent / "py.typed").exists()
    # the public API is declared and resolves
    assert isinstance(module.__all__, list) and "__version__" in module.__all__
    for name in module.__all__:
        assert hasattr(module, name), f"{dist_name}: __all__ names {name!r} but the module has no such attribute"
    for req in md.requires(dist_name) or []:
        req = req.split(";", 1)[0]  # the version part only: markers such as `extra == "all"` are not pins
        name = re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower()
        if name == "torch":
            assert "==" not in req, f"{dist_name} pins torch ({req}); declare a range such as torch>=2.4"
        if name in LOCKSTEP:
            assert f"=={version}" in req, f"{dist_name}: sibling {req} must be pinned to the lockstep version {version}"
            check_importable(name)


def check_importable(dist_name: str) -> None:
    importlib.import_module(dist_name.replace("-", "_"))
