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

__all__ = ["RankLayout", "groups_for", "layout_problems"]

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


def layout_problems(config: ParallelConfig, world_size: int) -> list[str]:
    """Why ``config`` cannot split ``world_size`` ranks (empty when it can), each in integers with how to fix it."""
    c = config
    if world_size < 1:
        return [f"world size {world_size} must be at least 1"]
    model = c.tp * c.cp * c.pp
    if world_size % model:
        return [
            f"world size {world_size} is not divisible by tp*cp*pp = {c.tp}*{c.cp}*{c.pp} = {model}; launch a "
            f"multiple of {model} processes, or lower tp, cp or pp until their product divides {world_size}"
        ]
    dp = world_size // model
    etp, per_stage = c.expert_tp_size, world_size // c.pp
    if per_stage % (etp * c.ep) == 0:
        return []
    if c.expert_tp is None:  # expert_tp = tp: tp*ep divides tp*cp*dp exactly when ep divides cp*dp
        fix = f"ep={c.ep} must divide dp*cp = {dp}*{c.cp} = {dp * c.cp}; choose an ep that divides {dp * c.cp}"
    else:
        fix = f"choose expert_tp and ep whose product divides {per_stage}"
    return [
        f"expert_tp*ep = {etp}*{c.ep} = {etp * c.ep} does not divide the ranks of one pipeline stage "
        f"(tp*cp*dp = {c.tp}*{c.cp}*{dp} = {per_stage}); {fix}"
    ]


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
        problems = layout_problems(c, world_size)
        if problems:
            sizes = f"tp={c.tp} pp={c.pp} cp={c.cp} ep={c.ep}" + (f" expert_tp={c.expert_tp}" if c.expert_tp else "")
            raise ParallelConfigError(problems, header=f"parallel layout {sizes} does not fit world size {world_size}")
        etp = c.expert_tp_size
        model = c.tp * c.cp * c.pp
        dp = world_size // model
        per_stage = world_size // c.pp
        expert_model = etp * c.ep
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
