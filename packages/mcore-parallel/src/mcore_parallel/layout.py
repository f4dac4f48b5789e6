"""Pure rank arithmetic: which ranks form each process group, computed from a config and a world size.

No process groups are created here, so layouts can be checked (and tested) without launching anything. A rank's
coordinates come from the order string with the first dimension varying fastest: with ``tp-cp-ep-dp-pp`` and
tp=2, ranks 0 and 1 share a tensor-parallel group.

Dense layers use the order without ``ep`` (sizes tp, cp, dp, pp). Expert layers use the order without ``cp``, with
sizes expert_tp, ep, expert_dp and pp ("MoE parallel folding"): both layouts share the pipeline dimension, and
``expert_tp * ep * expert_dp == tp * cp * dp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mcore_parallel.config import ParallelConfig
from mcore_parallel.errors import ParallelConfigError

__all__ = ["RankLayout", "groups_for"]

Groups = tuple[tuple[int, ...], ...]

# Group kinds of the dense layout (dimension sets) and of the expert layout.
DENSE_KINDS = {
    "tp": ("tp",),
    "pp": ("pp",),
    "dp": ("dp",),
    "cp": ("cp",),
    "dp_cp": ("dp", "cp"),
    "tp_cp": ("tp", "cp"),
    "mp": ("tp", "pp"),
    "tp_dp_cp": ("tp", "dp", "cp"),
}
EXPERT_KINDS = {
    "ep": ("ep",),
    "expert_tp": ("tp",),
    "expert_dp": ("dp",),
    "expert_tp_ep": ("tp", "ep"),
}


def groups_for(world_size: int, dims: tuple[str, ...], sizes: dict[str, int], grouped: tuple[str, ...]) -> Groups:
    """Partition ``range(world_size)`` into groups that vary only along ``grouped`` dimensions.

    ``dims`` is the rank order (fastest first), ``sizes`` the size of each dimension (their product must equal the
    world size). Members are sorted by rank and groups by their first member.
    """
    assert math.prod(sizes[d] for d in dims) == world_size, (dims, sizes, world_size)
    buckets: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world_size):
        rest, key = rank, []
        for d in dims:
            coord, rest = rest % sizes[d], rest // sizes[d]
            if d not in grouped:
                key.append(coord)
        buckets.setdefault(tuple(key), []).append(rank)
    return tuple(sorted(tuple(v) for v in buckets.values()))


@dataclass(frozen=True)
class RankLayout:
    """Every group of every kind for one world size. Build with :meth:`build`, which validates."""

    config: ParallelConfig
    world_size: int
    dp: int
    expert_dp: int
    groups: dict[str, Groups]

    @classmethod
    def build(cls, config: ParallelConfig, world_size: int) -> RankLayout:
        c = config
        problems = []
        if world_size < 1:
            problems.append(f"world size {world_size} must be at least 1")
        model = c.tp * c.cp * c.pp
        if world_size % model:
            problems.append(
                f"world size {world_size} is not divisible by tp*cp*pp = {c.tp}*{c.cp}*{c.pp} = {model}; "
                f"use a world size that is a multiple of {model} or shrink tp, cp or pp"
            )
        dp = world_size // model if world_size % model == 0 else 0
        etp = c.expert_tp_size
        per_stage = world_size // c.pp if world_size % c.pp == 0 else 0
        expert_model = etp * c.ep
        if per_stage and per_stage % expert_model:
            problems.append(
                f"expert_tp*ep = {etp}*{c.ep} = {expert_model} does not divide the ranks of one pipeline stage "
                f"(tp*cp*dp = {per_stage}); with expert_tp = tp this means ep={c.ep} must divide dp*cp = "
                f"{per_stage // c.tp if per_stage % c.tp == 0 else per_stage / c.tp}"
            )
        if problems:
            raise ParallelConfigError(problems, header=f"parallel layout {c} does not fit world size {world_size}")
        expert_dp = per_stage // expert_model
        dense_dims = tuple(t for t in c.order_tokens if t != "ep")
        dense_sizes = {"tp": c.tp, "cp": c.cp, "dp": dp, "pp": c.pp}
        expert_dims = tuple(t for t in c.order_tokens if t != "cp")
        expert_sizes = {"tp": etp, "ep": c.ep, "dp": expert_dp, "pp": c.pp}
        groups = {k: groups_for(world_size, dense_dims, dense_sizes, v) for k, v in DENSE_KINDS.items()}
        groups.update({k: groups_for(world_size, expert_dims, expert_sizes, v) for k, v in EXPERT_KINDS.items()})
        groups["embedding"] = tuple(tuple(sorted({g[0], g[-1]})) for g in groups["pp"])
        groups["position_embedding"] = tuple((g[0],) for g in groups["pp"])
        groups["world"] = (tuple(range(world_size)),)
        return cls(config=c, world_size=world_size, dp=dp, expert_dp=expert_dp, groups=groups)

    def group_of(self, kind: str, rank: int) -> tuple[int, ...] | None:
        """The group of ``kind`` that contains ``rank`` (``None`` for embedding groups the rank is not in)."""
        for g in self.groups[kind]:
            if rank in g:
                return g
        return None
