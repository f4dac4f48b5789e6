"""``ParallelConfig``: how many ways each parallel dimension is split, and in which rank order.

The data-parallel size is not a field: it is derived from the world size (``world / (tp * cp * pp)``). Checks that
need the world size live in :func:`mcore_parallel.layout.RankLayout.build`, which reports every conflict at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_parallel.errors import ParallelConfigError

__all__ = ["ParallelConfig", "ORDER_TOKENS"]

ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout of a run. Every field has a default that means "not split"."""

    tp: int = 1
    """Tensor-parallel size: attention heads and MLP columns split across this many ranks."""
    pp: int = 1
    """Pipeline-parallel size: the layers split into this many stages."""
    cp: int = 1
    """Context-parallel size: the sequence split across this many ranks inside attention."""
    ep: int = 1
    """Expert-parallel size: MoE experts split across this many ranks."""
    expert_tp: int | None = None
    """Tensor-parallel size inside each expert; ``None`` means the same as ``tp``."""
    vpp: int | None = None
    """Virtual pipeline stages (model chunks) per pipeline rank for the interleaved schedule; ``None`` = 1."""
    order: str = "tp-cp-ep-dp-pp"
    """Rank order, fastest-varying dimension first (Megatron's ``--rank-order`` convention)."""
    sequence_parallel: bool = False
    """Shard activations outside the TP regions along the sequence (needs ``tp > 1`` to do anything)."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name}={value!r} must be a positive integer")
        for name in ("expert_tp", "vpp"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                problems.append(f"{name}={value!r} must be a positive integer or None")
        problems.extend(_order_problems(self.order))
        if self.vpp is not None and self.vpp > 1 and isinstance(self.pp, int) and self.pp == 1:
            problems.append(f"vpp={self.vpp} needs pipeline parallelism (pp > 1); set vpp=None or raise pp")
        if problems:
            raise ParallelConfigError(problems)

    @property
    def expert_tp_size(self) -> int:
        return self.tp if self.expert_tp is None else self.expert_tp

    @property
    def vpp_size(self) -> int:
        return 1 if self.vpp is None else self.vpp

    @property
    def order_tokens(self) -> tuple[str, ...]:
        return tuple(self.order.split("-"))


def _order_problems(order: str) -> list[str]:
    if not isinstance(order, str):
        return [f"order={order!r} must be a string such as 'tp-cp-ep-dp-pp'"]
    tokens = order.split("-")
    problems = []
    unknown = [t for t in tokens if t not in ORDER_TOKENS]
    if unknown:
        problems.append(f"order={order!r} has unknown dimension(s) {unknown}; allowed: {', '.join(ORDER_TOKENS)}")
    dupes = sorted({t for t in tokens if tokens.count(t) > 1})
    if dupes:
        problems.append(f"order={order!r} repeats {dupes}; name each of {', '.join(ORDER_TOKENS)} once")
    missing = [t for t in ORDER_TOKENS if t not in tokens]
    if missing and not unknown:
        problems.append(f"order={order!r} is missing {missing}; name each of {', '.join(ORDER_TOKENS)} once")
    return problems
