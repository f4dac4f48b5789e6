"""A demo corpus that needs no download: the running interpreter's standard library ``.py`` files as JSONL."""

from __future__ import annotations

import json
import logging
import os
import sysconfig
from pathlib import Path

from mcore_data._files import check_outputs, temporary_path

__all__ = ["stdlib_files", "write_demo_corpus"]

logger = logging.getLogger(__name__)


def stdlib_files() -> list[Path]:
    """Every ``.py`` file of the standard library (sorted; site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def write_demo_corpus(
    out: str | os.PathLike[str],
    *,
    max_files: int | None = None,
    min_bytes: int = 0,
    overwrite: bool = False,
) -> tuple[int, int]:
    """Write ``{"text": source, "path": relative path}`` lines; returns (documents, bytes).

    ``max_files`` keeps the first files only (small test corpora); ``min_bytes`` repeats the corpus (with a pass
    number in ``path``) until the output holds at least that many bytes.
    """
    out = Path(out)
    check_outputs([out], overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files()[:max_files]
    docs = written = 0
    tmp = temporary_path(out)
    with open(tmp, "w", encoding="utf-8") as f:
        passes = 0
        while True:
            for p in files:
                try:
                    text = p.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                rel = str(p.relative_to(root)) + (f"#{passes}" if passes else "")
                line = json.dumps({"text": text, "path": rel}, ensure_ascii=False) + "\n"
                f.write(line)
                docs += 1
                written += len(line.encode("utf-8"))
            passes += 1
            if written >= min_bytes or not files:
                break
    os.replace(tmp, out)
    logger.info("wrote demo corpus %s: %d documents, %d bytes", out, docs, written)
    return docs, written
