"""Gathers the MoE layers' routing statistics of one log interval into :class:`~hybrid.monitor.moe.MoELayerReport`s.

Each :class:`model_zoo.moe.MoELayer` counts, since its ``stats.reset()``, the
assignments per expert, the dropped ones and the balancing and z-loss values of
the tokens *this rank* routed, over the micro-batches it ran. A report is the
whole global batch's, of every MoE layer of every pipeline stage:

1. each rank writes its layers' counts into one float64 table
   ``[num_layers, E + 5]`` (zero rows for the layers it does not hold) and
   resets them;
2. the table is summed over the layers' ``token_axes`` (``"dp"``, and
   ``"tp"`` where each TP rank routes its own sequence shard): the counts of
   the global batch;
3. then over ``"pp"``: the stages hold disjoint layers, so the sum is every
   stage's rows side by side, on every rank (the logging rank among them).

Every rank calls :meth:`MoEReporter.gather` at the same iterations (the ends of
log intervals); all collectives go through ``topology.comm``. The layers count
training's routing only (not an evaluation's, which runs in eval mode).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from hybrid.monitor.moe import MoELayerReport
from model_zoo.moe import computed_losses

# Columns of the table after the E per-expert loads
_DROPPED, _ASSIGNMENTS, _AUX, _Z, _LOSS_MICRO_BATCHES = range(5)
_EXTRA = 5


class MoEReporter:
    """The MoE routing reports of one model on one rank. Build it with :meth:`for_model` (None for a dense model).

    ``config``: the model's ``GPTConfig``; ``topology``: the run's; ``model``:
    this rank's share of the model (``model_zoo.moe.moe_layers`` finds its MoE
    layers).
    """

    def __init__(self, model: nn.Module, config, topology):
        from model_zoo.moe import moe_layers  # model_zoo imports torch-heavy modules: only for an MoE run

        self.config, self.topology = config, topology
        self.layers = moe_layers(model)
        self.pattern = config.moe_layer_pattern()  # [num_layers] bool: which layers are MoE (every stage agrees)
        self.num_experts, self.topk = config.num_experts, config.moe_router_topk
        self.aux_computed, self.z_computed = computed_losses(config)

    @classmethod
    def for_model(cls, model: nn.Module, config, topology) -> Optional["MoEReporter"]:
        return cls(model, config, topology) if config.is_moe else None

    def _token_axes(self) -> Sequence[str]:
        """The axes over which this stage's counts sum to the global batch's: every layer's are the same (one
        topology); a stage without MoE layers holds zero rows, and every rank of its dp and tp groups is on the
        same stage, so what it sums them over changes nothing and its ranks agree."""
        return self.layers[0][1].token_axes if self.layers else ("dp",)

    def _local_table(self) -> torch.Tensor:
        """``[num_layers, E + 5]`` float64 on the topology's device: this rank's counts (then reset)."""
        E = self.num_experts
        table = torch.zeros(len(self.pattern), E + _EXTRA, dtype=torch.float64, device=self.topology.device)
        # The loss values are counted on TP rank 0 only (they are the same on every TP rank): their micro-batches
        # are counted there too, so the mean is the sum of values over the sum of micro-batches on any layout.
        counts_losses = self.topology.tp_rank == 0
        for index, layer in self.layers:
            st = layer.stats
            row = table[index]
            row[:E] = st.tokens_per_expert
            extra = row[E:]
            extra[_DROPPED], extra[_ASSIGNMENTS] = st.dropped, st.assignments
            extra[_AUX], extra[_Z] = st.aux_loss, st.z_loss
            extra[_LOSS_MICRO_BATCHES] = st.micro_batches if counts_losses else 0
            st.reset()
        return table

    def gather(self) -> Optional[Tuple[MoELayerReport, ...]]:
        """The reports of every MoE layer since the last call, in layer order; None when no token was routed.

        Collective: every rank of the world calls it at the same iteration. All-reduces one
        ``[num_layers, E + 5]`` float64 table over each of the layers' ``token_axes`` (``"dp"``, ``"tp"``),
        then over ``"pp"``.
        """
        table = self._local_table()
        comm = self.topology.comm
        for axis in self._token_axes():
            comm.all_reduce(table, axis)
        comm.all_reduce(table, "pp")
        return self._reports(table.cpu())

    def _reports(self, table: torch.Tensor) -> Optional[Tuple[MoELayerReport, ...]]:
        E = self.num_experts
        capacity = self.config.moe_expert_capacity_factor is not None
        out: List[MoELayerReport] = []
        for index, is_moe in enumerate(self.pattern):
            if not is_moe:
                continue
            loads, extra = table[index, :E], table[index, E:]
            assignments = float(extra[_ASSIGNMENTS])
            if assignments <= 0:
                return None  # nothing routed since the last report (every layer routes every token)
            mean = assignments / E
            loss_mbs = float(extra[_LOSS_MICRO_BATCHES])
            out.append(MoELayerReport(
                layer=index, num_experts=E, topk=self.topk,
                load_max_over_mean=float(loads.max()) / mean, load_min_over_mean=float(loads.min()) / mean,
                dropped_fraction=float(extra[_DROPPED]) / assignments if capacity else None,
                aux_loss=float(extra[_AUX]) / loss_mbs if self.aux_computed and loss_mbs else None,
                z_loss=float(extra[_Z]) / loss_mbs if self.z_computed and loss_mbs else None,
                micro_batches=int(loss_mbs)))
        return tuple(out)
