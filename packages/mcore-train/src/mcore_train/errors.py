"""Exceptions raised by mcore-train."""

from __future__ import annotations


class MCoreTrainError(Exception):
    """Base class of every error mcore-train raises on purpose."""


class ConfigError(MCoreTrainError, ValueError):
    """A training configuration with problems; ``problems`` lists all of them, each naming the key."""

    def __init__(self, problems: list[str], header: str = "invalid training configuration") -> None:
        self.problems = list(problems)
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{header} ({len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}):\n{body}")


class TrainingDiverged(MCoreTrainError, RuntimeError):
    """The loss became nan or inf (the message names the step)."""
