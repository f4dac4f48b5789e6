"""Weight initialisation that does not depend on the tensor-parallel size.

Each rank builds the full (unsharded) weight with the same generator and keeps its own slice, so for a fixed seed
the unsharded weight is bit-identical for every TP size. With ``seed=None`` the global RNG of the weight's device is
used instead (identical across ranks only if every rank seeded it identically, e.g. with ``torch.manual_seed``).
Seeds for individual parameters come from :func:`derive_seed`, a stable hash of a base seed and a name, so that the
weights of a layer do not depend on how many layers another pipeline stage holds.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch

__all__ = ["InitMethod", "normal_init", "scaled_normal_init", "derive_seed", "init_sharded_"]

InitMethod = Callable[[torch.Tensor, "torch.Generator | None"], object]
"""Fills a tensor in place, drawing from the given generator (or the global RNG when it is ``None``)."""


def normal_init(std: float = 0.02) -> InitMethod:
    """N(0, std²), Megatron's ``init_method_normal``."""

    def init(t: torch.Tensor, generator: torch.Generator | None) -> object:
        return torch.nn.init.normal_(t, mean=0.0, std=std, generator=generator)

    return init


def scaled_normal_init(std: float, num_layers: int) -> InitMethod:
    """N(0, (std / sqrt(2 * num_layers))²) for output projections, Megatron's ``scaled_init_method_normal``."""
    return normal_init(std / math.sqrt(2.0 * num_layers))


def derive_seed(base_seed: int, key: str) -> int:
    """A 63-bit seed derived from ``base_seed`` and a name; stable across processes and Python versions."""
    digest = hashlib.sha256(f"{base_seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_sharded_(
    weight: torch.Tensor,
    full_shape: tuple[int, ...],
    shard_dim: int,
    rank: int,
    world: int,
    init_method: InitMethod,
    seed: int | None,
    padded_rows: int = 0,
    stride: int = 1,
) -> None:
    """Fill ``weight`` (this rank's shard) with its slice of a full weight of ``full_shape``.

    The full weight is drawn in float32 on the shard's device and cast, so a bf16 shard equals the bf16 cast of the
    float32 reference. ``padded_rows`` zero rows are appended along dim 0 before sharding (vocabulary padding); they
    are not drawn from the generator, so padding never changes the real rows. With ``stride`` > 1 the full weight is
    ``stride`` blocks along ``shard_dim`` (e.g. the gate and up halves of a gated MLP) and the shard is this rank's
    chunk of every block, concatenated.
    """
    if weight.device.type == "meta":
        return
    generator = None
    if seed is not None:
        generator = torch.Generator(device=weight.device)
        generator.manual_seed(seed)
    full = torch.empty(full_shape, dtype=torch.float32, device=weight.device)
    init_method(full, generator)
    if padded_rows:
        full = torch.cat([full, full.new_zeros((padded_rows, *full_shape[1:]))], dim=0)
    expected = list(full.shape)
    expected[shard_dim] //= world
    if list(weight.shape) != expected or full.shape[shard_dim] % (world * stride):
        raise ValueError(f"shard shape {tuple(weight.shape)} does not match {tuple(full.shape)} split {world} ways")
    blocks = full.chunk(stride, shard_dim)
    weight.copy_(torch.cat([b.chunk(world, shard_dim)[rank] for b in blocks], dim=shard_dim))
