"""Bytes of model state per rank: weights, gradients, master weights and optimizer state.

The prediction lays the parameters out exactly as :mod:`hybrid.zero.flat_buffer`
does -- it calls the same pure function, :func:`hybrid.zero.flat_buffer.plan_segments`,
with the same alignment (:func:`~hybrid.zero.flat_buffer.align_elements`) -- so
padding is predicted, not approximated.

With ``G`` the padded elements of the flat groups of one TP rank's shard
(``G ≈ Ψ/t``), ``N_d`` DP ranks, ``p`` bytes per parameter element, fp32
master weights and Adam (two fp32 moments)::

    stage   weights     gradients          master (p < 4)   Adam m + v
    0       p*G         p*G                4*G              8*G
    1       p*G         p*G                4*G/N_d          8*G/N_d
    2       p*G         p*G/N_d + staging  4*G/N_d          8*G/N_d
    3       p*(P + S)   p*P                4*P              8*P

With fp32 parameters the master *is* the weights (0 extra bytes). Stage 2
gradient staging holds up to ``STAGING_BUFFERS_BEFORE_WAIT`` buckets of the
largest segment. Stage 3 (:func:`stage3_layout`) gathers one *unit* per
module that owns parameters; ``P`` is this rank's chunk of every unit
(``≈ G/N_d``) and ``S`` the pool of small parameters (at most
``persistence_threshold`` elements each) that every rank keeps whole. The
units gathered during the step are counted by :mod:`hybrid.plan.estimate`.
Offload moves the master and the moments to host memory, with host twins of
the low-precision gradient and weight partitions (``2*p*G/N_d``); the stage-3
gradient partition itself lives there. On a CPU-only run (the model already in
host memory) offload copies nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

from hybrid import param_meta
from hybrid.compression import DEFAULT_BLOCK, ONEBIT_ADAM, ONEBIT_BITS, packed_bytes
from hybrid.dtypes import DTYPES
from hybrid.layout import (StageTraits, ZeroStage, keeps_whole_gradients, offload_problem, partition_count,
                           stage_traits)
from hybrid.pipeline.chunks import chunk_parameters
from hybrid.pipeline.split import StageSplit
from hybrid.plan.setup import zero_default
from hybrid.zero.buckets import STAGING_BUFFERS_BEFORE_WAIT
from hybrid.zero.flat_buffer import align_elements, group_classes, param_chunk_sets, plan_segments
from model_zoo.config import GPTConfig

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, ONEBIT_ADAM: 2}  # fp32 state tensors per master element


@dataclasses.dataclass(frozen=True)
class ParamShape:
    """One parameter of one TP rank's shard, in registration order. ``tied``: the last pipeline stage's copy of
    word embeddings tied across stages (:func:`hybrid.param_meta.is_pipeline_tied`), a flat group of its own;
    ``chunks``: on a rank of several model chunks, those whose backward passes reach it (flat segments end where
    they change: :func:`hybrid.zero.flat_buffer.param_chunk_sets`)."""

    name: str
    shape: Tuple[int, ...]
    tied: bool = False
    chunks: Optional[FrozenSet[int]] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@functools.lru_cache(maxsize=128)
def _full_model_params(config_json: str, split: Optional[StageSplit] = None, pp_rank: int = 0
                       ) -> Tuple[Tuple[str, Tuple[int, ...], param_meta.TPMeta, bool, Optional[FrozenSet[int]]], ...]:
    """``(name, TP=1 shape, TP metadata, pipeline-tied, model chunks reaching it)`` of every parameter of the
    model -- of pipeline stage ``pp_rank`` when ``split`` is given -- built on ``meta``."""
    from hybrid.topology import Topology
    from model_zoo.gpt import GPTModel

    config = GPTConfig.from_dict(json.loads(config_json))
    topology = Topology.local(split.pp, pp_rank) if split is not None else Topology.local()
    model = GPTModel(config, topology, device="meta", split=split)
    named = list(model.named_parameters())
    chunks, chunk_params = chunk_parameters(model, pp_rank)
    chunk_sets = param_chunk_sets([p for _, p in named], chunk_params, chunks) or [None] * len(named)
    return tuple((name, tuple(p.shape), param_meta.get_tp_meta(p), param_meta.is_pipeline_tied(p), cs)
                 for (name, p), cs in zip(named, chunk_sets))


def shard_shapes(config: GPTConfig, tp: int, split: Optional[StageSplit] = None,
                 pp_rank: int = 0) -> List[ParamShape]:
    """The parameters one TP rank holds (every TP rank holds the same shapes), tied ones once; those of
    pipeline stage ``pp_rank`` when ``split`` (:class:`hybrid.pipeline.split.StageSplit`) is given.

    Derived from the real model's registration order and TP metadata at TP=1,
    resized the way :func:`hybrid.param_meta.shard` cuts them. An MoE model's
    routed experts are all listed (an ``ep = 1`` rank's view;
    :func:`hybrid.plan.moe.split_expert_shapes` keeps one ep rank's), each cut
    over the expert tensor-parallel size (``GPTConfig.expert_tp``). Worked out
    once per model, size and stage (the planner asks for every candidate).
    """
    return list(_shard_shapes(json.dumps(config.to_dict(), sort_keys=True), tp, split, pp_rank))


@functools.lru_cache(maxsize=256)
def _shard_shapes(config_json: str, tp: int, split: Optional[StageSplit], pp_rank: int) -> Tuple[ParamShape, ...]:
    from hybrid.plan.moe import as_run, is_expert_name

    config = GPTConfig.from_dict(json.loads(config_json))
    as_run(config, tp).validate(tp)
    etp = config.expert_tp(tp)
    out = []
    for name, shape, meta, tied, chunks in _full_model_params(config_json, split, pp_rank):
        local = list(shape)
        if meta.partitioned:
            local[meta.dim] = param_meta.piece_size(meta, shape[meta.dim], etp if is_expert_name(name) else tp)
        out.append(ParamShape(name, tuple(local), tied, chunks))
    return tuple(out)


def no_decay_1d(p: ParamShape) -> bool:
    """The engine's default rule: parameters with at most one dimension get no weight decay."""
    return len(p.shape) <= 1


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """The flat groups of one rank's shard as the ZeRO optimizer builds them.

    ``groups``: per group ``(padded numel, [segment sizes])``; the partition
    of one DP rank is ``numel / N_d`` elements. ``launches``: every segment
    (bucket) as ``(ready, size)`` in the order the gradient reducer launches
    them (:mod:`hybrid.zero.buckets`: by first-registered parameter, last
    first), where ``ready`` is the share of the shard's parameter elements
    whose gradients backward has produced when the segment's first parameter
    gets its own (backward runs in reverse registration order), the moment the
    segment can be reduced. ``arrivals``: the gradients in the order backward
    produces them (:func:`backward_arrivals`), one entry per module, whose
    backward produces its parameters' gradients together: ``(its transformer
    layer or -1, ((elements, the index in launches of the parameter's segment),
    ...))``, its parameters in the order their hooks run.
    """

    groups: Tuple[Tuple[int, Tuple[int, ...]], ...]
    element_bytes: int
    dp: int
    unpadded: int  # trainable elements without padding
    launches: Tuple[Tuple[float, int], ...] = ()
    tied_segments: Tuple[int, ...] = ()  # the segments of the group of a weight tied across pipeline stages
    # Stage 2's staging buckets kept open through backward: the last pipeline rank's tied copy of the word
    # embeddings is registered first, so reduced last, yet its gradient (the head's) arrives first.
    held_open: int = 0
    arrivals: Tuple[Tuple[int, Tuple[Tuple[int, int], ...]], ...] = ()

    @property
    def numel(self) -> int:
        return sum(n for n, _ in self.groups)

    @property
    def partition_numel(self) -> int:
        return sum(n // self.dp for n, _ in self.groups)

    @property
    def largest_segment(self) -> int:
        return max(max(sizes) for _, sizes in self.groups)

    @property
    def segments(self) -> int:
        return sum(len(sizes) for _, sizes in self.groups)


def flat_layout(params: Sequence[ParamShape], dp: int, precision: str, bucket_size: int,
                weight_decay: bool = True, tied_head: bool = False) -> FlatLayout:
    """Lay ``params`` out in flat groups the way :func:`hybrid.zero.flat_buffer.build_flat_groups` does.

    Groups are ``(dtype, decay, tied)`` classes in order of first appearance;
    one dtype here (the whole model runs in ``precision``). ``weight_decay``:
    the optimizer has a non-zero weight decay, so 1-D parameters form a group
    of their own; a weight tied across pipeline stages (``ParamShape.tied``)
    is always alone; ``tied_head``: these are the last pipeline rank's
    parameters, whose tied copy serves as the output head
    (:attr:`FlatLayout.held_open`).
    """
    dtype = DTYPES[precision]
    # class -> each member's place in registration order
    positions = group_classes([(weight_decay and not no_decay_1d(p), p.tied) for p in params])
    classes = {key: [params[i].numel for i in members] for key, members in positions.items()}
    chunk_sets = {key: [params[i].chunks for i in members] for key, members in positions.items()}
    before = [0]
    for p in params:
        before.append(before[-1] + p.numel)  # elements registered before each parameter
    total = max(1, before[-1])
    groups, launches, tied = [], [], ()
    for key, numels in classes.items():  # dicts keep insertion order: first appearance
        segments = plan_segments(numels, dp, bucket_size, align_elements(dtype), chunk_sets[key])
        groups.append((sum(s.size for s in segments), tuple(s.size for s in segments)))
        if key[1]:
            tied = groups[-1][1]
        for seg in segments:
            members = [positions[key][r] for r in seg.records]  # registration positions of its parameters
            launches.append((members[0], 1.0 - before[members[0]] / total, seg.size, members))
    launches.sort(key=lambda launch: -launch[0])
    segment_of = {i: k for k, launch in enumerate(launches) for i in launch[3]}
    arrivals = tuple((layer_index(params[module[0]].name), tuple((params[i].numel, segment_of[i]) for i in module))
                     for module in backward_arrivals(params, tied_head))
    return FlatLayout(tuple(groups), torch.empty((), dtype=dtype).element_size(), dp,
                      sum(p.numel for p in params), tuple((ready, size) for _, ready, size, _ in launches), tied,
                      len(tied) if tied_head else 0, arrivals)


def layer_index(name: str) -> int:
    """The transformer layer of a parameter or module named ``name`` (``layers.<i>...``); -1 outside the layers."""
    parts = name.split(".")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "layers" else -1


def backward_arrivals(params: Sequence[ParamShape], tied_head: bool = False) -> List[List[int]]:
    """Indices into ``params`` (registration order) in the order backward produces their gradients, grouped by
    module: a module's backward produces the gradients of all its parameters (a linear layer's weight and bias)
    before their hooks run. Modules come in the reverse of registration (a tied word embedding's lookup,
    registered first, is the last contribution), except that the last pipeline rank's tied copy of the word
    embeddings (``tied_head``) is its head, whose gradient comes first; within a module, the reverse too."""
    order = list(reversed(range(len(params))))
    if tied_head:
        order.sort(key=lambda i: not params[i].tied)  # stable: the others keep their order
    modules: List[List[int]] = []
    for i in order:
        module = params[i].name.rpartition(".")[0]
        if modules and params[modules[-1][0]].name.rpartition(".")[0] == module:
            modules[-1].append(i)
        else:
            modules.append([i])
    return modules


def fitting_prefix(sizes: Sequence[int], budget: int) -> int:
    """Elements of the whole units at the head of ``sizes`` that fit ``budget``, up to the first that does not:
    what :class:`hybrid.zero.param_gather.ParamGatherer` gathers ahead within its prefetch window."""
    total = 0
    for size in sizes:
        if total + size > budget:
            break
        total += size
    return total


@dataclasses.dataclass(frozen=True)
class Stage3Layout:
    """The ZeRO-3 units of one rank's shard, as :func:`hybrid.zero.stage3_layout.build_units` cuts them.

    ``units``: padded elements of each gathered unit (one per module that owns
    parameters), in module order; ``persistent``: padded elements of the pool
    of small parameters every rank keeps whole; ``partition_numel``: this
    rank's chunk of all of them.
    """

    units: Tuple[int, ...]
    persistent: int
    partition_numel: int
    element_bytes: int
    dp: int
    head_unit: int  # the unit of the output projection's weight (the word embeddings when tied)
    head_index: int = -1  # its position in ``units``
    unit_layers: Tuple[int, ...] = ()  # the transformer layer of each of ``units`` (-1: outside the layers)
    whole_parameter: Tuple[bool, ...] = ()  # per unit, :attr:`hybrid.zero.stage3_layout.Unit.whole_parameter`

    @property
    def largest_unit(self) -> int:
        return max(self.units, default=0)

    @property
    def layer_units(self) -> int:
        """Elements of the gathered units of the largest transformer layer, all together."""
        per_layer: Dict[int, int] = collections.defaultdict(int)
        for size, layer in zip(self.units, self.unit_layers):
            if layer >= 0:
                per_layer[layer] += size
        return max(per_layer.values(), default=0)

    def _backward_indices(self, tied: bool) -> List[int]:
        """Indices into ``units`` in the order backward completes their gradients.

        Backward runs the modules in reverse; a tied word embedding gets its
        last contribution (the lookup at the very start of forward) last.
        """
        order = list(reversed(range(len(self.units))))
        if tied and 0 <= self.head_index < len(self.units):
            order.append(order.pop(len(self.units) - 1 - self.head_index))
        return order

    def backward_order(self, tied: bool) -> Tuple[int, ...]:
        """Sizes of the gathered units in the order backward completes their gradients."""
        return tuple(self.units[i] for i in self._backward_indices(tied))

    def backward_copied(self, tied: bool) -> Tuple[bool, ...]:
        """Per unit of :meth:`backward_order`, whether its gradient is copied into a staging buffer (held twice
        for a moment); a unit that is one whole parameter takes autograd's gradient as it is."""
        return tuple(not self.whole_parameter[i] if self.whole_parameter else True
                     for i in self._backward_indices(tied))

    def backward_layer_starts(self, tied: bool) -> Tuple[int, ...]:
        """Positions in :meth:`backward_order` where each transformer layer's backward begins (its first unit
        there), from the last layer to the first."""
        layers = [self.unit_layers[i] for i in self._backward_indices(tied)] if self.unit_layers else []
        return tuple(k for k, layer in enumerate(layers) if layer >= 0 and (k == 0 or layers[k - 1] != layer))

    def next_forward(self, prefetch: int, live: int) -> int:
        """Elements gathered between steps: the next forward's first units, whose gathers start once the update
        has written the partitions (:meth:`hybrid.zero.param_gather.ParamGatherer.prefetch_next_forward`), in
        module order while they fit ``prefetch`` elements (``zero.prefetch_bucket_size``) and ``live``."""
        return fitting_prefix(self.units, min(prefetch, live))

    def held_into_backward(self, keep: int) -> FrozenSet[int]:
        """Indices (into ``units``) of the units that stay gathered from forward into backward.

        Forward keeps a unit used again within the next ``keep`` elements
        (:func:`hybrid.zero.param_gather.keep_numel`: the prefetch window, or
        ``zero.max_reuse_distance`` when larger) of the recorded sequence
        (:class:`hybrid.zero.param_gather.ParamGatherer`): at the end of
        forward that is the head of backward's gathers, the head's unit first,
        then the others in reverse module order, up to the first that does not fit.
        """
        head = self.head_index if 0 <= self.head_index < len(self.units) else None
        order = ([head] if head is not None else []) + [i for i in reversed(range(len(self.units))) if i != head]
        held = set()
        for i in order:
            if self.units[i] > keep:
                break
            held.add(i)
            keep -= self.units[i]
        return frozenset(held)


@functools.lru_cache(maxsize=64)
def _stage3_units(config_json: str, tp: int, dp: int, precision: str, persistence_threshold: int,
                  weight_decay: bool) -> Tuple[Tuple[int, ...], int, int, int, int, Tuple[int, ...], Tuple[bool, ...]]:
    from hybrid.topology import Topology
    from hybrid.zero.stage3_layout import build_units
    from model_zoo.gpt import GPTModel

    config = GPTConfig.from_dict(json.loads(config_json))
    local = {s.name: s.shape for s in shard_shapes(config, tp)}
    model = GPTModel(config, Topology.local(), device="meta")
    for name, p in model.named_parameters():  # this TP rank's shapes, on meta
        p.data = torch.empty(local[name], dtype=DTYPES[precision], device="meta")
    units, _ = build_units(model, dp, persistence_threshold, weight_decay, lambda name, p: p.ndim <= 1)
    head = id(model.head_weight())
    gathered = [u for u in units if not u.persistent]
    head_index = next((k for k, u in enumerate(gathered) if any(id(q) == head for q in u.params)), -1)
    layer_of = tuple(layer_index(u.module_name) for u in gathered)
    return (tuple(u.numel for u in gathered), sum(u.numel for u in units if u.persistent),
            sum(u.chunk_numel for u in units), gathered[head_index].numel if head_index >= 0 else 0, head_index,
            layer_of, tuple(u.whole_parameter for u in gathered))


def stage3_layout(config: GPTConfig, tp: int, dp: int, precision: str,
                  persistence_threshold: int = zero_default("persistence_threshold"),
                  weight_decay: bool = True) -> Stage3Layout:
    """The stage-3 units of ``config`` at TP ``tp`` over ``dp`` ranks (the optimizer's own function, on meta)."""
    config.validate(tp)
    units, persistent, partition, head, head_index, layer_of, whole = _stage3_units(
        json.dumps(config.to_dict(), sort_keys=True), tp, dp, precision, persistence_threshold, weight_decay)
    return Stage3Layout(units, persistent, partition, torch.empty((), dtype=DTYPES[precision]).element_size(), dp,
                        head, head_index, layer_of, whole)


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Model-state bytes of one rank. ``device`` fields live on the accelerator, ``host`` on the CPU.

    ``step_workspace``: the transient of the optimizer step (fp32 copies of
    low-precision gradients for the largest group), on whichever side steps.
    ``secondary_weights``: stage 3's hpZ copy of the weights (``memory_report()``'s
    ``secondary_params``). ``error_feedback``: 1-bit Adam's worker and server
    errors and its packed momentum (``memory_report()``'s ``error_feedback`` plus
    ``compressed_momentum``), from the first compressed step on.
    """

    weights: int
    grads: int
    grad_buckets: int
    master: int
    optimizer_states: int
    step_workspace: int
    host_master: int = 0
    host_optimizer_states: int = 0
    host_grads: int = 0
    secondary_weights: int = 0
    error_feedback: int = 0

    @property
    def device_total(self) -> int:
        return (self.weights + self.grads + self.grad_buckets + self.master + self.optimizer_states
                + self.secondary_weights + self.error_feedback)

    @property
    def host_total(self) -> int:
        return self.host_master + self.host_optimizer_states + self.host_grads


def _check(stage: int, offload: str, optimizer: str) -> StageTraits:
    """What ``stage`` partitions; a ValueError naming the setting for a stage, offload or optimizer not modelled."""
    traits = stage_traits(stage)  # hybrid.layout.LayoutError (a ValueError) for a stage that does not exist
    problem = offload_problem(stage, offload)
    if problem:
        raise ValueError(problem)
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}")
    return traits


def _optimizer_bytes(part: int, pb: int, offload: str, optimizer: str, momentum: bool, compiled_adam: bool,
                     host_is_device: bool, largest_group_part: int) -> Tuple[int, int, int]:
    """``(master, optimizer states, step workspace)`` bytes for a partition of ``part`` elements."""
    n_states = OPTIMIZER_STATES[optimizer] if optimizer != "sgd" else (1 if momentum else 0)
    # The master is the weights themselves when they are fp32 and live where the optimizer steps.
    aliased = pb == 4 and (offload == "none" or host_is_device)
    master = 0 if aliased else 4 * part
    reads_lowp = compiled_adam and optimizer != "sgd"
    workspace = 4 * largest_group_part if pb != 4 and not reads_lowp else 0
    return master, 4 * part * n_states, workspace


def state_bytes(layout: FlatLayout, stage: int, *, precision: str, offload: str = "none",
                optimizer: str = "adamw", momentum: bool = False, compiled_adam: bool = True,
                host_is_device: bool = False, reduce_once: bool = False,
                quantization_block: int = DEFAULT_BLOCK) -> StateBytes:
    """Per-rank bytes of weights, gradients, master and optimizer state over ``layout.dp`` ranks, for a stage that
    keeps its parameters whole (flat buffers).

    ``reduce_once`` (``zero.reduce_once``): stage 2 keeps the whole gradient
    (:func:`hybrid.layout.keeps_whole_gradients`), as stage 1 does, and so does
    ``optimizer="onebit_adam"``, which also holds :func:`onebit_bytes`
    (``quantization_block``: ``zero.quantization_block``, its 1-bit block).

    ``compiled_adam``: the step runs hybrid's compiled Adam, which reads
    low-precision gradients directly; otherwise they are first cast to fp32
    (``step_workspace``). ``host_is_device``: the model itself lives in host
    memory (a CPU run), where offload copies nothing. Stage 3 is
    :func:`stage3_state_bytes`.
    """
    traits = _check(stage, offload, optimizer)
    if traits.parameters:
        raise ValueError(f"ZeRO stage {int(stage)} partitions the parameters in units: use "
                         f"stage3_state_bytes(stage3_layout(...))")
    pb = layout.element_bytes
    parts = partition_count(stage, layout.dp)
    full, part = layout.numel, layout.numel // parts
    weights = pb * full
    onebit = optimizer == ONEBIT_ADAM
    whole_grads = keeps_whole_gradients(traits, reduce_once or onebit)  # see TrainingSetup.whole_gradients
    grads = pb * (full if whole_grads else part)
    staging = 0
    if not whole_grads:
        # Partitioned gradients are staged bucket by bucket in a pool of buffers before each reduce-scatter.
        staging = pb * layout.largest_segment * min(STAGING_BUFFERS_BEFORE_WAIT + layout.held_open, layout.segments)
    largest_group_part = max(n // parts for n, _ in layout.groups)
    master, states, workspace = _optimizer_bytes(part, pb, offload, optimizer, momentum, compiled_adam,
                                                 host_is_device, largest_group_part)
    if offload == "none" or host_is_device:
        return StateBytes(weights, grads, staging, master, states, workspace,
                          error_feedback=onebit_bytes(layout, quantization_block) if onebit else 0)
    # Host twins of the reduced gradient chunks and of the low-precision weight chunks the CPU step writes.
    return StateBytes(weights, grads, staging, 0, 0, 0, host_master=master, host_optimizer_states=states,
                      host_grads=2 * pb * part)


def snapshot_bytes(model_numel: int, element_bytes: int, partition_numel: int, *, optimizer: str = "adamw",
                   momentum: bool = False, chunk_bytes: Optional[int] = None) -> int:
    """Host bytes of a background checkpoint save's copy (``checkpoint.async_save``) on DP rank 0, the rank
    that copies the most: the model shard it writes (``model_numel`` elements of ``element_bytes``), its fp32
    master partition and its optimizer state (``partition_numel`` elements each; what the optimizer file
    holds), bounded by ``chunk_bytes`` (``checkpoint.async_save_chunk_mb``) when set.
    """
    n_states = OPTIMIZER_STATES[optimizer] if optimizer != "sgd" else (1 if momentum else 0)
    total = element_bytes * model_numel + 4 * partition_numel * (1 + n_states)
    return total if chunk_bytes is None else min(total, chunk_bytes)


def onebit_bytes(layout: FlatLayout, block: int) -> int:
    """1-bit Adam's state beyond Adam's (:mod:`hybrid.zero.onebit`): per bucket of ``s`` elements cut into
    ``dp`` rows of ``k = ceil(s / dp)``, the worker error (fp32 ``[dp*k]``), the server error (fp32 ``[k]``)
    and the packed momentum every rank received (``dp`` packed rows)."""
    n, total = layout.dp, 0
    for _, sizes in layout.groups:
        for size in sizes:
            k = -(-size // n)
            total += 4 * n * k + 4 * k + n * packed_bytes(k, ONEBIT_BITS, block)
    return total


def stage3_state_bytes(layout: Stage3Layout, *, offload: str = "none", optimizer: str = "adamw",
                       momentum: bool = False, compiled_adam: bool = True, host_is_device: bool = False,
                       hpz: int = 1) -> StateBytes:
    """Per-rank bytes held between steps under ZeRO stage 3 (gathered units come and go during the step).

    The parameters are this rank's partition plus the whole persistent pool;
    the gradient partition has the parameters' dtype and sits in host memory
    when the optimizer is offloaded, next to a host copy of the low-precision
    partition that the CPU step writes. ``hpz`` (``zero.hpz_partition_size``
    > 1) adds the secondary partition: ``1/hpz`` of every gathered unit
    (:mod:`hybrid.zero.secondary_partition`).
    """
    _check(ZeroStage.PARAMETERS, offload, optimizer)
    pb, part = layout.element_bytes, layout.partition_numel
    weights = pb * (part + layout.persistent)
    secondary = pb * sum(size // hpz for size in layout.units) if hpz > 1 else 0
    master, states, workspace = _optimizer_bytes(part, pb, offload, optimizer, momentum, compiled_adam,
                                                 host_is_device, part)
    if offload == "none" or host_is_device:
        return StateBytes(weights, pb * part, 0, master, states, workspace, secondary_weights=secondary)
    return StateBytes(weights, 0, 0, 0, 0, 0, host_master=master, host_optimizer_states=states,
                      host_grads=2 * pb * part, secondary_weights=secondary)
