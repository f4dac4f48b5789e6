"""Exceptions raised by mcore-models."""

from __future__ import annotations


class MCoreModelsError(Exception):
    """Base class of every error mcore-models raises on purpose."""


class ConfigError(MCoreModelsError, ValueError):
    """An invalid model configuration. ``problems`` lists every issue found, each with how to fix it."""

    def __init__(self, problems: list[str], header: str = "invalid TransformerConfig") -> None:
        self.problems = list(problems)
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{header} ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}):\n{body}")


class ConversionError(MCoreModelsError, ValueError):
    """A checkpoint or state dict that cannot be converted (names the key or feature)."""
