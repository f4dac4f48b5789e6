"""Finding a Megatron-LM checkpoint on disk and reading its ``torch_dist`` form.

A Megatron-LM save directory holds ``latest_checkpointed_iteration.txt`` (an iteration number, or ``release``) and one
directory per checkpoint, ``iter_0000100`` (or ``release``). A checkpoint directory is either ``torch_dist`` (PyTorch
distributed checkpointing: ``.metadata`` plus ``__<rank>_<i>.distcp`` shards, ``metadata.json``, the common state in
``common.pt`` or, in newer versions, in the ``common_state`` item) or legacy (``mp_rank_XX[_YYY[_ZZZ]]/
model_optim_rng.pt``, :mod:`mcore_export.megatron.legacy`). :func:`open_checkpoint` resolves a path to a
:class:`TorchDistCheckpoint` or a :class:`~mcore_export.megatron.legacy.LegacyCheckpoint`; both yield mcore-named
global tensors one at a time.

``torch_dist`` tensors are global (whatever tp/pp/ep saved them) and read with ``torch.distributed.checkpoint``'s own
``FileSystemReader`` into a tensor of the whole saved shape: one stacked ``[num_layers, ...]`` tensor at a time.
"""

from __future__ import annotations

import io
import logging
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from mcore_export.megatron._unpickle import MegatronFormatError, load_pickled
from mcore_export.megatron.layout import to_mcore_name

__all__ = ["resolve_iteration_dir", "open_checkpoint", "TorchDistCheckpoint", "TRACKER"]

logger = logging.getLogger(__name__)
TRACKER = "latest_checkpointed_iteration.txt"
_OPTIMIZER_STATES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "fp32_param": "master", "param": "master"}
_SKIP_PREFIXES = ("rng_state", "common_state", "rerun_state_machine", "optimizer.", "opt_param_scheduler")


def resolve_iteration_dir(path: str | Path, iteration: int | None = None) -> Path:
    """The checkpoint directory of a save directory (its latest, or ``iteration``), or ``path`` itself when it is
    one. Errors name what is missing and how to point at a checkpoint."""
    p = Path(path)
    if not p.exists():
        raise MegatronFormatError(f"{p}: does not exist (pass the run's --save directory, or one iter_NNNNNNN in it)")
    if not p.is_dir():
        raise MegatronFormatError(f"{p}: is not a directory")
    if iteration is not None:
        wanted = p / f"iter_{iteration:07d}"
        if wanted.is_dir():
            return wanted
        have = sorted(d.name for d in p.glob("iter_*") if d.is_dir())
        raise MegatronFormatError(f"{wanted}: no checkpoint of iteration {iteration} (found: {have or 'none'})")
    if _checkpoint_format(p) is not None or re.fullmatch(r"iter_\d+|release", p.name):
        return p
    tracker = p / TRACKER
    if tracker.exists():
        text = tracker.read_text().strip()
        if text == "release":
            target = p / "release"
        elif text.isdigit():
            target = p / f"iter_{int(text):07d}"
        else:
            raise MegatronFormatError(f"{tracker}: holds {text[:40]!r}, not an iteration number or 'release'")
        if not target.is_dir():
            raise MegatronFormatError(f"{tracker} names iteration {text}, but {target} does not exist; pass "
                                      "--iteration N for another one")  # fmt: skip
        return target
    have = sorted(d.name for d in p.glob("iter_*") if d.is_dir())
    if have:
        raise MegatronFormatError(f"{p}: no {TRACKER}; pass --iteration N to choose one of {have}")
    raise MegatronFormatError(
        f"{p}: not a Megatron checkpoint: no {TRACKER}, no iter_NNNNNNN directories, no .metadata (torch_dist) and "
        "no mp_rank_* directories (legacy)"
    )


def _checkpoint_format(p: Path) -> str | None:
    if (p / ".metadata").exists():
        return "torch_dist"
    if any(p.glob("mp_rank_*")):
        return "legacy"
    return None


def open_checkpoint(path: str | Path, iteration: int | None = None) -> Any:
    """A :class:`TorchDistCheckpoint` or :class:`~mcore_export.megatron.legacy.LegacyCheckpoint` for ``path``."""
    d = resolve_iteration_dir(path, iteration)
    fmt = _checkpoint_format(d)
    if fmt == "torch_dist":
        return TorchDistCheckpoint(d)
    if fmt == "legacy":
        from mcore_export.megatron.legacy import LegacyCheckpoint

        return LegacyCheckpoint(d)
    found = sorted(x.name for x in d.iterdir())[:10]
    if (d / "model_weights.ckpt").exists() or any(d.glob("*.distcp")) or (d / "metadata.json").exists():
        raise MegatronFormatError(f"{d}: has {found} but no .metadata: an incomplete torch_dist checkpoint?")
    raise MegatronFormatError(
        f"{d}: unknown checkpoint format (found {found}); expected torch_dist (.metadata + __*_*.distcp) or legacy "
        "(mp_rank_XX/model_optim_rng.pt); convert other formats with Megatron-LM's tools first"
    )


