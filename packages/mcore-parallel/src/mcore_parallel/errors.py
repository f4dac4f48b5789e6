"""Exceptions raised by mcore-parallel.

``ParallelConfigError`` is a user mistake (a layout that cannot work, a bad environment); it is a ``ValueError`` so
callers that only know the standard library still catch it.
"""

from __future__ import annotations


class MCoreParallelError(Exception):
    """Base class of every error mcore-parallel raises on purpose."""


class ParallelConfigError(MCoreParallelError, ValueError):
    """A parallel layout or launcher environment that cannot work. The message lists every conflict."""

    def __init__(self, problems: list[str], header: str = "invalid parallel configuration") -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{header} ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}):\n{lines}")


class LaunchEnvironmentError(MCoreParallelError, RuntimeError):
    """The launcher's environment variables are missing or inconsistent."""
