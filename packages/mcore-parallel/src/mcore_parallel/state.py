"""``ParallelState``: every process group and rank of this process, as one immutable value.

Build it once with :meth:`ParallelState.initialize` and pass it (or the ``Group`` values it holds) to whatever
needs communication. There is no module-level registry. With a world size of 1 and no launcher, nothing is
initialised in ``torch.distributed`` and every group has size 1 and no process group.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from mcore_parallel._launch import LaunchEnv, read_launch_env
from mcore_parallel.config import ParallelConfig
from mcore_parallel.layout import RankLayout

__all__ = ["Group", "ParallelState", "default_backend", "default_device"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Group:
    """A process group as seen by this process.

    ``ranks`` are global ranks in group order; ``rank`` is this process's index in the group (``-1`` when this
    process is not a member, which happens only for the embedding groups). ``pg`` is ``None`` when the group has
    one member (all collectives are then no-ops) or when torch.distributed is not in use.

    ``exchange`` says how layers built with this group exchange activations where there is a choice (``None``: the
    NCCL collectives; a :class:`~mcore_parallel.tensor.SymmetricExchange` from
    :func:`~mcore_parallel.tensor.with_symmetric_memory`: peer-to-peer copies through symmetric memory). It travels
    with the value: there is no registry keyed by group.
    """

    kind: str
    ranks: tuple[int, ...]
    rank: int
    pg: dist.ProcessGroup | None = field(default=None, repr=False)
    exchange: Any = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_member(self) -> bool:
        return self.rank >= 0

    @classmethod
    def single(cls, kind: str = "single", global_rank: int = 0) -> Group:
        """A one-member group: collectives over it do nothing."""
        return cls(kind, (global_rank,), 0, None)


def default_backend() -> str:
    """``nccl`` when CUDA is available, otherwise ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def default_device(backend: str | None, local_rank: int) -> torch.device:
    """``cuda:local_rank`` with an NCCL backend, or for a single process (no backend) when CUDA is available."""
    if backend is not None:
        return torch.device("cuda", local_rank) if "nccl" in backend else torch.device("cpu")
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


@dataclass(frozen=True, eq=False)
class ParallelState:
    """Every group and rank of this process for one :class:`ParallelConfig`."""

    config: ParallelConfig
    layout: RankLayout
    rank: int
    world_size: int
    local_rank: int
    backend: str | None
    device: torch.device
    tp: Group
    pp: Group
    dp: Group
    cp: Group
    dp_cp: Group
    tp_cp: Group
    mp: Group
    tp_dp_cp: Group
    ep: Group
    expert_tp: Group
    expert_dp: Group
    expert_tp_ep: Group
    embedding: Group
    position_embedding: Group
    world: Group
    local_world_size: int = 1
    """Processes on this host (the launcher's ``LOCAL_WORLD_SIZE``): ranks are placed on hosts as torchrun does,
    ``local_world_size`` consecutive ranks per host, GPU = local rank."""

    # ----------------------------------------------------------------------------------------------- building
    @classmethod
    def initialize(
        cls,
        config: ParallelConfig | None = None,
        *,
        backend: str | None = None,
        env: LaunchEnv | None = None,
        timeout: datetime.timedelta | None = None,
        device: torch.device | str | None = None,
    ) -> ParallelState:
        """Validate the layout, initialise torch.distributed if needed, and create every group.

        ``backend`` defaults to :func:`default_backend`. With one process and no launcher, torch.distributed is left
        alone. When torch.distributed is already initialised (by the caller or a test harness), it is reused.
        """
        config = config or ParallelConfig()
        if dist.is_available() and dist.is_initialized():
            env = env or read_launch_env()
            rank, world, local_rank = dist.get_rank(), dist.get_world_size(), env.local_rank
            backend = dist.get_backend()
            use_dist = True
        else:
            env = env or read_launch_env()
            rank, world, local_rank = env.rank, env.world_size, env.local_rank
            use_dist = world > 1
        layout = RankLayout.build(config, world)  # validates before any process group is touched
        if use_dist and not dist.is_initialized():
            assert env is not None
            backend = backend or default_backend()
            if "nccl" in backend:
                torch.cuda.set_device(local_rank)
            init_method = None
            if env.source == "slurm":
                init_method = f"tcp://{env.master_addr}:{env.master_port}"
            dist.init_process_group(
                backend=backend,
                init_method=init_method,
                rank=rank,
                world_size=world,
                timeout=timeout or datetime.timedelta(minutes=10),
            )
            logger.info("initialised torch.distributed: backend=%s world_size=%d", backend, world)
        if device is None:
            device = default_device(backend if use_dist else None, local_rank)
        groups = _make_groups(layout, rank, world, use_dist)
        state = cls(
            config,
            layout,
            rank,
            world,
            local_rank,
            backend if use_dist else None,
            torch.device(device),
            **groups,
            local_world_size=env.local_world_size,
        )
        if rank == 0:
            logger.info(
                "parallel layout: world=%d tp=%d pp=%d cp=%d dp=%d ep=%d expert_tp=%d expert_dp=%d order=%s",
                world, config.tp, config.pp, config.cp, layout.dp, config.ep, config.expert_tp_size,
                layout.expert_dp, config.order,
            )  # fmt: skip
        return state

    # ----------------------------------------------------------------------------------------------- queries
    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def vpp_size(self) -> int:
        return self.config.vpp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    @property
    def pp_prev_rank(self) -> int:
        """Global rank of the previous pipeline stage (wraps around, as the interleaved schedule needs)."""
        return self.pp.ranks[(self.pp.rank - 1) % self.pp.size]

    @property
    def pp_next_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps around)."""
        return self.pp.ranks[(self.pp.rank + 1) % self.pp.size]

    @property
    def sequence_parallel(self) -> bool:
        return self.config.sequence_parallel and self.tp.size > 1

    def destroy(self) -> None:
        """Destroy the sub-groups this state created (not the default group)."""
        seen = set()
        for g in (getattr(self, f) for f in self.__dataclass_fields__):
            if isinstance(g, Group) and g.pg is not None and g.pg is not dist.group.WORLD and id(g.pg) not in seen:
                seen.add(id(g.pg))
                dist.destroy_process_group(g.pg)


_GROUP_KINDS = (
    "tp", "pp", "dp", "cp", "dp_cp", "tp_cp", "mp", "tp_dp_cp",
    "ep", "expert_tp", "expert_dp", "expert_tp_ep", "embedding", "position_embedding", "world",
)  # fmt: skip


def _make_groups(layout: RankLayout, rank: int, world: int, use_dist: bool) -> dict[str, Group]:
    """This process's group of every kind. Every rank creates every process group in the same order (as
    ``dist.new_group`` requires), each distinct rank tuple once; one-member groups get no process group."""
    created: dict[tuple[int, ...], dist.ProcessGroup | None] = {}

    def make(kind: str) -> Group:
        mine: tuple[int, ...] | None = None
        for ranks in layout.groups[kind]:
            if ranks not in created:
                if not use_dist or len(ranks) == 1:
                    created[ranks] = None
                elif len(ranks) == world:
                    created[ranks] = dist.group.WORLD
                else:
                    created[ranks] = dist.new_group(list(ranks))
            if rank in ranks:
                mine = ranks
        if mine is None:
            return Group(kind, (), -1, None)
        return Group(kind, mine, mine.index(rank), created[mine])

    return {k: make(k) for k in _GROUP_KINDS}