def _load(state: dict[str, Any], reader: FileSystemReader, planner: DefaultLoadPlanner | None = None) -> None:
    """``torch.distributed.checkpoint.load`` in this one process (its warning about that is expected here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(state, storage_reader=reader, planner=planner, no_dist=True)


class _RawBytes(DefaultLoadPlanner):
    """Keeps a bytes item's raw bytes (the default planner would ``torch.load`` them, importing megatron's classes)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)
        self.raw: dict[str, bytes] = {}

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.raw[read_item.dest_index.fqn] = value.read()


class TorchDistCheckpoint:
    """One ``torch_dist`` checkpoint directory: its args, iteration and global tensors under mcore's names."""

    format = "torch_dist"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._reader = FileSystemReader(str(path))
        try:
            self.metadata = self._reader.read_metadata()
        except Exception as e:
            raise MegatronFormatError(f"{path / '.metadata'}: cannot be read ({type(e).__name__}: {e})") from None
        items = self.metadata.state_dict_metadata
        self.tensors = {k: v for k, v in items.items() if isinstance(v, TensorStorageMetadata)}
        self.objects = {k for k, v in items.items() if isinstance(v, BytesStorageMetadata)}
        self.common = self._common()
        self.args = self.common.get("args")
        self.iteration = int(self.common.get("iteration", 0) or 0)

    def _common(self) -> dict[str, Any]:
        legacy = self.path / "common.pt"
        if legacy.exists():
            common = load_pickled(legacy)
        else:
            key = next((k for k in self.objects if k.startswith("common_state/")), None)
            if key is None:
                return {}
            common = load_pickled(self._bytes(key), f"{self.path}: item {key}")
            if isinstance(common, list) and len(common) == 1:  # a ShardedObject's data: [the common dict]
                common = common[0]
        if not isinstance(common, dict):
            raise MegatronFormatError(f"{self.path}: the common state is a {type(common).__name__}, not a dict")
        return common

    def _bytes(self, key: str) -> bytes:
        planner = _RawBytes()
        _load({key: io.BytesIO()}, self._reader, planner)
        return planner.raw[key]

    def read(self, key: str) -> torch.Tensor:
        """The whole saved tensor ``key`` (Megatron's name)."""
        md = self.tensors[key]
        out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        try:
            _load({key: out}, self._reader)
        except Exception as e:
            raise MegatronFormatError(f"{self.path}: tensor {key!r} cannot be read ({type(e).__name__}: {e})") from None
        return out

    def _expand(self, key: str, prefix: str, num_layers: int) -> Iterator[tuple[str, torch.Tensor]]:
        """mcore-named per-layer tensors of the Megatron tensor ``prefix + key``."""
        m = re.match(r"^decoder\.layers\.(\d+\.)?(.+)$", key)
        if m is None:
            if not key.endswith("_extra_state"):
                yield key, self.read(prefix + key)
            return
        inner = to_mcore_name(m.group(2))
        if inner is None:
            return
        t = self.read(prefix + key)
        if m.group(1) is not None:  # a model with mixed layers: one tensor per layer
            yield f"decoder.layers.{int(m.group(1)[:-1])}.{inner}", t
            return
        if t.shape[0] != num_layers:
            raise MegatronFormatError(
                f"{self.path}: {prefix + key} stacks {t.shape[0]} layers but the model has num_layers={num_layers} "
                "(fix --num-layers)"
            )
        for i in range(num_layers):
            yield f"decoder.layers.{i}.{inner}", t[i]

    def model_tensors(self, num_layers: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(mcore name, global tensor) of every model tensor; Megatron's padded vocabulary rows are kept."""
        for key in self.tensors:
            if not key.startswith(_SKIP_PREFIXES):
                yield from self._expand(key, "", num_layers)

    def optimizer_tensors(self, num_layers: int) -> Iterator[tuple[str, str, torch.Tensor]]:
        """(mcore name, mcore state ``master``/``exp_avg``/``exp_avg_sq``, tensor) of the saved Adam state."""
        found = False
        for key in self.tensors:
            m = re.match(r"^optimizer\.state\.([a-z0-9_]+)\.(.+)$", key)
            if m is None or m.group(1) not in _OPTIMIZER_STATES:
                continue
            found = True
            state = _OPTIMIZER_STATES[m.group(1)]
            for name, t in self._expand(m.group(2), f"optimizer.state.{m.group(1)}.", num_layers):
                yield name, state, t
        if not found:
            flat = any(k.startswith("optimizer.distributed") for k in self.tensors) or any(
                k.startswith("optimizer.distributed") for k in self.objects
            )
            hint = (
                "it was saved by the distributed optimizer in its dp_reshardable form, which only the same data-parallel "
                "layout can read; re-save it with --dist-ckpt-optim-fully-reshardable (or "
                "--ckpt-fully-parallel-save with fully_sharded_model_space), or import the weights only (drop --optimizer)"
                if flat
                else "it has no optimizer state (saved with --no-save-optim?); import the weights only (drop --optimizer)"
            )
            raise MegatronFormatError(f"{self.path}: no optimizer.state.* tensors: {hint}")

    def has_master_weights(self) -> bool:
        """Whether the optimizer state holds fp32 master weights (runs in bf16/fp16 do; fp32 runs need none)."""
        return any(re.match(r"^optimizer\.state\.(fp32_param|param)\.", k) for k in self.tensors)
