"""The Mixture-of-Experts layer: a router, routed experts shared out over ``"ep"``, and an optional shared expert.

The design (routing, capacity, dispatch, balancing, statistics) is written
out in ``docs/moe.md``; the settings are :class:`model_zoo.config.GPTConfig`'s
``moe_*`` fields. Activations are ``[s/tp, b, h]`` (an MoE model at TP > 1
runs with sequence parallelism) or ``[s, b, h]`` at TP 1. Tokens are counted
``t = position * b + sequence`` (the ``[s, b]`` order flattened).

Collectives: the router's gradient and the statistics are summed over
``"tp"`` (each TP rank routes its own sequence shard), and over ``"cp"`` under
context parallelism (each cp rank routes its chunks of every sequence: the
balancing losses, the expert bias's load and the capacity are those of the whole
sequences, as one process computes them); with the experts split
over TP the tokens and their routing are all-gathered over ``"tp"`` and the
experts' partial outputs reduce-scattered back; tokens travel to their
experts and back by all-to-all over ``"ep"`` (``moe_dispatch/ep``,
``moe_combine/ep``; their gradients ``moe_dispatch_grad/ep``,
``moe_combine_grad/ep``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from hybrid import param_meta
from hybrid.compile_marks import eager
from hybrid.context_parallel.loss import sum_over_cp, with_cp_factor
from hybrid.context_parallel.split import gather_sequence, local_positions
from hybrid.tensor_parallel import init as tp_init
from hybrid.tensor_parallel.all_to_all import all_to_all_v
from hybrid.tensor_parallel.mappings import (copy_to_tp_region, gather_from_sequence_parallel_region,
                                             reduce_from_tp_region, reduce_scatter_to_sequence_parallel_region)
from hybrid.tensor_parallel.random import RNGTracker
from model_zoo.config import GPTConfig
from model_zoo.mlp import ParallelMLP  # the shared expert is a dense MLP of its own width

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology


# ---- the balancing losses' gradient scale ----------------------------------------------------------------------
class AuxLossScale:
    """The factor the balancing losses' gradients carry: the language-model loss's (loss scale / accumulation
    steps), set by the engine before backward (``hybrid.engine.stage.scale_side_losses``); one per model."""

    def __init__(self) -> None:
        self.value = 1.0


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x``; backward also gives ``aux`` (a scalar) the gradient ``scale.value``, read when backward
    runs (the engine sets it then): the loss joins the backward pass at its layer, on whichever pipeline stage
    holds it."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, grad.new_full(ctx.aux_shape, ctx.scale.value, dtype=torch.float32), None


# ---- statistics -------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class MoEStats:
    """One layer's routing since its last :meth:`reset`, over this rank's tokens (``MoELayer.token_axes`` sum
    them to the global batch's). Tensors on the layer's device, float64."""

    tokens_per_expert: torch.Tensor  # [E] assignments before dropping
    dropped: torch.Tensor  # assignments dropped (over capacity)
    assignments: torch.Tensor  # assignments made (tokens * topk)
    aux_loss: torch.Tensor  # the balancing loss summed over micro-batches (no coefficient)
    z_loss: torch.Tensor  # the router z-loss summed over micro-batches (no coefficient)
    micro_batches: int = 0
    step_tokens: Optional[torch.Tensor] = None  # [E] this step's assignments (the expert bias update reads them)

    @classmethod
    def zeros(cls, num_experts: int, device) -> "MoEStats":
        z = lambda *shape: torch.zeros(shape, dtype=torch.float64, device=device)  # noqa: E731
        return cls(z(num_experts), z(), z(), z(), z(), 0, z(num_experts))

    def reset(self) -> None:
        """Start a new interval (the step counts are the expert bias's, reset by it)."""
        for t in (self.tokens_per_expert, self.dropped, self.assignments, self.aux_loss, self.z_loss):
            t.zero_()
        self.micro_batches = 0


# ---- routing (plain functions: the reference tests call them too) ---------------------------------------------
@dataclasses.dataclass
class Routing:
    """The router's decisions for ``T`` tokens: ``experts`` ``[T, k]`` (int64), ``weights`` ``[T, k]`` (fp32, with
    gradient), ``probs`` ``[T, E]`` (the scores as probabilities, for the balancing loss) and ``logits``
    ``[T, E]`` (fp32)."""

    experts: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor
    logits: torch.Tensor


def route(logits: torch.Tensor, config: GPTConfig, expert_bias: Optional[torch.Tensor] = None) -> Routing:
    """Choose ``config.moe_router_topk`` experts per token from ``logits`` ``[T, E]`` (fp32).

    Scores are the softmax or sigmoid of the logits; the top k are chosen by
    score plus ``expert_bias`` (when given: it only chooses), among the experts of
    each token's best groups under group-limited routing (:func:`group_mask`). Weights: softmax
    scores renormalised over the chosen k unless ``moe_router_pre_softmax``;
    sigmoid scores always renormalised (k > 1); then times
    ``moe_router_topk_scaling_factor``.
    """
    k = config.moe_router_topk
    if config.moe_router_score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
        probs = scores
    else:
        scores = torch.sigmoid(logits)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    choose = scores if expert_bias is None else scores + expert_bias
    if config.moe_router_group_topk is not None:
        # Megatron-Core ranks the groups by the logits for softmax scores renormalised over the chosen k (it takes
        # the top k of the logits then), else by the selection scores
        by_logits = config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax and \
            expert_bias is None
        choose = choose.masked_fill(~group_mask(logits if by_logits else choose, config), float("-inf"))
    experts = torch.topk(choose.detach(), k, dim=-1).indices
    weights = scores.gather(1, experts)
    renormalise = config.moe_router_score_function == "sigmoid" or not config.moe_router_pre_softmax
    if renormalise and k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if config.moe_router_topk_scaling_factor is not None:
        weights = weights * config.moe_router_topk_scaling_factor
    return Routing(experts, weights, probs, logits)


@torch.no_grad()
def group_mask(key: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """Group-limited routing (``moe_router_num_groups`` ``G``, ``moe_router_group_topk`` ``g``): which experts
    each token may choose, ``[T, E]`` bool. The ``E`` experts form ``G`` equal groups in order; a group's rank is
    the sum of its top ``k // g`` values of ``key`` ``[T, E]``, and each token keeps its ``g`` best groups."""
    T, E = key.shape
    G, g = config.moe_router_num_groups, config.moe_router_group_topk
    ranked = key.view(T, G, E // G).topk(config.moe_router_topk // g, dim=-1).values.sum(-1)  # [T, G]
    keep = torch.zeros_like(ranked, dtype=torch.bool).scatter_(1, ranked.topk(g, dim=-1).indices, True)
    return keep.repeat_interleave(E // G, dim=1)


def capacity(config: GPTConfig, seq_length: int) -> Optional[int]:
    """Assignments each expert takes of one sequence: ``ceil(factor * s * k / E)``; None when dropless."""
    factor = config.moe_expert_capacity_factor
    if factor is None:
        return None
    return math.ceil(factor * seq_length * config.moe_router_topk / config.num_experts)


def keep_mask(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, cap: int, policy: str) -> torch.Tensor:
    """Which assignments of whole sequences survive the capacity: ``experts``, ``weights`` ``[s, b, k]`` ->
    bool ``[s, b, k]``. Per sequence and expert, ``probs`` keeps the ``cap`` highest weights (ties: the earlier
    position, then the earlier choice), ``position`` the ``cap`` earliest (position, then choice)."""
    s, b, k = experts.shape
    e = experts.permute(1, 0, 2).reshape(b, s * k)  # per sequence, assignments in (position, choice) order
    group = (torch.arange(b, device=e.device).unsqueeze(1) * num_experts + e).reshape(-1)
    order = torch.arange(b * s * k, device=e.device)
    if policy == "probs":
        w = weights.detach().permute(1, 0, 2).reshape(-1)
        order = torch.sort(-w, stable=True).indices  # the highest weight first, ties in assignment order
    order = order[torch.sort(group[order], stable=True).indices]  # then grouped by (sequence, expert)
    g = group[order]
    first = torch.searchsorted(g, g, right=False)  # each group's first index in the sorted order
    rank = torch.arange(g.numel(), device=e.device) - first
    keep = torch.empty(g.numel(), dtype=torch.bool, device=e.device)
    keep[order] = rank < cap
    return keep.reshape(b, s, k).permute(1, 0, 2)


def balancing_loss(probs: torch.Tensor, experts: torch.Tensor, num_experts: int, tokens: int,
                   per_sequence: int = 0, reduce=None) -> torch.Tensor:
    """The Switch/GShard loss ``E * sum_e f_e * P_e`` (1 when balanced): ``f_e`` the share of the assignments
    ``experts`` ``[T, k]`` that go to expert ``e``, ``P_e`` the mean of ``probs`` ``[T, E]``, over ``tokens``
    tokens. ``per_sequence = b``: over each of the ``b`` sequences of ``[s, b]``-ordered tokens (``tokens`` is
    then a sequence's length), averaged over them. ``reduce``: sums the partial ``[.., E]`` statistics over the
    ranks that hold the rest of the tokens (forward sum, identity backward)."""
    k = experts.shape[1]
    one_hot = F.one_hot(experts, num_experts).to(probs.dtype).sum(1)  # [T, E]: assignments per token
    if per_sequence:
        counts = one_hot.view(-1, per_sequence, num_experts).sum(0)  # [b, E]
        prob_sum = probs.view(-1, per_sequence, num_experts).sum(0)
    else:
        counts, prob_sum = one_hot.sum(0, keepdim=True), probs.sum(0, keepdim=True)  # [1, E]
    if reduce is not None:
        counts, prob_sum = reduce(counts), reduce(prob_sum)
    f, p = counts.detach() / (tokens * k), prob_sum / tokens
    return (num_experts * (f * p).sum(-1)).mean()


def z_loss(logits: torch.Tensor, reduce=None, tokens: Optional[int] = None) -> torch.Tensor:
    """``mean_t logsumexp(logits_t)^2`` over ``logits`` ``[T, E]`` (``reduce``, ``tokens``: the sum over ranks and
    the whole token count when the tokens are spread over them)."""
    sq = torch.logsumexp(logits, dim=-1).square().sum()
    if reduce is not None:
        sq = reduce(sq)
    return sq / (tokens if tokens is not None else logits.shape[0])


def computed_losses(config: GPTConfig) -> Tuple[bool, bool]:
    """(balancing loss, z-loss): whether an MoE layer of ``config`` computes each (the layer's rule, which the
    monitor reads too: a loss not computed is reported as absent, not as 0)."""
    return (config.moe_router_load_balancing_type != "none" and config.moe_aux_loss_coeff > 0,
            bool(config.moe_z_loss_coeff))


# ---- experts ------------------------------------------------------------------------------------------------
class ExpertLinear(nn.Module):
    """One projection of an expert: ``weight`` ``[out, in]`` (this rank's TP piece, as ``tp_meta`` says)."""

    def __init__(self, shape: Tuple[int, int], init: tp_init.Initializer, meta: dict, device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        param_meta.set_tp_meta(self.weight, **meta)
        param_meta.set_expert(self.weight)
        tp_init.set_initializer(self.weight, init)


class Expert(nn.Module):
    """A routed expert's MLP (GELU or SwiGLU, no bias): ``in_proj`` ``[b f'/etp, h]`` (SwiGLU ``[gate; up]``,
    stride 2), ``out_proj`` ``[h, f'/etp]``. Tokens ``[n, h]`` -> ``[n, h]``, partial over ``"tp"`` when
    ``etp > 1``. ``sum_over_tp``: the expert is whole on every TP rank and each routes its own tokens, so its
    gradient is summed over ``"tp"``."""

    def __init__(self, config: GPTConfig, topology: "Topology", etp: int, output_init: tp_init.Initializer,
                 device=None, dtype=None):
        super().__init__()
        h, f, blocks = config.hidden_size, config.expert_ffn_size, config.mlp_input_blocks
        # Split over TP as the dense MLP is, whenever the experts follow the TP size (at TP 1 too: the metadata
        # says how any TP size cuts them, which checkpoints and conversion read); whole only by
        # --expert-tensor-parallel-size 1.
        split = config.expert_tensor_parallel_size is None or etp > 1
        self.swiglu = config.mlp == "swiglu"
        self.topology = topology
        self.sum_over_tp = etp == 1 and topology.tp_size > 1
        self.in_proj = ExpertLinear((blocks * f // etp, h), tp_init.normal(config.init_std),
                                    dict(dim=0, stride=blocks) if split else {}, device, dtype)  # [gate; up]
        self.out_proj = ExpertLinear((h, f // etp), output_init, dict(dim=1) if split else {}, device, dtype)

    def weights(self) -> Tuple[torch.Tensor, torch.Tensor]:
        w_in, w_out = self.in_proj.weight, self.out_proj.weight
        if self.sum_over_tp:
            w_in, w_out = copy_to_tp_region(w_in, self.topology), copy_to_tp_region(w_out, self.topology)
        return w_in, w_out

    def activation(self, y: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(y, approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w_in, w_out = self.weights()
        return F.linear(self.activation(F.linear(x, w_in)), w_out)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (torch._grouped_mm's backward needs it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what torch._grouped_mm takes (no float64)


def _grouped(tokens: torch.Tensor, rows: int, experts: List[Expert], grouped: bool) -> bool:
    """Whether ``rows`` tokens like ``tokens`` go through one grouped matrix product per projection: ``grouped``
    asked for, torch offers it for the dtype, and the widths are on its 16-byte strides."""
    # torch._grouped_mm needs each operand's rows on 16-byte strides: h, the input projection's width [b f'] and
    # the expert's own [f'] (a few elements off, e.g. a shrunk model's f' = 172 in bf16, and it raises)
    widths = (tokens.shape[-1], experts[0].in_proj.weight.shape[0], experts[0].out_proj.weight.shape[1])
    aligned = all(w * tokens.element_size() % 16 == 0 for w in widths)
    return grouped and aligned and hasattr(torch, "_grouped_mm") and rows > 0 and tokens.dtype in _GROUPED_DTYPES


def _grouped_experts(tokens: torch.Tensor, counts: List[int], experts: List[Expert]) -> torch.Tensor:
    pairs = [e.weights() for e in experts]
    offs = torch.tensor(counts, device=tokens.device).cumsum(0).to(torch.int32)
    w_in = torch.stack([w for w, _ in pairs]).transpose(1, 2)  # [E_l, h, b f']
    w_out = torch.stack([w for _, w in pairs]).transpose(1, 2)  # [E_l, f', h]
    mid = torch._grouped_mm(_ContiguousGrad.apply(tokens), w_in, offs=offs)
    return torch._grouped_mm(_ContiguousGrad.apply(experts[0].activation(mid)), w_out, offs=offs)


def run_experts(tokens: torch.Tensor, counts: List[int], experts: List[Expert], grouped: bool) -> torch.Tensor:
    """Tokens ``[n, h]`` grouped by expert (``counts[j]`` rows for ``experts[j]``, in order) -> ``[n, h]``.

    The one place that chooses how a rank's experts compute (:func:`_grouped` decides, for
    :func:`run_experts_on_blocks` too): one grouped matrix product per projection
    (``torch._grouped_mm``, when ``grouped``, torch offers it for the dtype and the widths are
    on its 16-byte strides) or a loop over the experts (each expert module called, so hooks on
    it run: ZeRO-3 gathers its weights there).
    """
    if _grouped(tokens, tokens.shape[0], experts, grouped):
        return _grouped_experts(tokens, counts, experts)
    pieces = tokens.split(list(counts))
    return torch.cat([expert(piece) for expert, piece in zip(experts, pieces)])


def run_experts_on_blocks(blocks: List[List[torch.Tensor]], experts: List[Expert],
                          grouped: bool) -> List[List[torch.Tensor]]:
    """:func:`run_experts` on rows that come in blocks: ``blocks[j]`` lists ``experts[j]``'s rows as blocks ``[n_i, h]``
    (one per source rank, as an expert-parallel rank receives them); returns each expert's outputs cut into the same
    blocks. The loop concatenates only each expert's own blocks (no copy for a single block), the grouped product
    all of them in expert order; either way the rows an expert computes on, and its outputs, are those of
    :func:`run_experts` on the expert-major concatenation."""
    sizes = [[block.shape[0] for block in own] for own in blocks]
    if _grouped(blocks[0][0], sum(map(sum, sizes)), experts, grouped):
        out = _grouped_experts(torch.cat([block for own in blocks for block in own]), [sum(n) for n in sizes],
                               experts).split([n for own in sizes for n in own])
        cut, at = [], 0
        for own in sizes:
            cut.append(list(out[at:at + len(own)]))
            at += len(own)
        return cut
    return [list(expert(own[0] if len(own) == 1 else torch.cat(own)).split(n))
            for expert, own, n in zip(experts, blocks, sizes)]


class _Combine(torch.autograd.Function):
    """The weighted sum of each token's expert outputs: ``out`` ``[N, h]``, the outputs of the kept assignments
    ``assign`` ``[N]`` (indices into the ``T k`` (token, choice) slots, ``token = assign // k`` given as ``src``),
    ``weights`` ``[T, k]`` -> ``[T, h]``: the k slots added in choice order, a dropped slot (``dropped``: the other
    indices) contributing 0. Forward is the plain composition (slots filled, viewed ``[T, k, h]``, summed); written
    as one function so that backward gathers each row's gradient from its token's (``gy[src]``) instead of
    materialising the ``[T k, h]`` expansion of the sum's gradient and scattering it back. The values, forward
    and backward, are those of the composition (same products and sums in the same dtypes)."""

    @staticmethod
    def forward(ctx, out, weights, assign, src, dropped, k):
        T, h = weights.shape[0], out.shape[1]
        w = weights.reshape(-1).index_select(0, assign).unsqueeze(1).to(out.dtype)  # [N, 1]
        slots = out.new_empty(T * k, h).index_copy_(0, assign, out * w)
        if dropped.numel():
            slots.index_fill_(0, dropped, 0)
        ctx.save_for_backward(out, w, assign, src)
        ctx.weights_meta = (weights.shape, weights.dtype)
        return slots.view(T, k, h).sum(1)  # the k choices added in choice order, whatever the layout

    @staticmethod
    def backward(ctx, gy):
        out, w, assign, src = ctx.saved_tensors
        rows = gy.index_select(0, src)  # each kept slot's gradient: its token's
        g_out = rows * w if ctx.needs_input_grad[0] else None
        g_weights = None
        if ctx.needs_input_grad[1]:
            shape, dtype = ctx.weights_meta
            g_w = (rows * out).sum(1, keepdim=True).to(dtype).squeeze(1)
            g_weights = g_w.new_zeros(shape.numel()).index_add_(0, assign, g_w).view(shape)
        return g_out, g_weights, None, None, None, None


# ---- the layer -----------------------------------------------------------------------------------------------
class Router(nn.Module):
    """``weight`` ``[E, h]`` (replicated), and ``expert_bias`` ``[E]`` fp32 (a buffer: the aux-loss-free
    balancing bias, zero unless ``moe_router_enable_expert_bias``)."""

    def __init__(self, config: GPTConfig, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, device=device, dtype=dtype))
        param_meta.set_tp_meta(self.weight)
        tp_init.set_initializer(self.weight, tp_init.normal(config.init_std))
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32, device=device))

    def _apply(self, fn, recurse=True):
        # The bias stays fp32 when the model is cast (a bf16 run): a step of 1e-3 is below half of bf16's spacing
        # once the bias reaches 0.5, and the update would stop moving it. Device moves still apply.
        kept = self.expert_bias
        super()._apply(fn, recurse)
        moved = self._buffers["expert_bias"]
        if moved.dtype != torch.float32:
            self._buffers["expert_bias"] = kept.to(device=moved.device)
        return self


class ExpertStack(nn.Module):
    """This rank's routed experts, named by their global index (``experts.{e}``), iterated in order."""

    def __init__(self, experts: dict):
        super().__init__()
        for e in sorted(experts):
            self.add_module(str(e), experts[e])

    def local(self) -> List[Expert]:
        return list(self._modules.values())


class MoELayer(nn.Module):
    """The MoE block in place of a layer's MLP: input and output ``[s/tp, b, h]`` (``[s, b, h]`` at TP 1).

    See the module docstring and ``docs/moe.md``. ``aux_scale``: the model's
    :class:`AuxLossScale`. ``token_axes``: the axes over which this rank's
    statistics sum to the whole batch's.
    """

    def __init__(self, config: GPTConfig, topology: "Topology", tracker: RNGTracker, aux_scale: AuxLossScale,
                 output_init: tp_init.Initializer, device=None, dtype=None):
        super().__init__()
        self.config, self.topology, self.tracker, self.aux_scale = config, topology, tracker, aux_scale
        E, ep = config.num_experts, topology.ep_size  # E % ep: model_zoo.config.moe_problem (GPTModel checks it)
        self.tp = topology.tp_size
        self.etp = config.expert_tp(self.tp)
        self.local_count = E // ep
        first = topology.ep_rank * self.local_count
        self.local_range = (first, first + self.local_count)
        self.router = Router(config, device, dtype)
        self.experts = ExpertStack({e: Expert(config, topology, self.etp, output_init, device, dtype)
                                    for e in range(*self.local_range)})
        shared = config.moe_shared_expert_intermediate_size
        self.shared_expert = ParallelMLP(config.replace(ffn_hidden_size=shared), topology, device, dtype) \
            if shared is not None else None
        self.shared_expert_gate = None
        if config.moe_shared_expert_gate:
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False, device=device, dtype=dtype)
            param_meta.set_tp_meta(self.shared_expert_gate.weight)
            tp_init.set_initializer(self.shared_expert_gate.weight, tp_init.normal(config.init_std))
        self.cp = topology.cp_size
        self.token_axes = ("dp",) + (("cp",) if self.cp > 1 else ()) + (("tp",) if self.tp > 1 else ())
        # --moe-quantized-dispatch: tokens (and their gradients) cross the all-to-all as int8 blocks
        self.dispatch_quant = config.dispatch_quantization
        self.stats = MoEStats.zeros(E, device if device is not None and torch.device(device).type != "meta"
                                    else "cpu")

    # ---- pieces ----------------------------------------------------------------------------------------
    def _sum_over_tp(self, t: torch.Tensor) -> torch.Tensor:
        """Forward: the sum over ``"tp"`` (each rank routed its own sequence shard); backward: identity."""
        return reduce_from_tp_region(t, self.topology) if self.tp > 1 else t

    def _sum_over_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """Forward: the sum over the ranks holding the rest of each micro-batch's sequences (``"tp"``, ``"cp"``);
        backward: identity (each rank's share reaches its own tokens)."""
        return sum_over_cp(self._sum_over_tp(t), self.topology)

    def _keep(self, experts: torch.Tensor, weights: torch.Tensor, cap: int) -> torch.Tensor:
        """Which of this cp rank's assignments ``[s/cp, b, k]`` (over the whole TP group) survive the capacity of
        whole sequences: the routing of the whole sequences is gathered over ``"tp"`` and ``"cp"`` (no gradient)."""
        experts, weights = self._whole_sequences(experts), self._whole_sequences(weights)
        if self.cp > 1:
            with torch.no_grad():
                experts, weights = (gather_sequence(t.contiguous(), self.topology, seq_dim=0)
                                    for t in (experts, weights))
        keep = keep_mask(experts, weights, self.config.num_experts, cap, self.config.moe_token_drop_policy)
        if self.cp == 1:
            return keep
        return keep.index_select(0, local_positions(keep.shape[0], self.cp, self.topology.cp_rank, keep.device))

    def _whole_sequences(self, t: torch.Tensor) -> torch.Tensor:
        """``[s/tp, b, ...]`` -> ``[s, b, ...]`` (all-gather over ``"tp"``, no gradient)."""
        if self.tp == 1:
            return t
        with torch.no_grad():
            return gather_from_sequence_parallel_region(t.contiguous(), self.topology, reduce_scatter_grad=False)

    def _losses(self, routing: Routing, whole: int, b: int) -> Tuple[Optional[torch.Tensor], torch.Tensor,
                                                                      torch.Tensor]:
        """(the coefficient-weighted sum of the balancing losses or None, the balancing and z-loss values) of
        ``b`` sequences of ``whole`` tokens."""
        cfg = self.config
        reduce = self._sum_over_tokens if self.tp * self.cp > 1 else None
        total, aux_value, z_value = None, routing.logits.new_zeros(()), routing.logits.new_zeros(())
        kind = cfg.moe_router_load_balancing_type
        with_aux, with_z = computed_losses(cfg)
        if with_aux:
            per_sequence = kind == "seq_aux_loss"
            aux = balancing_loss(routing.probs, routing.experts, cfg.num_experts,
                                 tokens=whole * (1 if per_sequence else b),
                                 per_sequence=b if per_sequence else 0, reduce=reduce)
            total, aux_value = cfg.moe_aux_loss_coeff * aux, aux.detach()
        if with_z:
            z = z_loss(routing.logits, reduce=reduce, tokens=whole * b)
            total = cfg.moe_z_loss_coeff * z if total is None else total + cfg.moe_z_loss_coeff * z
            z_value = z.detach()
        if total is not None:  # the router's gradient on the cp ranks: partial sums, as the language-model loss's
            total = with_cp_factor(total, self.topology)
        return total, aux_value, z_value

    def _dispatch(self, tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                  keep: Optional[torch.Tensor]) -> torch.Tensor:
        """Tokens ``[T, h]`` routed as ``experts``/``weights`` ``[T, k]`` (assignments outside ``keep`` dropped)
        -> the weighted sum of their experts' outputs ``[T, h]``."""
        T, k = experts.shape
        E, ep = self.config.num_experts, self.topology.ep_size
        flat = experts.reshape(-1)
        if keep is not None:  # a dropped assignment's expert becomes E: the stable sort puts it after the kept
            flat = flat.masked_fill(~keep.reshape(-1), E)
        order = torch.sort(flat, stable=True).indices  # kept assignments grouped by expert (then by token), dropped
        counts = torch.bincount(flat, minlength=E + 1)[:E]
        exchange = None
        if ep > 1:  # how many rows each rank sends each of my experts: under way while the tokens are gathered
            send = counts.view(ep, self.local_count)
            recv = torch.empty_like(send)
            exchange = (recv, self.topology.comm.all_to_all_single(recv, send, "ep", async_op=True))
        counts = counts.tolist()
        assign, dropped = order[:sum(counts)], order[sum(counts):]
        src = torch.div(assign, k, rounding_mode="floor")  # each kept assignment's token
        routed = tokens.index_select(0, src)  # [N, h]
        if exchange is None:
            out = run_experts(routed, counts, self.experts.local(), self.config.moe_grouped_gemm)
        else:
            out = self._across_ep(routed, counts, *exchange)
        return _Combine.apply(out, weights, assign, src, dropped, k)

    def _across_ep(self, routed: torch.Tensor, counts: List[int], recv: torch.Tensor, exchange) -> torch.Tensor:
        """Send the routed tokens ``[N, h]`` (grouped by global expert, ``counts`` ``[E]``) to their experts' ep
        ranks, run them there, and bring the outputs back in the same order. ``recv`` ``[ep, E/ep]``: the rows each
        rank sends each local expert, filled by the count exchange ``exchange`` (all-to-all over ``"ep"``)."""
        topo, ep, n_local = self.topology, self.topology.ep_size, self.local_count
        exchange.wait()
        got = recv.tolist()
        in_splits = [sum(counts[r * n_local:(r + 1) * n_local]) for r in range(ep)]
        out_splits = [sum(row) for row in got]
        arrived = all_to_all_v(routed, out_splits, in_splits, topo, "ep", op="moe_dispatch",
                               back_op="moe_dispatch_grad", quant=self.dispatch_quant)
        # arrived rows: by source rank, then by my local expert; each expert takes its block from every source and
        # the outputs go back in the same blocks (no regrouping gather, no scatter in backward)
        blocks = arrived.split([n for row in got for n in row])
        outs = run_experts_on_blocks([[blocks[r * n_local + j] for r in range(ep)] for j in range(n_local)],
                                     self.experts.local(), self.config.moe_grouped_gemm)
        back = torch.cat([outs[j][r] for r in range(ep) for j in range(n_local)])
        return all_to_all_v(back, in_splits, out_splits, topo, "ep", op="moe_combine", back_op="moe_combine_grad",
                            quant=self.dispatch_quant)

    # ---- forward -------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg, topo = self.config, self.topology
        h = x.shape[-1]
        # The router's scores and top-k: static shapes, traced into a compiled block (model_zoo.compile)
        weight = copy_to_tp_region(self.router.weight, topo) if self.tp > 1 else self.router.weight
        dt = torch.promote_types(x.dtype, torch.float32)
        logits = F.linear(x.reshape(-1, h).to(dt), weight.to(dt))  # [T_local, E], in fp32 (or wider)
        bias = self.router.expert_bias if cfg.moe_router_enable_expert_bias else None
        routing = route(logits, cfg, bias)
        y = self._routed_experts(x, routing.experts, routing.weights, routing.probs, routing.logits)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                gate_w = self.shared_expert_gate.weight
                gate_w = copy_to_tp_region(gate_w, topo) if self.tp > 1 else gate_w
                shared = torch.sigmoid(F.linear(x, gate_w)) * shared
            y = y + shared
        return y

    # Inside a compiled block this runs eagerly, one graph break (model_zoo.compile): the capacity and dispatch
    # are data-dependent (tokens per expert, the variable-split all-to-all through the communicator, which counts
    # its bytes), and the side channels must run on every call rather than be traced once: the statistics the
    # monitor and the expert bias read (self.stats, on training's calls only, outside a recompute), and the
    # balancing losses' attachment, whose backward reads the gradient scale the engine sets at backward time.
    @eager
    def _routed_experts(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, probs: torch.Tensor,
                        logits: torch.Tensor) -> torch.Tensor:
        """The routed part of the layer for input ``x`` ``[s/tp, b, h]`` routed as :class:`Routing`'s ``experts``,
        ``weights`` ``[T, k]``, ``probs``, ``logits`` ``[T, E]`` (``T = s/tp b``, this rank's tokens): the balancing
        losses (sums over ``"tp"`` and ``"cp"``), the capacity (gathers over ``"tp"``, ``"cp"``), the dispatch
        (all-to-all over ``"ep"``; all-gather and reduce-scatter over ``"tp"`` with split experts) and the
        statistics. Returns the weighted expert outputs ``[s/tp, b, h]``, carrying the balancing losses into
        backward."""
        cfg, topo = self.config, self.topology
        s_local, b, h = x.shape
        k = cfg.moe_router_topk
        routing = Routing(experts, weights, probs, logits)
        whole = s_local * self.tp * self.cp  # the sequence length: its tokens are on the tp x cp ranks
        aux, aux_value, z_value = self._losses(routing, whole, b)

        experts, weights = routing.experts.view(s_local, b, k), routing.weights.view(s_local, b, k)
        cap = capacity(cfg, whole)
        keep_whole = None  # [s/cp, b, k]: this cp rank's share of whole sequences (all of them at cp 1)
        if cap is not None:
            keep_whole = self._keep(experts, weights, cap)
        if self.etp > 1:
            # the experts are split over TP: every TP rank runs every token of the TP group through its piece
            tokens = gather_from_sequence_parallel_region(x, topo).reshape(-1, h)
            experts_t = self._whole_sequences(experts).reshape(-1, k)
            weights_t = gather_from_sequence_parallel_region(weights.contiguous(), topo).reshape(-1, k)
            keep_t = None if keep_whole is None else keep_whole.reshape(-1, k)
            y = reduce_scatter_to_sequence_parallel_region(self._dispatch(tokens, experts_t, weights_t, keep_t)
                                                           .view(-1, b, h), topo)
        else:
            keep_local = None
            if keep_whole is not None:
                rows = slice(topo.tp_rank * s_local, (topo.tp_rank + 1) * s_local) if self.tp > 1 else slice(None)
                keep_local = keep_whole[rows].reshape(-1, k)
            y = self._dispatch(x.reshape(-1, h), routing.experts, routing.weights, keep_local).view(s_local, b, h)
        if self.training and not self.tracker.recomputing:  # training's routing, counted once (not evaluation's)
            self._count(routing.experts, keep_whole, s_local, b, aux_value, z_value)
        if aux is not None and self.training and torch.is_grad_enabled():
            y = _AttachAuxLoss.apply(y, aux, self.aux_scale)
        return y

    @torch.no_grad()
    def _count(self, experts: torch.Tensor, keep_whole: Optional[torch.Tensor], s_local: int, b: int,
               aux_value: torch.Tensor, z_value: torch.Tensor) -> None:
        st = self.stats
        counts = torch.bincount(experts.reshape(-1), minlength=self.config.num_experts).to(st.tokens_per_expert)
        st.tokens_per_expert += counts
        st.step_tokens += counts
        st.assignments += experts.numel()
        if keep_whole is not None:
            rows = slice(self.topology.tp_rank * s_local, (self.topology.tp_rank + 1) * s_local)
            st.dropped += (~keep_whole[rows]).sum().to(st.dropped)
        # the loss values are the same on every TP rank: count them on one, as the token counts sum over tp
        if self.topology.tp_rank == 0 or self.tp == 1:
            st.aux_loss += aux_value.to(st.aux_loss)
            st.z_loss += z_value.to(st.z_loss)
        st.micro_batches += 1

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """After a step: move the expert bias toward the mean load, with this step's assignments summed over every
        rank that routes tokens (all-reduce over ``token_axes``), identically on every rank; then forget them."""
        st, cfg = self.stats, self.config
        if cfg.moe_router_enable_expert_bias:
            load = st.step_tokens.clone()
            for axis in self.token_axes:
                self.topology.comm.all_reduce(load, axis)
            self.router.expert_bias += cfg.moe_router_bias_update_rate * torch.sign(load.mean() - load).to(
                self.router.expert_bias)
        st.step_tokens.zero_()


# ---- the model's MoE layers ----------------------------------------------------------------------------------
def moe_layers(model: nn.Module) -> List[Tuple[int, MoELayer]]:
    """``(global layer index, layer)`` of the MoE layers this rank's share of ``model`` holds, in order."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, MoELayer):
            out.append((int(name.split(".")[1]), module))
    return out


def update_expert_biases(model: nn.Module) -> None:
    """Every MoE layer's :meth:`MoELayer.update_expert_bias` (collective over its ``token_axes``: ``dp``, ``cp``
    at cp > 1, ``tp`` at TP > 1):
    call once after every optimizer step, on every rank."""
    for _, layer in moe_layers(model):
        layer.update_expert_bias()
