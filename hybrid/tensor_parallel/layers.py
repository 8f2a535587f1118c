"""Tensor-parallel linear and embedding layers.

Activation layout: the layers take activations with the sequence dim first,
``[s, b, h]``. Without sequence parallelism any leading dims work; with
``sequence_parallel=True`` dim 0 is the sequence, and activations outside
the TP-partitioned blocks are sharded along it (``[s/tp, b, h]``).

* :class:`ColumnParallelLinear` splits the output features: ``W`` is
  ``[out/tp, in]`` on each rank. Its input is replicated (backward
  all-reduces the input gradient) or, under sequence parallelism, all-gathered
  along the sequence (backward reduce-scatters).
* :class:`RowParallelLinear` splits the input features: ``W`` is
  ``[out, in/tp]``. Its output is all-reduced or, under sequence parallelism,
  reduce-scattered along the sequence.
* :class:`VocabParallelEmbedding` splits the (padded) vocabulary rows.

Every parameter carries TP metadata (:mod:`hybrid.param_meta`) and an
initializer (:mod:`hybrid.tensor_parallel.init`). Parameters are allocated
uninitialized; :func:`hybrid.tensor_parallel.init.materialize` fills them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hybrid import param_meta
from hybrid.tensor_parallel import init as tp_init
from hybrid.tensor_parallel.mappings import (copy_to_tp_region, gather_from_sequence_parallel_region,
                                             gather_from_tp_region, reduce_from_tp_region,
                                             reduce_scatter_to_sequence_parallel_region, scatter_to_tp_region,
                                             sum_grad_rows)

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology

VOCAB_PAD_MULTIPLE = 128


def _new_param(shape, device, dtype, init: tp_init.Initializer, **meta) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    param_meta.set_tp_meta(p, **meta)
    tp_init.set_initializer(p, init)
    return p


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           topo: "Topology", sequence_parallel: bool = False,
                           gather_output: bool = False) -> torch.Tensor:
    """``y = x W^T + b`` with ``W`` split by output rows: ``[s(/tp), b, in] -> [s, b, out/tp]``.

    Under ``sequence_parallel`` the input is this rank's sequence shard and is
    all-gathered over ``"tp"`` (backward: reduce-scatter); otherwise it is
    replicated and its gradient all-reduced over ``"tp"``. With
    ``gather_output`` the result is all-gathered to ``[s, b, out]``.
    """
    if sequence_parallel:
        x = gather_from_sequence_parallel_region(x, topo)
    else:
        x = copy_to_tp_region(x, topo)
    y = F.linear(x, weight, bias)
    return gather_from_tp_region(y, topo) if gather_output else y


class ColumnParallelLinear(nn.Module):
    """Linear layer whose output features are split over the TP ranks.

    ``weight``: ``[out/tp, in]`` (TP dim 0, ``stride`` blocks), ``bias``: ``[out/tp]``.
    ``stride=k`` means the full output is k concatenated blocks (e.g. q, k, v)
    and each rank holds its piece of every block, concatenated.
    ``blocks=((size, units), ...)`` instead splits the output into unequal
    blocks of indivisible units (q, k and v heads of grouped-query attention;
    see :mod:`hybrid.param_meta`): a block of fewer units than TP ranks is
    replicated over ``tp / units`` consecutive ranks, and the gradient of
    those rows (weight and bias) is summed over exactly those ranks (axis
    ``"tp/k"``, :func:`~hybrid.tensor_parallel.mappings.sum_grad_rows`).
    ``pad_multiple`` pads ``out_features`` up to a multiple of
    ``pad_multiple * tp`` (the vocabulary head); the padded rows start at zero.
    """

    def __init__(self, in_features: int, out_features: int, topology: "Topology", *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, stride: int = 1,
                 pad_multiple: Optional[int] = None, blocks: Optional[param_meta.Blocks] = None,
                 weight_init: tp_init.Initializer = tp_init.normal(0.02),
                 bias_init: tp_init.Initializer = tp_init.ZEROS, device=None, dtype=None):
        super().__init__()
        tp = topology.tp_size
        if blocks is not None and (pad_multiple is not None or stride != 1):
            raise ValueError("ColumnParallelLinear: blocks cannot be combined with pad_multiple or stride > 1")
        if pad_multiple is not None and stride != 1:
            raise ValueError("ColumnParallelLinear: pad_multiple and stride > 1 cannot be combined")
        if gather_output and (stride != 1 or blocks is not None):
            raise ValueError(f"ColumnParallelLinear: gather_output=True with stride={stride} would return the "
                             f"rank-interleaved blocks, not the full layout; gather with param_meta.merge instead")
        self.replicated_rows = []  # (lo, hi, axis): local rows held alike by the ranks of axis "tp/k"
        if blocks is not None:
            meta = dict(dim=0, blocks=blocks)
            tp_meta = param_meta.TPMeta(**meta)
            full_out = param_meta.piece_size(tp_meta, out_features, tp) * tp
            self.replicated_rows = [(lo, hi, topology.enable_tp_subgroups(k))
                                    for lo, hi, k in param_meta.replicated_runs(tp_meta, out_features, tp)]
        elif pad_multiple is not None:
            meta = dict(dim=0, logical_size=out_features, pad_multiple=pad_multiple)
            full_out = param_meta.padded_size(out_features, param_meta.TPMeta(**meta), tp)
        else:
            if out_features % (stride * tp) != 0:
                raise ValueError(f"ColumnParallelLinear: out_features={out_features} must be divisible by "
                                 f"stride*tp = {stride}*{tp} = {stride * tp}")
            meta = dict(dim=0, stride=stride)
            full_out = out_features
        self.topology = topology
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.weight = _new_param((full_out // tp, in_features), device, dtype, weight_init, **meta)
        self.bias = _new_param((full_out // tp,), device, dtype, bias_init, **meta) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        for lo, hi, axis in self.replicated_rows:
            weight = sum_grad_rows(weight, self.topology, lo, hi, axis)
            bias = None if bias is None else sum_grad_rows(bias, self.topology, lo, hi, axis)
        return column_parallel_linear(x, weight, bias, self.topology, self.sequence_parallel, self.gather_output)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.topology.tp_size}, "
                f"local_out={self.weight.shape[0]}, bias={self.bias is not None}, sp={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Linear layer whose input features are split over the TP ranks.

    ``weight``: ``[out, in/tp]`` (TP dim 1), ``bias``: ``[out]`` replicated and
    added once after the reduction. Input ``[s, b, in/tp]`` when
    ``input_is_parallel`` else ``[s, b, in]`` (split here). Output
    ``[s, b, out]`` (all-reduced over ``"tp"``) or, under
    ``sequence_parallel``, ``[s/tp, b, out]`` (reduce-scattered over ``"tp"``).
    """

    def __init__(self, in_features: int, out_features: int, topology: "Topology", *, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 weight_init: tp_init.Initializer = tp_init.normal(0.02),
                 bias_init: tp_init.Initializer = tp_init.ZEROS, device=None, dtype=None):
        super().__init__()
        tp = topology.tp_size
        if in_features % tp != 0:
            raise ValueError(f"RowParallelLinear: in_features={in_features} must be divisible by the "
                             f"tensor-parallel size tp={tp}")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        self.topology = topology
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.weight = _new_param((out_features, in_features // tp), device, dtype, weight_init, dim=1)
        self.bias = _new_param((out_features,), device, dtype, bias_init) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topo = self.topology
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, topo)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, topo)
        else:
            y = reduce_from_tp_region(y, topo)
        if self.bias is not None:
            # Under SP each rank adds the bias to its own sequence shard only, so
            # its gradient is partial and must be summed over "tp".
            bias = copy_to_tp_region(self.bias, topo) if self.sequence_parallel else self.bias
            y = y + bias
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.topology.tp_size}, "
                f"local_in={self.weight.shape[1]}, bias={self.bias is not None}, sp={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split over the TP ranks.

    The vocabulary is padded to a multiple of ``pad_multiple * tp``; each rank
    holds rows ``[r*V_p/tp, (r+1)*V_p/tp)`` of the padded table as ``weight``
    ``[V_p/tp, dim]`` (TP dim 0, logical size ``num_embeddings``). Ids outside
    this rank's range contribute zeros and the partial results are summed
    over ``"tp"``.

    Input ids ``[s, b]`` (any shape without sequence parallelism); output
    ``[s, b, dim]``, or ``[s/tp, b, dim]`` (reduce-scattered along the
    sequence) when ``sequence_parallel``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, topology: "Topology", *,
                 pad_multiple: int = VOCAB_PAD_MULTIPLE, sequence_parallel: bool = False,
                 init: tp_init.Initializer = tp_init.normal(0.02), device=None, dtype=None):
        super().__init__()
        if num_embeddings < 1:
            raise ValueError(f"VocabParallelEmbedding: num_embeddings must be >= 1, got {num_embeddings}")
        tp = topology.tp_size
        meta = dict(dim=0, logical_size=num_embeddings, pad_multiple=pad_multiple)
        self.padded_size = param_meta.padded_size(num_embeddings, param_meta.TPMeta(**meta), tp)
        self.topology = topology
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel
        self.rows_per_rank = self.padded_size // tp
        self.vocab_start = topology.tp_rank * self.rows_per_rank
        self.weight = _new_param((self.rows_per_rank, embedding_dim), device, dtype, init, **meta)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        topo = self.topology
        if topo.tp_size == 1:
            out = F.embedding(ids, self.weight)
        else:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.rows_per_rank)
            local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, topo)
        return reduce_from_tp_region(out, topo)

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings}, padded={self.padded_size}, dim={self.embedding_dim}, "
                f"tp={self.topology.tp_size}, sp={self.sequence_parallel}")
