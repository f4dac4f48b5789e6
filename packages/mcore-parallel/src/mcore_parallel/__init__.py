"""mcore-parallel: process groups as values and the parallel building blocks of mcore.

>>> from mcore_parallel import ParallelConfig, ParallelState
>>> state = ParallelState.initialize(ParallelConfig(tp=1))  # no launcher needed for one process
>>> state.tp.size
1
"""

from mcore_parallel._launch import LaunchEnv, exit_process, leave_process_group, read_launch_env
from mcore_parallel.config import ParallelConfig
from mcore_parallel.errors import LaunchEnvironmentError, MCoreParallelError, ParallelConfigError
from mcore_parallel.layout import RankLayout
from mcore_parallel.sharding import ShardedTensor, data_parallel_group, shard_group, shard_info
from mcore_parallel.state import Group, ParallelState, default_backend

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "ParallelConfig",
    "ParallelState",
    "Group",
    "RankLayout",
    "ShardedTensor",
    "shard_info",
    "shard_group",
    "data_parallel_group",
    "LaunchEnv",
    "read_launch_env",
    "exit_process",
    "leave_process_group",
    "default_backend",
    "MCoreParallelError",
    "ParallelConfigError",
    "LaunchEnvironmentError",
]
