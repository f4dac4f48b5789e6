"""Data parallelism: bucketed, overlapped gradient reduction over the dp (x cp) group with fp32 ``main_grad``."""

from mcore_parallel.ddp.buffer import Bucket, GradBuffer
from mcore_parallel.ddp.ddp import DDPConfig, DistributedDataParallel

__all__ = ["DDPConfig", "DistributedDataParallel", "GradBuffer", "Bucket"]
