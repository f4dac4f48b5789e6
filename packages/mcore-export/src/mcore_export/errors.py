"""Exceptions raised by mcore-export.

User mistakes (an output directory that is not empty, a checkpoint or model directory missing tensors, an output
layout the model cannot be split into) are :class:`ExportError` subclasses. Architectures a target format cannot
represent raise :class:`mcore_models.ConversionError` (from the converters) naming the feature.
"""

from __future__ import annotations

__all__ = ["ExportError", "OutputExistsError", "MissingTensorError", "LayoutError"]


class ExportError(Exception):
    """Base class of every error mcore-export raises on purpose."""


class OutputExistsError(ExportError, FileExistsError):
    """The output directory exists and is not empty (pass ``overwrite=True`` / ``--overwrite`` to replace it)."""


class MissingTensorError(ExportError, KeyError):
    """The source (mcore checkpoint or Hugging Face directory) lacks a tensor the model needs (names it)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class LayoutError(ExportError, ValueError):
    """The requested output tensor/pipeline parallel layout does not fit the model (says which sizes would)."""
