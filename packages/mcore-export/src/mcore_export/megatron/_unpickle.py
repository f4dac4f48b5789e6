"""Loading Megatron-LM's pickled objects (``model_optim_rng.pt``, ``common.pt``, ``common_state``) without megatron.

A Megatron checkpoint pickles its ``args`` (an ``argparse.Namespace``) and, inside them, a few of megatron's own
classes (enums such as ``AttnBackend``). Loading is PyTorch's ``weights_only`` unpickler with ``argparse.Namespace``
allowed and every class of megatron (or of Transformer Engine, Apex, NVIDIA's resiliency extension) replaced by a
:class:`MegatronObject` that records its name and arguments: nothing of those packages is imported or run. Any other
class a file names is refused with an error that names it and the file.
"""

from __future__ import annotations

import argparse
import collections
import io
import logging
import signal
from pathlib import Path
from typing import IO, Any

import torch

from mcore_export.errors import ExportError

__all__ = ["MegatronObject", "load_pickled", "MegatronFormatError"]

logger = logging.getLogger(__name__)

_STANDIN_PREFIXES = ("megatron.", "transformer_engine.", "apex.", "nvidia_resiliency_ext.", "modelopt.")
_SAFE: list[Any] = [argparse.Namespace, signal.Signals, collections.OrderedDict, collections.defaultdict]


class MegatronFormatError(ExportError, ValueError):
    """A Megatron checkpoint is missing, malformed, or holds something the importer does not read (names it)."""


class MegatronObject:
    """Stands in for an object of one of megatron's classes found in a pickle (its value is kept, not its code)."""

    qualname = "megatron.?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @property
    def value(self) -> Any:
        """An enum member's value (the first constructor argument), else None."""
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"{self.qualname}({', '.join(map(repr, self.args))})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MegatronObject) and (self.qualname, self.args) == (other.qualname, other.args)

    def __hash__(self) -> int:
        return hash((self.qualname, self.args))


def _standin(qualname: str) -> type:
    return type(qualname.rsplit(".", 1)[-1], (MegatronObject,), {"qualname": qualname})


def load_pickled(source: Path | bytes, what: str | None = None) -> Any:
    """``torch.load`` of a Megatron pickle (a file, or the bytes of a distcp item) with megatron's classes stood in.

    ``what`` names the source in errors (default: the path)."""
    name = what or ("a pickled item" if isinstance(source, bytes) else str(source))

    def stream() -> IO[bytes] | Path:
        return io.BytesIO(source) if isinstance(source, bytes) else source

    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(stream())
    except FileNotFoundError:
        raise MegatronFormatError(f"{name}: missing") from None
    except Exception as e:  # not a torch.save file at all
        raise MegatronFormatError(f"{name}: not a torch.save file ({type(e).__name__}: {e})") from None
    known = {f"{c.__module__}.{c.__qualname__}" for c in _SAFE}
    refused = sorted(g for g in unsafe if g not in known and not g.startswith(_STANDIN_PREFIXES))
    if refused:
        raise MegatronFormatError(
            f"{name}: the pickle names classes the importer does not load ({', '.join(refused)}); only tensors, "
            "plain containers, argparse.Namespace and megatron's own classes (stood in, never imported) are read"
        )
    standins = [(_standin(g), g) for g in unsafe if g.startswith(_STANDIN_PREFIXES)]
    with torch.serialization.safe_globals([*_SAFE, *standins]):
        try:
            return torch.load(stream(), map_location="cpu", weights_only=True)
        except Exception as e:
            raise MegatronFormatError(f"{name}: cannot be read ({type(e).__name__}: {e})") from None
