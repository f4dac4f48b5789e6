"""mcore-data installs as a distribution, imports, and declares its dependencies as promised."""

import importlib.metadata as md

import pytest

from tests._install import check_installed


def test_installed_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    # tests/_install.py looks for "==" in the whole requirement string, so the environment marker of an optional
    # extra (`torch>=2.4; extra == "torch"`) reads as a pin. Check the specifiers only, markers stripped.
    requires = md.requires
    monkeypatch.setattr(md, "requires", lambda name: [r.split(";")[0].strip() for r in requires(name) or []])
    check_installed("mcore-data")
