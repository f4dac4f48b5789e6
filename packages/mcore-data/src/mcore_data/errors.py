"""The exception hierarchy of mcore-data.

User mistakes (a corrupt file, an existing output, a missing optional dependency, a bad configuration) get their own
classes so that callers can tell them apart from internal faults. Every class derives from :class:`MCoreDataError`.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "EmptyInputError",
    "ImageDecodeError",
    "IndexFormatError",
    "InputFormatError",
    "MCoreDataError",
    "MissingDependencyError",
    "OutputExistsError",
]


class MCoreDataError(Exception):
    """Base class of every error raised on purpose by mcore-data."""


class IndexFormatError(MCoreDataError, ValueError):
    """A ``.bin``/``.idx`` pair (or an index cache) is corrupt or not in Megatron's format; names the file."""

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.path, self.problem))


class InputFormatError(MCoreDataError, ValueError):
    """A raw input line (JSONL, text) could not be read; names the file and line."""

    def __init__(self, path: object, line: int, problem: str) -> None:
        self.path = str(path)
        self.line = line
        self.problem = problem
        super().__init__(f"{self.path}:{line}: {problem}")

    def __reduce__(self) -> tuple[type, tuple[str, int, str]]:  # raised in worker processes, re-raised in the main one
        return (type(self), (self.path, self.line, self.problem))


class OutputExistsError(MCoreDataError, FileExistsError):
    """An output file exists already and overwriting was not asked for."""


class MissingDependencyError(MCoreDataError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""

    def __init__(self, module: str, extra: str) -> None:
        super().__init__(f"{module!r} is not installed; install it with: pip install 'mcore-data[{extra}]'")


class ConfigError(MCoreDataError, ValueError):
    """A dataset or CLI configuration is inconsistent; the message says how to fix it."""


class EmptyInputError(MCoreDataError, ValueError):
    """The inputs hold no document (empty files, or only blank or malformed lines)."""


class ImageDecodeError(MCoreDataError, ValueError):
    """An image of a multimodal sample could not be decoded; names the shard and sample key."""
