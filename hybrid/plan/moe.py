"""Mixture of Experts in the planner: expert parallelism, the experts' state, the token all-to-alls and the
activations of routed tokens (``docs/moe.md`` describes the layer, ``docs/planner.md`` these formulas).

Symbols, per MoE layer and micro-batch on one rank: ``E`` experts, ``k`` = ``moe_router_topk``, ``h`` the
hidden size, ``f'`` the expert width (``expert_ffn_size``), ``b`` the MLP's input blocks (2 for SwiGLU),
``p`` bytes per activation element, ``ep`` the expert-parallel size (it subdivides ``dp``: :mod:`hybrid.grid`),
``etp`` the expert tensor-parallel size (``GPTConfig.expert_tp``), ``T`` the tokens this rank routes:

* ``T = N = s * mb`` when the experts are split over TP (``etp = tp``: the TP group's tokens are gathered and
  every TP rank routes the same ones) or ``tp = 1``; ``T = N / tp`` with ``etp = 1`` under sequence
  parallelism (each TP rank routes its own sequence shard), else ``N``.

**Parameters per rank**: the dense ones (attention, norms, embeddings, the router, the shared expert) as the
dense model's, split by ``tp`` (and ``pp``); the routed experts ``E / ep`` per MoE layer, each split by
``etp``. Their ZeRO state is partitioned over ``edp = dp / ep`` (the ranks that hold the same experts), the
dense state over ``dp``, each by the stage (:func:`split_expert_shapes`).

**All-to-all bytes per step** (:func:`moe_volume`): per MoE layer and micro-batch, the dispatch sends the
``T k`` chosen (token, expert) rows of ``h`` elements, ``T k h p`` bytes, to the experts' ranks, and the
combine returns as many; backward sends each one's gradient the other way. So four all-to-alls per layer and
micro-batch (``moe_dispatch/ep``: the forward dispatch and its backward; ``moe_combine/ep``: the forward
combine and its backward), and a fifth and sixth (forward replayed) under full recomputation. With balanced
routing a rank sends ``T k h p / ep`` to every rank of its ``ep`` group, ``(ep - 1) / ep`` of it off the
rank; which of those peers sit on other nodes follows from the rank grid (:mod:`hybrid.plan.links`: ``ep``
consecutive dp ranks, ``tp`` apart, so ``tp * ep`` ranks within a node keep the all-to-all on the node).
With ``moe_quantized_dispatch`` a row's ``h p`` bytes become its packed size (``GPTConfig.dispatch_quantization``).

**Routed-token activations** (:func:`moe_layer_activation_bytes`), per MoE layer, replacing the dense MLP's::

    router            fp32 logits and scores 8 T E, chosen indices and weights 12 T k
    experts           their input p R h, and the MLP's 2 b p R f' / etp (input projection's output,
                      SwiGLU's silu(gate) and product)
    combine           the experts' outputs returned, p T k h (the weights' gradient needs them)
    shared expert     2 b p N fs / tp, as a dense MLP of width fs

``R`` is the rows this rank's experts receive (:func:`received_rows`). Balanced (the planner's default,
``typical``): ``R = T k``. The dropless worst case (the bound the planner states): every token of the ``ep``
group picks as many of this rank's experts as it can, ``min(k, E / ep)``, so ``R = ep T min(k, E / ep)``
(at ``ep = 1`` that is ``T k`` again: one rank holds every expert). With a capacity factor ``c``
(``moe_expert_capacity_factor``) an expert keeps at most ``ceil(c s k / E)`` tokens of each sequence, which
caps ``R`` at ``ep * mb' * (E / ep) * ceil(c s k / E)`` (``mb'`` the sequences, or sequence shards, each rank
routes).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

from hybrid.grid import expert_parallel_problem
from model_zoo.config import GPTConfig, moe_problem

# The two cases of routed-token activations the planner reports: even loads, and the dropless bound.
ROUTING_CASES = ("typical", "worst")
# A parameter of a routed expert, by its name (docs/moe.md): ``layers.{i}.mlp.experts.{e}.…``.
EXPERT_MARK = ".mlp.experts."


def is_expert_name(name: str) -> bool:
    return EXPERT_MARK in name


def expert_index(name: str) -> int:
    """The global index ``e`` of the expert a parameter ``layers.{i}.mlp.experts.{e}.…`` belongs to."""
    return int(name.split(EXPERT_MARK)[1].split(".")[0])


def expert_parallel_sizes(config: GPTConfig, dp: int, wanted: Optional[Sequence[int]] = None) -> List[int]:
    """The expert-parallel sizes a layout of ``dp`` data-parallel ranks can use (those :func:`moe_problem_at`
    accepts), within ``wanted`` when given; ``[1]`` for a dense model."""
    return [ep for ep in range(1, dp + 1)
            if moe_problem_at(config, dp, ep) is None and (wanted is None or ep in wanted)]


def moe_problem_at(config: GPTConfig, dp: int, ep: int) -> Optional[str]:
    """Why ``ep`` cannot share out ``config``'s experts at ``dp`` (None when it can): the grid's rule
    (:func:`hybrid.grid.expert_parallel_problem`) and the model's (:func:`model_zoo.config.moe_problem`)."""
    return expert_parallel_problem(dp, 1, ep) or moe_problem(config, 1, ep)


