"""Helpers for the forwards of ``torch.autograd.Function`` subclasses.

PyTorch 2.11's ``torch.compile`` drops the gradient of an autograd function whose forward returns a tensor through a
method that returns its own input when there is nothing to do (``t.to(t.dtype)``, ``t.float()`` of a float32
tensor, ``t.contiguous()`` of a contiguous one, ``t.type_as(t)``): the compiled graph's output then aliases an
intermediate, and the function's inputs get a zero gradient (eager mode and PyTorch 2.13 are right). A forward
casts its result through :func:`as_dtype`, which calls ``.to`` only when the dtype changes;
``tests/integration/test_autograd_outputs.py`` checks every forward in the packages.
"""

from __future__ import annotations

import torch

__all__ = ["as_dtype"]


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: ``t`` itself when it already is, without a no-op ``.to`` (see the module docstring)."""
    return t if t.dtype == dtype else t.to(dtype)
