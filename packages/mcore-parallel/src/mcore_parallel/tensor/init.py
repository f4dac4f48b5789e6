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
from collections.abc import Callable, Sequence

import torch

__all__ = ["InitMethod", "normal_init", "scaled_normal_init", "derive_seed", "init_sharded_", "block_sizes"]

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


def block_sizes(total: int, stride: int = 1, blocks: Sequence[int] | None = None) -> tuple[int, ...]:
    """The sizes of the blocks a TP-split dimension of ``total`` elements is made of, each split on its own across
    the group: ``blocks`` when given (they must add up to ``total``), else ``stride`` equal blocks."""
    if blocks is not None:
        sizes = tuple(int(b) for b in blocks)
        if stride != 1:
            raise ValueError(f"blocks={sizes} and stride={stride} cannot both be given (stride is equal blocks)")
        if not sizes or any(b < 1 for b in sizes) or sum(sizes) != total:
            raise ValueError(f"blocks={sizes} must be positive sizes adding up to {total}")
        return sizes
    if stride < 1 or total % stride:
        raise ValueError(f"{total} elements are not {stride} equal blocks (stride={stride})")
    return (total // stride,) * stride


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
    blocks: Sequence[int] | None = None,
) -> None:
    """Fill ``weight`` (this rank's shard) with its slice of a full weight of ``full_shape``.

    The full weight is drawn in float32 on the shard's device and cast, so a bf16 shard equals the bf16 cast of the
    float32 reference. ``padded_rows`` zero rows are appended along dim 0 before sharding (vocabulary padding); they
    are not drawn from the generator, so padding never changes the real rows. With ``stride`` > 1 the full weight is
    ``stride`` blocks along ``shard_dim`` (e.g. the gate and up halves of a gated MLP) and the shard is this rank's
    chunk of every block, concatenated. ``blocks`` gives blocks of unequal sizes instead (e.g. the ``[z, x, B, C,
    dt]`` input projection of a Mamba mixer), each split across the group in the same way.
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
    sizes = block_sizes(full.shape[shard_dim], stride, blocks)
    expected = list(full.shape)
    expected[shard_dim] //= world
    if list(weight.shape) != expected or any(b % world for b in sizes):
        what = f"{len(sizes)} blocks of {sizes}" if blocks is not None else f"{tuple(full.shape)}"
        raise ValueError(f"shard shape {tuple(weight.shape)} does not match {what} split {world} ways")
    parts = full.split(list(sizes), shard_dim)
    weight.copy_(torch.cat([b.chunk(world, shard_dim)[rank] for b in parts], dim=shard_dim))
