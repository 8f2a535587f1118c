"""What the monitor shows of a Mixture-of-Experts model's routing, per MoE layer and log interval.

:class:`MoELayerReport` holds one layer's interval, already summed over the
whole global batch and gathered from every pipeline stage
(``hybrid.training.moe_report`` builds them collectively); this module only
formats them: one compact part of the console line, optionally one line per
layer (``--moe-per-layer-logging``), and the TensorBoard tags.

The load of an expert is the number of (token, expert) assignments the router
made to it before any dropping. With ``T`` tokens and top-``k`` routing over
``E`` experts the mean load is ``T k / E``: ``max/mean`` is 1 when balanced and
``E / k`` when every token goes to the same ``k`` experts (``min/mean`` is then
0). A layer is flagged as collapsed from :data:`COLLAPSE_SHARE` of that way on.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

# A layer's routing counts as collapsed when its max/mean load has gone this share of the way from balanced (1) to
# every token on the same k experts (E / k): half-way, e.g. 1.5 for 4 experts top-2, 4.5 for 8 experts top-1.
COLLAPSE_SHARE = 0.5


def collapse_threshold(num_experts: int, topk: int) -> float:
    """The max/mean load from which a layer of ``num_experts`` experts, top-``topk``, is flagged as collapsed."""
    return 1.0 + COLLAPSE_SHARE * (num_experts / topk - 1.0)


@dataclasses.dataclass(frozen=True)
class MoELayerReport:
    """One MoE layer over one log interval (the whole global batch's tokens, every micro-batch of the interval).

    ``aux_loss`` and ``z_loss`` are the values without their coefficient, the
    mean over the interval's micro-batches; None where the layer computes no
    such loss (its coefficient is 0 or the balancing type ``none``).
    ``dropped_fraction`` is None for dropless routing (no capacity factor).
    """

    layer: int  # the global layer index
    num_experts: int
    topk: int
    load_max_over_mean: float
    load_min_over_mean: float
    dropped_fraction: Optional[float]
    aux_loss: Optional[float]
    z_loss: Optional[float]
    micro_batches: int  # micro-batches of the interval, over every data-parallel rank

    @property
    def collapsed(self) -> bool:
        return self.load_max_over_mean >= collapse_threshold(self.num_experts, self.topk)


def worst_layer(reports: Sequence[MoELayerReport]) -> MoELayerReport:
    """The layer with the highest max/mean load (the earliest of equals)."""
    return max(reports, key=lambda r: (r.load_max_over_mean, -r.layer))


def _sum(values: List[Optional[float]]) -> Optional[float]:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def total_aux_loss(reports: Sequence[MoELayerReport]) -> Optional[float]:
    """The balancing loss summed over the MoE layers (every pipeline stage's); None where no layer computes it."""
    return _sum([r.aux_loss for r in reports])


def total_z_loss(reports: Sequence[MoELayerReport]) -> Optional[float]:
    """The z-loss summed over the MoE layers; None where no layer computes it."""
    return _sum([r.z_loss for r in reports])


def _pct(value: float) -> str:
    return f"{100 * value:.2f}%"


def format_moe_part(reports: Sequence[MoELayerReport]) -> str:
    """The compact part of the training line, e.g. (one line)::

        moe load max/mean: 1.08 min/mean: 0.93 (layer 2) | moe aux loss: 4.012E+00 | moe dropped: 0.12%

    the worst layer's loads (with ``ROUTING COLLAPSED`` and the threshold when it is
    :attr:`MoELayerReport.collapsed`), then the balancing and z-loss values summed over
    layers and the dropped share of all assignments, each only where the model has it.
    """
    worst = worst_layer(reports)
    load = (f"moe load max/mean: {worst.load_max_over_mean:.2f} min/mean: {worst.load_min_over_mean:.2f} "
            f"(layer {worst.layer})")
    if worst.collapsed:
        load += (f" ROUTING COLLAPSED (max/mean >= {collapse_threshold(worst.num_experts, worst.topk):.2f}; "
                 f"{worst.num_experts / worst.topk:.2f} = every token on the same {worst.topk} of "
                 f"{worst.num_experts} experts)")
    parts = [load]
    aux, z = total_aux_loss(reports), total_z_loss(reports)
    if aux is not None:
        parts.append(f"moe aux loss: {aux:.6E}")
    if z is not None:
        parts.append(f"moe z loss: {z:.6E}")
    dropped = [r.dropped_fraction for r in reports if r.dropped_fraction is not None]
    if dropped:  # every layer routes the same number of assignments: the mean of the shares is the whole share
        parts.append(f"moe dropped: {_pct(sum(dropped) / len(dropped))}")
    return " | ".join(parts)


def format_moe_layer_line(r: MoELayerReport) -> str:
    """One layer's line (``--moe-per-layer-logging``), e.g.
    ``moe layer 3 | load max/mean: 1.21 | load min/mean: 0.80 | dropped: n/a | aux loss: 1.003E+00 | z loss: n/a``."""
    na = "n/a"
    return " | ".join([
        f"moe layer {r.layer}",
        f"load max/mean: {r.load_max_over_mean:.2f}" + (" ROUTING COLLAPSED" if r.collapsed else ""),
        f"load min/mean: {r.load_min_over_mean:.2f}",
        f"dropped: {na if r.dropped_fraction is None else _pct(r.dropped_fraction)}",
        f"aux loss: {na if r.aux_loss is None else format(r.aux_loss, '.6E')}",
        f"z loss: {na if r.z_loss is None else format(r.z_loss, '.6E')}",
    ])


# ---- TensorBoard --------------------------------------------------------------------------------------------
MOE_LAYER_FIELDS = ("load_max_over_mean", "load_min_over_mean", "dropped_fraction", "aux_loss", "z_loss")
# Over all layers: the highest max/mean load, the lowest min/mean load, the losses summed over layers
MOE_TOTAL_TAGS = ("moe/load_max_over_mean", "moe/load_min_over_mean", "moe/aux_loss", "moe/z_loss")


def moe_layer_tag(layer: int, field: str) -> str:
    """``moe/layer_{layer}/{field}``, ``field`` one of :data:`MOE_LAYER_FIELDS`."""
    return f"moe/layer_{layer}/{field}"


def moe_scalars(reports: Sequence[MoELayerReport]) -> Dict[str, Optional[float]]:
    """Every MoE tag's value for one interval (None: the model has no such value)."""
    worst = worst_layer(reports)
    out: Dict[str, Optional[float]] = {
        "moe/load_max_over_mean": worst.load_max_over_mean,
        "moe/load_min_over_mean": min(r.load_min_over_mean for r in reports),
        "moe/aux_loss": total_aux_loss(reports),
        "moe/z_loss": total_z_loss(reports),
    }
    for r in reports:
        for field in MOE_LAYER_FIELDS:
            out[moe_layer_tag(r.layer, field)] = getattr(r, field)
    return out
