"""Fixtures for the export tests: checkpoints saved under several layouts, cached per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def ckpt_cache(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``{(name, tp, pp): checkpoint path}`` filled lazily by tests (saves are the slow part)."""
    return {}


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")
