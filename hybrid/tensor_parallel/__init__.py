"""Tensor-parallel building blocks: communication primitives, layers, loss, norms, RNG and init.

See docs/tensor_parallel.md for the layouts and the communication each piece performs.
"""

from hybrid.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from hybrid.tensor_parallel.gather import full_state, gather_full, gather_pieces
from hybrid.tensor_parallel.init import Initializer, materialize
from hybrid.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                           column_parallel_linear)
from hybrid.tensor_parallel.mappings import (copy_to_tp_region, gather_from_sequence_parallel_region,
                                             gather_from_tp_region, reduce_from_tp_region,
                                             reduce_scatter_to_sequence_parallel_region,
                                             scatter_to_sequence_parallel_region, scatter_to_tp_region,
                                             sum_grad_rows)
from hybrid.tensor_parallel.norms import LayerNorm, RMSNorm
from hybrid.tensor_parallel.random import RNGTracker, checkpoint

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "column_parallel_linear",
    "vocab_parallel_cross_entropy", "LayerNorm", "RMSNorm", "RNGTracker", "checkpoint",
    "Initializer", "materialize", "gather_full", "gather_pieces", "full_state",
    "copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "sum_grad_rows",
]