def split_expert_shapes(shapes: Sequence, config: GPTConfig, ep: int, ep_rank: int = 0):
    """``(dense, experts)``: ``shapes`` (:class:`hybrid.plan.model_memory.ParamShape`, every expert) split into
    the parameters every dp rank holds and the routed experts of ep rank ``ep_rank``, ``E / ep`` per MoE layer
    (expert ``e`` lives on ep rank ``e // (E / ep)``)."""
    dense = [s for s in shapes if not is_expert_name(s.name)]
    if not config.is_moe:
        return dense, []
    per_rank = config.num_experts // ep
    experts = [s for s in shapes if is_expert_name(s.name) and expert_index(s.name) // per_rank == ep_rank]
    return dense, experts


def as_run(config: GPTConfig, tp: int) -> GPTConfig:
    """``config`` as a job at ``tp`` runs it: an MoE model at ``tp > 1`` with sequence parallelism, which
    :func:`model_zoo.config.moe_problem` requires (the planner then checks it with :meth:`GPTConfig.validate`)."""
    if config.is_moe and tp > 1 and not config.sequence_parallel:
        return config.replace(sequence_parallel=True)
    return config


def routing_tokens(config: GPTConfig, micro_batch: int, tp: int, sequence_parallel: bool) -> int:
    """``T``: the tokens one rank routes per micro-batch (the module docstring)."""
    n = config.seq_length * micro_batch
    if tp > 1 and config.expert_tp(tp) == 1 and sequence_parallel:
        return n // tp
    return n


def received_rows(config: GPTConfig, tokens: int, ep: int, case: str = "typical", micro_batch: int = 1) -> int:
    """``R``: the (token, expert) rows one rank's experts take in one MoE layer and micro-batch, when every rank
    of the ``ep`` group routes ``tokens`` (from ``micro_batch`` sequences); ``case`` ``typical`` (balanced:
    ``T k``) or ``worst`` (the dropless bound ``ep T min(k, E / ep)``, capped by the capacity factor when one
    is set: each of the rank's ``E / ep`` experts takes at most ``ceil(c s k / E)`` rows of each of the
    group's ``ep * micro_batch`` sequences, and at most one per token)."""
    if case not in ROUTING_CASES:
        raise ValueError(f"routing case must be one of {', '.join(ROUTING_CASES)}, got {case!r}")
    k, E = config.moe_router_topk, config.num_experts
    if case == "typical":
        return tokens * k
    worst = ep * tokens * min(k, E // ep)
    c = config.moe_expert_capacity_factor
    if c is not None:
        capacity = math.ceil(c * config.seq_length * k / E)
        worst = min(worst, ep * micro_batch * (E // ep) * min(capacity, tokens // micro_batch))
    return worst


def moe_layer_activation_bytes(config: GPTConfig, micro_batch: int, tp: int, sequence_parallel: bool, p: int,
                               ep: int = 1, case: str = "typical") -> int:
    """Bytes one MoE layer's MLP saves for backward on one rank (the module docstring), in place of the dense
    MLP's ``2 b p N f / tp``."""
    n = config.seq_length * micro_batch
    t = routing_tokens(config, micro_batch, tp, sequence_parallel)
    k, E, h = config.moe_router_topk, config.num_experts, config.hidden_size
    etp, blocks = config.expert_tp(tp), config.mlp_input_blocks
    r = received_rows(config, t, ep, case, micro_batch)
    router = 8 * t * E + 12 * t * k
    experts = p * r * h + 2 * blocks * p * r * config.expert_ffn_size // etp
    combine = p * t * k * h
    fs = config.moe_shared_expert_intermediate_size or 0
    shared = 2 * blocks * p * n * fs // tp
    return router + experts + combine + shared


def moe_layers_of(config: GPTConfig, layers: Optional[Sequence[int]] = None) -> int:
    """How many of ``layers`` (default all) are MoE layers."""
    pattern = config.moe_layer_pattern()
    return sum(pattern[i] for i in (range(config.num_layers) if layers is None else layers))


def all_to_all_bytes(config: GPTConfig, micro_batch: int, tp: int, sequence_parallel: bool, p: int) -> int:
    """Bytes of one dispatch (or combine) of one MoE layer and micro-batch on one rank: ``T k h p``, every
    chosen (token, expert) row, the ``1/ep`` for this rank's own experts included; with
    ``moe_quantized_dispatch`` each row of ``h`` values travels packed (``GPTConfig.dispatch_quantization``)."""
    quant = config.dispatch_quantization
    row = quant.wire_bytes(config.hidden_size) if quant is not None else config.hidden_size * p
    return routing_tokens(config, micro_batch, tp, sequence_parallel) * config.moe_router_topk * row


def a2a_calls(recompute: str) -> int:
    """All-to-alls of each kind (dispatch, combine) per MoE layer and micro-batch: forward and backward, and the
    forward again under full recomputation."""
    return 3 if recompute == "full" else 2
