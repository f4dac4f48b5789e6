"""Pipeline parallelism: layer partitioning, point-to-point exchange, schedules, tied-embedding helpers."""

from mcore_parallel.pipeline.embedding import (
    allreduce_shared_embedding_grads,
    shared_embedding_params,
    sync_shared_embedding_weights,
)
from mcore_parallel.pipeline.p2p import P2PCommunicator, PipelineTimeoutError
from mcore_parallel.pipeline.partition import stage_layer_counts, stage_layer_range
from mcore_parallel.pipeline.schedules import ForwardStepFunc, LossFunc, forward_backward

__all__ = [
    "forward_backward",
    "ForwardStepFunc",
    "LossFunc",
    "P2PCommunicator",
    "PipelineTimeoutError",
    "stage_layer_range",
    "stage_layer_counts",
    "shared_embedding_params",
    "sync_shared_embedding_weights",
    "allreduce_shared_embedding_grads",
]
