"""Tensor and sequence parallelism: communication mappings, parallel layers, vocab-parallel cross-entropy, RNG.

``linear_vocab_parallel_cross_entropy`` fuses the output projection with the vocab-parallel cross-entropy and keeps
the logits of at most ``chunk_tokens`` tokens alive (recomputed in backward), for large vocabularies.
"""

from mcore_parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from mcore_parallel.tensor.init import derive_seed, init_sharded_, normal_init, scaled_normal_init
from mcore_parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    padded_vocab_size,
    set_tp_attributes,
)
from mcore_parallel.tensor.linear_cross_entropy import linear_vocab_parallel_cross_entropy
from mcore_parallel.tensor.mappings import (
    SymmetricExchange,
    copy_to_tp_region,
    gather_from_sp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
    scatter_to_sp_region,
    scatter_to_tp_region,
    sequence_parallel_linear,
    sequence_parallel_row_linear,
    with_symmetric_memory,
)
from mcore_parallel.tensor.random import MODEL_PARALLEL_RNG, RNGStatesTracker, model_parallel_seed

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "linear_vocab_parallel_cross_entropy",
    "padded_vocab_size",
    "allreduce_sequence_parallel_grads",
    "set_tp_attributes",
    "copy_to_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "gather_from_tp_region",
    "scatter_to_sp_region",
    "gather_from_sp_region",
    "reduce_scatter_to_sp_region",
    "sequence_parallel_linear",
    "sequence_parallel_row_linear",
    "SymmetricExchange",
    "with_symmetric_memory",
    "RNGStatesTracker",
    "model_parallel_seed",
    "MODEL_PARALLEL_RNG",
    "normal_init",
    "scaled_normal_init",
    "derive_seed",
    "init_sharded_",
]
