"""The one place that reads launcher facts from the environment.

torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) takes
precedence; under SLURM without torchrun (``srun python train.py``) the ``SLURM_*`` variables are used, with the
master address taken from the first host of ``SLURM_JOB_NODELIST``. With neither, the process is a single rank and no
launcher is needed.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

from mcore_parallel.errors import LaunchEnvironmentError

__all__ = ["LaunchEnv", "exit_process", "first_slurm_host", "leave_process_group", "read_launch_env"]

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class LaunchEnv:
    """Facts about this process given by the launcher."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    source: str = "none"  # "torchrun", "slurm" or "none"

    @property
    def node_rank(self) -> int:
        return self.rank // max(self.local_world_size, 1)


def _int(env: Mapping[str, str], key: str) -> int:
    raw = env[key]
    try:
        return int(raw)
    except ValueError:
        raise LaunchEnvironmentError(f"environment variable {key}={raw!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list such as ``gpu[003-005,007],cpu01`` (gives ``gpu003``)."""
    nodelist = nodelist.strip()
    if not nodelist:
        raise LaunchEnvironmentError("SLURM_JOB_NODELIST is empty")
    m = re.match(r"^([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if m is None:
        raise LaunchEnvironmentError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, _, ranges = m.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the launcher's environment (``os.environ`` by default)."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else 1
        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else None
        source = "torchrun"
        addr = env.get("MASTER_ADDR")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        per_node = env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]
        local_world = int(per_node) if per_node.isdigit() else 1
        addr = env.get("MASTER_ADDR")
        if addr is None and "SLURM_JOB_NODELIST" in env:
            addr = first_slurm_host(env["SLURM_JOB_NODELIST"])
        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_MASTER_PORT
        source = "slurm"
    else:
        return LaunchEnv()
    problems = []
    if world < 1:
        problems.append(f"world size {world} must be at least 1")
    if not 0 <= rank < max(world, 1):
        problems.append(f"rank {rank} is outside [0, {world})")
    if not 0 <= local_rank < max(local_world, 1) and source == "torchrun":
        problems.append(f"local rank {local_rank} is outside [0, {local_world})")
    if problems:
        raise LaunchEnvironmentError(f"inconsistent {source} environment: " + "; ".join(problems))
    return LaunchEnv(rank, world, local_rank, local_world, addr, port, source)


def leave_process_group() -> bool:
    """Destroy torch.distributed's process groups (the default one and every other) if this process has them; True
    if it did. A command-line rank calls it once it is done with them: a gloo group left for the interpreter's exit
    aborts a finished rank now and then there (``terminate called without an active exception``, exit code -6, and
    torchrun reports the run as failed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        return True
    return False


def exit_process(code: int, left_group: bool) -> NoReturn:
    """End a command with ``code``. A process that had a process group (``left_group``) ends with ``os._exit`` once
    its logs and output are flushed: even destroyed, a group's teardown at the interpreter's finalization aborted a
    rank now and then (no Python frame on the stack). Any other process exits normally."""
    if left_group:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
