"""Sharded zarr v3 checkpoints: one global array per tensor, written in parallel, loadable under any layout."""

from mcore_parallel.checkpoint.manager import CheckpointManager, SaveStats, latest_checkpoint, read_metadata
from mcore_parallel.checkpoint.sharded import FORMAT_VERSION, load_model, load_optimizer
from mcore_parallel.checkpoint.verify import verify_checkpoint, verify_path
from mcore_parallel.checkpoint.zarr_io import CheckpointFormatError, read_array_spec, read_region

__all__ = [
    "CheckpointManager",
    "SaveStats",
    "latest_checkpoint",
    "read_metadata",
    "load_model",
    "load_optimizer",
    "read_region",
    "read_array_spec",
    "CheckpointFormatError",
    "FORMAT_VERSION",
    "verify_checkpoint",
    "verify_path",
]
