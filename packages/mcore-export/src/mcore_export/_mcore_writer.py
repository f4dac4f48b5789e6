"""Writing an mcore checkpoint from converted global tensors (the importers' shared back end).

An import writes what a run of the chosen tp x pp layout would save (``docs/checkpoints.md``): the root group with the
model config and an ``imported_from`` record, ``model/<key>`` arrays chunked like the layout's TP pieces and, when an
optimizer state comes along, ``optimizer/<key>/{master,exp_avg,exp_avg_sq}`` chunked the same way. The chunking is
taken from a ``meta``-device model of that layout, so it is always the model's own.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from mcore_export.errors import LayoutError
from mcore_models import GPTModel, TransformerConfig
from mcore_parallel import Group
from mcore_parallel.checkpoint import FORMAT_VERSION
from mcore_parallel.checkpoint.zarr_io import ArraySpec, write_array_metadata, write_chunk, write_group_metadata
from mcore_parallel.sharding import ShardedTensor

__all__ = ["check_layout", "layout_infos", "write_parameter", "import_attrs", "start_checkpoint"]


def check_layout(config: TransformerConfig, tp: int, pp: int) -> None:
    """Refuse a tp x pp the model cannot be split into (heads, groups and layers must divide)."""
    problems = config.problems(tp)
    if tp < 1 or pp < 1 or pp > config.num_layers or problems:
        raise LayoutError(
            f"tp={tp}, pp={pp} does not fit the model ({config.num_layers} layers): "
            + "; ".join(problems or ["tp and pp must be at least 1 and pp at most num_layers"])
        )


def layout_infos(config: TransformerConfig, tp: int) -> dict[str, ShardedTensor]:
    """Every global parameter of the model by key, with the chunking a tp-way run saves it with."""
    # MoE layers under tp > 1 need sequence parallelism; it marks parameters but does not change their chunks
    tp_group = Group("tp", tuple(range(tp)), 0, None)
    meta_model = GPTModel(config, tp=tp_group, sequence_parallel=config.moe is not None, device="meta")
    infos: dict[str, ShardedTensor] = {}
    for info in meta_model.sharded_state_dict().values():
        infos.setdefault(info.key, info)
    return infos


def write_parameter(array_dir: Path, info: ShardedTensor, tensor: torch.Tensor, kind: str = "parameter") -> None:
    """One global tensor as a zarr array chunked as a run of the chosen layout would save it."""
    chunk = tuple(max(c, 1) for c in (info.chunk_shape or info.global_shape))
    spec = ArraySpec(info.global_shape, tensor.dtype, chunk)
    write_array_metadata(array_dir, spec, {"kind": kind})
    for index in itertools.product(*(range(n) for n in spec.grid())):
        region = tuple(slice(i * c, (i + 1) * c) for i, c in zip(index, chunk))
        write_chunk(array_dir, spec, index, tensor[region])


def import_attrs(
    out_path: Path, config: TransformerConfig, tp: int, pp: int, source: dict[str, Any], step: int = 0
) -> dict[str, Any]:
    """The checkpoint's top-level metadata for an import (the layout its chunks follow, the source)."""
    return {
        "format": "mcore-checkpoint",
        "format_version": FORMAT_VERSION,
        "name": out_path.name,
        "saved_layout": {"world_size": tp * pp, "tp": tp, "pp": pp, "dp": 1, "cp": 1, "ep": 1},
        "step": step,
        "consumed_samples": 0,
        "model": config.to_dict(),
        "imported_from": source,
    }


def start_checkpoint(tmp: Path, attrs: dict[str, Any]) -> None:
    """The root group (with ``attrs``) and the empty ``model`` and ``optimizer`` groups."""
    write_group_metadata(tmp, attrs)
    write_group_metadata(tmp / "model")
    write_group_metadata(tmp / "optimizer")
