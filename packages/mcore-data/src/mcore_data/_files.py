"""File helpers: refusing to overwrite, temporary names renamed into place, and an inter-process file lock."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from mcore_data.errors import OutputExistsError

__all__ = ["FileLock", "check_outputs", "temporary_path"]

logger = logging.getLogger(__name__)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def check_outputs(paths: Sequence[str | os.PathLike[str]], overwrite: bool) -> None:
    """Raise :class:`OutputExistsError` listing every path in ``paths`` that exists, unless ``overwrite``."""
    existing = [str(p) for p in paths if os.path.exists(p)]
    if existing and not overwrite:
        raise OutputExistsError(
            f"refusing to overwrite existing output(s): {', '.join(existing)} (pass --overwrite / overwrite=True)"
        )


def temporary_path(path: str | os.PathLike[str]) -> Path:
    """The name a file is written under before it is renamed to ``path`` (same directory, so rename is atomic)."""
    p = Path(path)
    return p.with_name(f".{p.name}.tmp-{os.getpid()}")


class FileLock:
    """An exclusive lock on ``path`` shared by processes of one machine (``fcntl.flock``; ``O_EXCL`` elsewhere).

    Used so that one rank builds an index cache while the others wait and then load it.
    """

    def __init__(self, path: str | os.PathLike[str], poll_s: float = 0.1) -> None:
        self.path = Path(path)
        self.poll_s = poll_s
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX
            while True:
                try:
                    self._fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                    return
                except FileExistsError:
                    time.sleep(self.poll_s)
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            logger.info("waiting for another process holding %s", self.path)
            fcntl.flock(fd, fcntl.LOCK_EX)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            import fcntl

            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
        except ImportError:  # pragma: no cover - not POSIX
            os.close(self._fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._fd = None

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@contextlib.contextmanager
def removing_on_error(*paths: Path) -> Iterator[None]:
    """Delete ``paths`` (temporary files) if the body raises."""
    try:
        yield
    except BaseException:
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        raise
