"""Atomic output directories: write into a hidden sibling temporary directory and rename it into place at the end.

A failed or refused export leaves nothing at ``out`` (and removes its temporary directory); an existing non-empty
``out`` is refused unless ``overwrite`` is set, in which case it is replaced only once the new one is complete.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mcore_export.errors import OutputExistsError

__all__ = ["check_output", "staged_output"]

logger = logging.getLogger(__name__)


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse an existing non-empty ``out`` (or a file) unless ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputExistsError(f"{out} exists and is not empty; pass --overwrite (overwrite=True) to replace it")


@contextmanager
def staged_output(out: str | os.PathLike[str], overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``out`` when the block finishes without an exception."""
    out = Path(out).absolute()
    check_output(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp.{out.name}.{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    check_output(out, overwrite)  # someone may have written there meanwhile
    if out.exists():
        trash = out.parent / f".old.{out.name}.{os.getpid()}"
        out.rename(trash)
        tmp.rename(out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        tmp.rename(out)
    logger.info("wrote %s", out)
