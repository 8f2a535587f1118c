"""Per-device memory of one layout: the components, the peak, and the fragmentation allowance.

The peak is the most that is live at once in one training step. Model state
(:mod:`hybrid.plan.model_memory`) is live throughout; on top of it the step
passes three high points, and the peak is the largest:

* **end of forward** (the loss): every activation of the micro-batch is saved
  (:mod:`hybrid.plan.activations`), and the loss computes on the logits
  ``p*N*V'`` with two fp32 ``[N, V']`` temporaries;
* **backward**: the saved activations minus what has been consumed, plus
  gradients in flight. At its start the loss gradient (``4*N*V'`` fp32 plus
  its cast) sits beside everything saved; then the head's matmuls (logits
  gradient, ``V'*h`` weight gradient); then each layer's largest weight
  gradient and input gradient, beside a tied head's gradient that waits for
  the embedding's and the activations of the layers not passed yet. With full
  recomputation one layer's activations are rebuilt (``layer_full`` less the
  layer's input, which is the saved one) while the others' inputs wait.
  Each layer's gradients also sit beside the reductions launched before
  them and not yet waited on: for whole parameters (stages 0-2) the replay
  :func:`flat_gradient_flow` of the reducer, for stage 3 :func:`stage3_gradient_flow`.
  With whole parameters and nothing held in flight (NCCL, or stage 0's
  all-reduce) the last layer's is the worst;
* **optimizer step**: activations are gone; what remains is the step's
  workspace (fp32 copies of low-precision gradients when the optimizer cannot
  read them directly) and, on gloo, the temporary an all-gather lands in.

Communication buffers: stage 2's gradient staging buckets are part of the
state. Under stage 3 gathered units come on top of the peaks: at the loss, the
head's unit (the tied embedding is used outside its module) and one unit
prefetched behind it, or the units forward keeps for backward when more
(``TrainingSetup.stage3_keep``); in backward, a unit with the ones kept or
prefetched ahead of it (at most the keep window, ``stage3_live_parameters`` in all),
plus the gradient flow :func:`stage3_gradient_flow` replays: staging, autograd's
gradient of the unit and the buckets on the wire. A layer's backward also holds
the gradients of the units done before it (the replay's
:attr:`GradientFlow.layers`: the open bucket's and the persistent pool's
staging buffers, the buckets on the wire), while the activations of the
layers passed are gone.

The fragmentation allowance is ``fragmentation`` (default 10%) of the
transient part (activations, workspaces, gathered units), which a caching
allocator cannot always pack; the persistent state is allocated once, in
large blocks, and gets none. The measured peak on the CPU (live tensor bytes)
is compared with the peak *without* the allowance.

A reduce-scatter in flight holds buffers until it is waited on: stage 1
waits on none before the step, so each layer's gradients sit beside the
buckets of the layers passed and at the end of backward every bucket is in
flight; stage 2 waits whenever a bucket needs a staging buffer beyond its
pool, so at most the pool's buckets are (:func:`flat_gradient_flow`); stage 3
what :func:`stage3_gradient_flow` replays. On gloo they run as
hybrid's point-to-point messages (:mod:`hybrid.p2p_collectives`), which send
from the bucket itself and receive into tensors, ``(N_d-1)/N_d`` of each input
(:func:`reduce_scatters_in_flight`; stage 3's in its replay): those are in the
tensor peak, and the CPU profile counts no library copy. Measured: the summed
RSS of 4 ranks of a 2-layer model within 1% for stage 3 (35M-element units)
and 0.1-1.2% for stage 1 (``benchmarks/max_model_size.py``; a whole copy of
each input, counted before, put stage 1 7% high). A backend that kept a
private copy of each input (``DeviceProfile.reduce_scatter_copies_input``
without ``p2p_reduce_scatter``) would hold bytes that are not tensors: they
are kept apart as ``untracked`` (what they add to the tensor peak). NCCL
reduces in place, so the CUDA profile has none.

Compressed communication (:mod:`hybrid.plan.compressed`) allocates real
tensors instead, on every device. With ``zero.quantized_gradients`` each
reduction in flight holds its packed send and receive buffers (and at stage
0 its fp32 summed chunk) until it is waited on: at the end of backward that
is every bucket when the stage reduces once per step (stages 0-1, stage 2
with ``reduce_once``), the staging pool plus one otherwise; these replace
the point-to-point receive buffers (the quantized path is an all-to-all). Stage 0 waits on each bucket in the step by
all-gathering its summed chunks, quantized, into an fp32 buffer. With
``zero.quantized_weights`` the all-gathers after a stage 1-2 step hold every
segment's packed chunk and gather, and dequantize one segment at a time
through an fp32 ``[n, k]`` temporary. Both land in the step's gather
temporary. Stage 3's quantized gathers and buckets are not counted: their
packed buffers and fp32 temporaries sit beside the gathered units and the
buckets of :func:`stage3_gradient_flow`, which replays the unquantized path.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Callable, List, Optional, Sequence, Tuple, Union

from hybrid.dtypes import DTYPE_BYTES
from hybrid.layout import partition_count, stage_traits
from hybrid.plan.activations import ActivationBytes, DeviceProfile, activation_bytes
from hybrid.plan.candidate import Candidate
from hybrid.plan.compressed import FP32, chunk, gather_buffers, reduction_buffers
from hybrid.plan.model_memory import (FlatLayout, Stage3Layout, StateBytes, fitting_prefix, flat_layout, shard_shapes,
                                      snapshot_bytes, stage3_layout, stage3_state_bytes, state_bytes)
from hybrid.plan.moe import moe_layers_of, split_expert_shapes
from hybrid.plan.pipeline_stages import stage_share, transfers
from hybrid.plan.setup import TrainingSetup
from hybrid.plan.zero_collectives import reduces_by_scatter, reduces_every_micro_batch
from hybrid.p2p_collectives import scratch_chunks
from hybrid.zero.buckets import STAGING_BUFFERS_BEFORE_WAIT
from hybrid.zero.inflight import closes_before, inflight_limit
from model_zoo.config import GPTConfig
from model_zoo.qkv_layout import qkv_layout


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes on one device (and its share of host memory) for one candidate layout."""

    candidate: Candidate
    state: StateBytes
    activations: ActivationBytes
    gather_buffers: int  # transient communication buffers at the peak (stage 3 units and buckets, gloo temporaries)
    forward_peak: int
    backward_peak: int
    step_peak: int
    fragmentation: int
    untracked: int = 0  # bytes the communication library holds outside tensors, beyond the tensor peak
    snapshot: int = 0  # host bytes of a background checkpoint save's copy (TrainingSetup.async_save)
    pp_rank: int = 0  # the pipeline rank these figures are for (its busiest, for a whole pipeline layout)
    held_activations: int = 0  # activation bytes held at the schedule's worst moment (pipeline_stages)
    in_flight: int = 1  # micro-batch chunks whose activations are held then
    posted_receives: int = 0  # pipeline receive buffers posted ahead of their use (DeviceProfile.receives_ahead)
    next_forward: int = 0  # stage 3: bytes of the next forward's first units, gathered between steps
    # MoE: what the peak adds when every MoE layer's routing is the dropless worst case instead of balanced
    # (hybrid.plan.moe.received_rows), held for as many layers and micro-batches as the schedule holds
    routed_worst: int = 0

    @property
    def worst_total(self) -> int:
        """:attr:`total` under the dropless worst-case routing: ``routed_worst`` more (no allowance on it)."""
        return self.total + self.routed_worst

    @property
    def weights(self) -> int:
        """The weights held between steps, stage 3's hpZ secondary copy included."""
        return self.state.weights + self.state.secondary_weights

    @property
    def grads(self) -> int:
        return self.state.grads

    @property
    def optimizer(self) -> int:
        """fp32 master plus optimizer state on the device."""
        return self.state.master + self.state.optimizer_states

    @property
    def comm_buffers(self) -> int:
        """Stage-2 staging buckets, plus at the peak stage-3 units and buckets and the library's own copies."""
        return self.state.grad_buckets + self.gather_buffers + self.untracked

    @property
    def persistent(self) -> int:
        """Bytes held between steps: the state, and under stage 3 the next forward's first units (which the
        peaks count where they are used)."""
        return self.state.device_total + self.next_forward

    @property
    def peak(self) -> int:
        """Most bytes live at once, without the fragmentation allowance."""
        return max(self.forward_peak, self.backward_peak, self.step_peak)

    @property
    def resident_peak(self) -> int:
        """The peak including the communication library's private buffers (what a process's RSS shows)."""
        return self.peak + self.untracked

    @property
    def total(self) -> int:
        """The resident peak plus the fragmentation allowance: what must fit in device memory."""
        return self.resident_peak + self.fragmentation

    @property
    def host(self) -> int:
        """Host bytes of one rank: offloaded state, and a background checkpoint save's copy of its state."""
        return self.state.host_total + self.snapshot

    @property
    def transient(self) -> int:
        """What the peak adds to the state besides communication buffers: activations, workspaces (stage 3's
        units gathered between steps are not among them: at the peak they are gathered units, or gone)."""
        return self.peak - self.state.device_total - self.gather_buffers


@dataclasses.dataclass(frozen=True)
class GradientFlow:
    """ZeRO-3 bytes beyond the partition during backward: gathered units, gradient staging, autograd's gradient and
    buckets on the wire, at the worst moment and at the final flush, each with the reduce-scatter inputs then in
    flight (the copies gloo keeps). ``layers``: the gradients of the units already done, in staging buffers
    (the open bucket's and the persistent pool's) and on the wire, as each transformer layer's backward
    begins, from the last layer to the first."""

    worst: int
    worst_on_wire: int
    final: int
    final_on_wire: int
    layers: Tuple[int, ...] = ()

    def scaled(self, element_bytes: int) -> "GradientFlow":
        return GradientFlow(element_bytes * self.worst, element_bytes * self.worst_on_wire,
                            element_bytes * self.final, element_bytes * self.final_on_wire,
                            tuple(element_bytes * v for v in self.layers))


def stage3_gradient_flow(order, persistent: int, bucket_size: int, dp: int, prefetch: int, live: int,
                         pinned: int = 0, p2p: bool = False, direct: bool = False,
                         layer_starts: Sequence[int] = (), copied: Sequence[bool] = ()) -> GradientFlow:
    """Replay a ZeRO-3 backward over unit sizes (elements; ``order``: gathered units in backward order).

    While a unit's gradient is staged (:class:`hybrid.zero.stage3_grads.Stage3GradReducer`) a rank holds
    the unit gathered with the next ones prefetched (:class:`hybrid.zero.param_gather.ParamGatherer`), the
    open bucket's staging buffers, the unit's staging buffer and autograd's gradient (one tensor when the unit
    takes the gradient as its buffer: ``copied[k]`` False; :meth:`~hybrid.plan.model_memory.Stage3Layout.
    backward_copied`; every unit copies when ``copied`` is empty), and the buckets on the
    wire (input, and reduced output unless it lands in the partition itself). A ready unit is released, and
    joins the open bucket after launching it if it would take it past ``bucket_size``
    (:func:`hybrid.zero.inflight.closes_before`); launching lands the oldest buckets until the new one fits
    :func:`hybrid.zero.inflight.inflight_limit`. A bucket goes to the communicator as its units' staging
    buffers (no concatenated copy). The units prefetched behind a ready unit stay gathered while it launches.
    The persistent pool is reduced last, at the end of backward.

    ``pinned``: elements held until the last unit of ``order`` is done (a tied head's unit, gathered again
    for the head's backward, and its weight gradient waiting in autograd for the embedding's contribution).
    ``p2p``: each reduce-scatter in flight holds the point-to-point scratch tensors of ``[numel / dp]``
    elements (:func:`hybrid.p2p_collectives.scratch_chunks`). ``direct``: every bucket is
    reduced straight into the gradient partition (the first micro-step of a step with one), so none holds a
    reduced output of its own. ``layer_starts``: positions in ``order`` where the transformer layers' backwards
    begin (:meth:`hybrid.plan.model_memory.Stage3Layout.backward_layer_starts`); for each, ``layers`` has the
    open bucket's staging buffers and the buckets on the wire then, plus the persistent pool's staging buffer,
    which the first gradient of a small parameter allocates (the final norm's, before any layer's) and which
    joins a bucket only at the end of backward.
    """
    limit = inflight_limit(bucket_size)
    flights, open_units = [], []
    worst, worst_wire = 0, 0

    def note(held: int) -> None:
        nonlocal worst, worst_wire
        if held > worst:
            worst, worst_wire = held, sum(flights)

    extras = []  # per bucket in flight, its [numel / dp] tensors beyond the input: output, p2p scratch

    def wire() -> int:
        return sum(flights) + sum(e * (f // dp) for f, e in zip(flights, extras))

    def launch(beside: int) -> int:
        """Launch the open bucket beside ``beside`` other elements held; the elements held at that moment."""
        new = sum(open_units)
        while flights and sum(flights) + new > limit:
            flights.pop(0)
            extras.pop(0)
        extra = (0 if direct else 1) + (scratch_chunks(dp, len(open_units)) if p2p else 0)
        held = beside + wire() + new + extra * (new // dp)
        note(held)
        flights.append(new)
        extras.append(extra)
        open_units.clear()
        return held

    def ready(x: int, ahead: int) -> None:
        if closes_before(sum(open_units), x, bucket_size):
            launch(ahead + x)  # the unit's staging buffer waits beside the launch
        open_units.append(x)
        if sum(open_units) >= bucket_size:
            launch(ahead)

    layers, starts = [], set(layer_starts)
    for k, x in enumerate(order):
        if k in starts:
            layers.append(persistent + sum(open_units) + wire())
        gathered = min(live, x + fitting_prefix(order[k + 1:], prefetch))
        held = pinned if k < len(order) - 1 else 0
        note(held + gathered + sum(open_units) + (2 if not copied or copied[k] else 1) * x + wire())
        ready(x, held + gathered - x)
    final, final_wire = 0, 0
    if persistent:
        ready(persistent, 0)
    if open_units:
        while flights and sum(flights) + sum(open_units) > limit:
            flights.pop(0)
            extras.pop(0)
        final_wire = sum(flights) + sum(open_units)
        final = launch(0)
    return GradientFlow(worst, worst_wire, final, final_wire, tuple(layers))


@dataclasses.dataclass(frozen=True)
class FlatGradientFlow:
    """What the reductions of whole parameters (stages 0-2) hold during backward, from
    :func:`flat_gradient_flow`. ``layers``: per transformer layer, from the last to the first, the bytes the
    reductions in flight add to the layer's moment, which counts the gradients of its largest module alone
    (its most fresh gradients with the reductions then in flight, less those); ``final``: the segments
    (elements each) still in flight when backward returns."""

    layers: Tuple[int, ...]
    final: Tuple[int, ...]


def flat_gradient_flow(layout: FlatLayout, pool: Optional[int], held: Callable[[Sequence[int]], int]
                       ) -> FlatGradientFlow:
    """Replay one backward of the gradient reducer of whole parameters (:mod:`hybrid.zero.buckets`) over
    ``layout.arrivals``: the modules in the order backward reaches them, each producing its parameters'
    gradients together, and the segments those complete.

    A module's gradients are fresh tensors (``element_bytes * numel`` each) beside the reductions launched
    before them. Then each parameter's post-accumulate hook runs: its fresh tensor is gone once the hook
    launches anything (stage 1's autograd has added it into the flat gradient buffer and freed it before the
    hook; stage 2's hook copies it into its segment's staging buffer, part of the state, and drops it), while
    the module's later parameters' are still there. The hook marks the parameter's segment and launches, in
    :attr:`FlatLayout.launches` order, every segment that is complete. ``pool``: stage 2's staging buffers
    (``STAGING_BUFFERS_BEFORE_WAIT``): a segment takes one at its first gradient, a free one or a new one
    while fewer are allocated or none is in flight, else the oldest reduction in flight is waited on and its
    buffer reused; None: buckets are views of the flat buffer (stages 0-1, ``zero.reduce_once``), and nothing
    is waited on before the step. ``held``: the bytes the reductions of some segments (elements each) hold
    while in flight. The segments no gradient completed launch when backward returns.
    """
    sizes = [size for _, size in layout.launches]
    pending = [0] * len(sizes)  # gradients each segment still waits for
    for _, params in layout.arrivals:
        for _, segment in params:
            pending[segment] += 1
    flights: List[int] = []  # segments in flight, oldest first
    staged, cursor, free, allocated = set(), 0, 0, 0
    worst = {}  # layer -> (most bytes of fresh gradients with the reductions in flight, its largest module's)

    def wire() -> int:
        return held([sizes[k] for k in flights])

    def acquire() -> None:
        nonlocal free, allocated
        while not free:
            if allocated < pool or not flights:
                allocated += 1
                return
            flights.pop(0)  # the oldest reduction lands, and its staging buffer is free again
            free += 1
        free -= 1

    def launch() -> None:
        nonlocal cursor
        while cursor < len(sizes) and pending[cursor] <= 0:
            if pool is not None and cursor not in staged:
                acquire()
            staged.discard(cursor)
            flights.append(cursor)
            cursor += 1

    for layer, params in layout.arrivals:
        fresh = layout.element_bytes * sum(numel for numel, _ in params)
        most = fresh + wire()
        for numel, segment in params:  # the hooks, one parameter at a time
            fresh -= layout.element_bytes * numel
            if pool is not None and segment not in staged:
                acquire()
                staged.add(segment)
            pending[segment] -= 1
            launch()
            most = max(most, fresh + wire())
        if layer >= 0:
            moment, largest = worst.get(layer, (0, 0))
            worst[layer] = (max(moment, most), max(largest, layout.element_bytes * sum(n for n, _ in params)))
    pending[:] = [0] * len(sizes)
    launch()
    return FlatGradientFlow(tuple(moment - largest for moment, largest in worst.values()),
                            tuple(sizes[k] for k in flights))


def largest_layer_weight(config: GPTConfig) -> int:
    """Elements of the largest weight matrix of one layer at TP=1."""
    h = config.hidden_size
    return max(qkv_layout(config).out_features * h, config.attention_width * h,
               config.mlp_input_size * h)


def zero_layout(config: GPTConfig, candidate: Candidate, setup: TrainingSetup = TrainingSetup(),
                pp_rank: int = 0) -> Union[FlatLayout, Stage3Layout]:
    """How the candidate's ZeRO optimizer lays one rank's parameters out (pipeline rank ``pp_rank``'s, with a
    pipeline): in units when its stage partitions the parameters, else in flat buffers. An MoE model's routed
    experts are left out: :func:`expert_layout` lays them out over ``edp``."""
    if candidate.traits.parameters:
        problem = moe_stage_problem(config, candidate.zero_stage)
        if problem:
            raise ValueError(problem)
        return stage3_layout(config, candidate.tp, candidate.dp, candidate.precision,
                             setup.stage3_persistence_threshold, setup.weight_decay)
    split = candidate.stage_split(config) if candidate.pp > 1 else None
    return _flat_layouts(json.dumps(config.to_dict(), sort_keys=True), candidate.tp, candidate.dp,
                         candidate.parallel.ep, candidate.precision, setup.bucket_size, setup.weight_decay, split,
                         pp_rank)[0]


@functools.lru_cache(maxsize=256)
def _flat_layouts(config_json: str, tp: int, dp: int, ep: int, precision: str, bucket_size: int,
                  weight_decay: bool, split, pp_rank: int) -> Tuple[FlatLayout, Optional[FlatLayout]]:
    """The dense parameters' flat layout over ``dp`` and the routed experts' over ``edp = dp / ep`` (None for a
    dense model), worked out once per model and layout: the candidates of a plan share them."""
    config = GPTConfig.from_dict(json.loads(config_json))
    dense, experts = split_expert_shapes(shard_shapes(config, tp, split, pp_rank), config, ep)
    tied = split is not None and split.holds_head(pp_rank)
    return (flat_layout(dense, dp, precision, bucket_size, weight_decay, tied_head=tied),
            flat_layout(experts, dp // ep, precision, bucket_size, weight_decay) if experts else None)


def moe_stage_problem(config: GPTConfig, stage: int) -> Optional[str]:
    """Why the planner cannot plan ``config`` at ZeRO ``stage`` (None when it can): stage 3's units of an MoE
    model's experts are not modelled."""
    if config.is_moe and stage_traits(stage).parameters:
        return (f"ZeRO stage {int(stage)} of an MoE model is not planned (its experts' units over edp are not "
                f"modelled); plan stages 0-2")
    return None


def expert_layout(config: GPTConfig, candidate: Candidate, setup: TrainingSetup = TrainingSetup(),
                  pp_rank: int = 0) -> Optional[FlatLayout]:
    """The flat buffers of the routed experts one rank holds (ep rank 0's: every ep rank holds as many), over
    the ``edp = dp / ep`` ranks that hold the same experts; None for a dense model."""
    if not config.is_moe:
        return None
    split = candidate.stage_split(config) if candidate.pp > 1 else None
    return _flat_layouts(json.dumps(config.to_dict(), sort_keys=True), candidate.tp, candidate.dp,
                         candidate.parallel.ep, candidate.precision, setup.bucket_size, setup.weight_decay, split,
                         pp_rank)[1]


def add_states(a: StateBytes, b: StateBytes) -> StateBytes:
    """Two groups' state bytes (dense and expert) together, field by field."""
    return StateBytes(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(StateBytes)})


def _model_state(config: GPTConfig, candidate: Candidate, setup: TrainingSetup, pp_rank: int = 0,
                 micro_batches: Optional[int] = None):
    """``(state, stage-3 bytes gathered at the forward peak, gathered during backward, the stage-3 gradient flow
    (:class:`GradientFlow`, bytes; None with whole parameters), the step's gather temporary, then with whole
    parameters the library's copies of the reductions in flight at the end of backward and the tensors they
    hold then: receive buffers, or the quantized reductions' packed buffers; last, per transformer layer from
    the last, the communication bytes beside the layer's moment in backward: :attr:`GradientFlow.layers`, or
    :attr:`FlatGradientFlow.layers`)``. An MoE model's expert state (:func:`expert_layout`, partitioned over
    ``edp``) is added to the state; its reductions in flight are not replayed."""
    layout = zero_layout(config, candidate, setup, pp_rank)
    if candidate.traits.parameters:
        return _unit_state(config, candidate, setup, layout, micro_batches)
    out = _flat_state(candidate, setup, layout)
    experts = expert_layout(config, candidate, setup, pp_rank)
    if experts is None:
        return out
    expert_state = state_bytes(experts, candidate.zero_stage, precision=candidate.precision,
                               offload=candidate.offload, optimizer=setup.optimizer, momentum=setup.momentum,
                               compiled_adam=setup.compiled_adam, host_is_device=setup.profile.host_is_device,
                               reduce_once=setup.whole_gradients, quantization_block=setup.quantization_block)
    return (add_states(out[0], expert_state),) + tuple(out[1:])


def _unit_state(config: GPTConfig, candidate: Candidate, setup: TrainingSetup, units: Stage3Layout,
                micro_batches: Optional[int]):
    """:func:`_model_state` when the parameters are partitioned in units, gathered where they are used
    (``micro_batches`` per step, None: unknown, planned as several)."""
    p = DTYPE_BYTES[candidate.precision]
    state = stage3_state_bytes(units, offload=candidate.offload, optimizer=setup.optimizer,
                               momentum=setup.momentum, compiled_adam=setup.compiled_adam,
                               host_is_device=setup.profile.host_is_device, hpz=setup.hpz_partition_size)
    head = units.head_unit
    ahead = min(setup.stage3_prefetch, sum(units.units))
    # Units forward keeps gathered into backward (the keep window: the prefetch window, or
    # zero.max_reuse_distance when larger), beside the head's unit. Kept and prefetched units share one window:
    # what is gathered ahead of its use is the larger of the two, never their sum.
    held = sum(units.units[i] for i in units.held_into_backward(setup.stage3_keep) if i != units.head_index)
    # Forward, at the loss: the head's unit, plus what was prefetched behind the last module or is kept.
    forward = p * (head + max(min(ahead, units.largest_unit), held))
    # Backward starts with the head's unit and the units prefetched ahead of the layers, within the live
    # limit; later each unit is gathered again with the next ones prefetched behind it: whole units while they
    # fit the prefetch window (fitting_prefix), at most. A tied head's unit stays gathered through
    # backward, beside the layer's; full recomputation replays a whole layer, gathering all of its units, which
    # stay gathered until their gradients arrive.
    live = setup.stage3_live_parameters
    order = units.backward_order(config.tie_embeddings)
    prefetched = max((fitting_prefix(order[k + 1:], setup.stage3_prefetch) for k in range(len(order))), default=0)
    layer = units.layer_units if candidate.recompute == "full" else units.largest_unit
    first = head + layer if config.tie_embeddings else max(head, layer)
    backward = p * min(live, sum(units.units), first + max(prefetched, held))
    # A tied head's unit stays gathered through backward beside its waiting gradient (both about the unit's size).
    pinned = 2 * head if config.tie_embeddings else 0
    # The reductions land in the gradient partition itself on a step's only micro-step (consecutive units on the
    # partition's device: the CPU profile, or no offload); later micro-steps add through a reduced output.
    direct = micro_batches == 1 and (candidate.offload == "none" or setup.profile.host_is_device)
    flow = stage3_gradient_flow(order, units.persistent, setup.bucket_size, units.dp, setup.stage3_prefetch, live,
                                pinned, setup.profile.p2p_reduce_scatter, direct,
                                units.backward_layer_starts(config.tie_embeddings),
                                units.backward_copied(config.tie_embeddings))
    flow = flow.scaled(p)
    return state, forward, backward, flow, 0, 0, 0, flow.layers


def _next_forward(config: GPTConfig, candidate: Candidate, setup: TrainingSetup) -> int:
    """:attr:`MemoryEstimate.next_forward`: stage 3's gathers started at the end of a step (0 for stages 0-2)."""
    if not candidate.traits.parameters:
        return 0
    units = zero_layout(config, candidate, setup)
    return units.element_bytes * units.next_forward(setup.stage3_prefetch, setup.stage3_live_parameters)


def _flat_state(candidate: Candidate, setup: TrainingSetup, flat: FlatLayout):
    """:func:`_model_state` when every rank holds the parameters whole, in flat buffers."""
    traits = candidate.traits
    state = state_bytes(flat, candidate.zero_stage, precision=candidate.precision, offload=candidate.offload,
                        optimizer=setup.optimizer, momentum=setup.momentum, compiled_adam=setup.compiled_adam,
                        host_is_device=setup.profile.host_is_device, reduce_once=setup.whole_gradients,
                        quantization_block=setup.quantization_block)
    gather_temp = 0
    if setup.profile.gather_copies_output and traits.gathers_after_step:
        gather_temp = flat.largest_segment * flat.element_bytes  # gloo lands each all-gather in a temporary
    scatter = reduces_by_scatter(traits)
    n, copies = flat.dp, setup.profile.gather_copies_output
    grads, weights = setup.gradient_quant, setup.weight_quant

    def held(inputs: Sequence[int]) -> int:
        """Tensor bytes the reductions of ``inputs`` (elements each) hold in flight (the module docstring)."""
        if grads is not None:  # packed buffers instead of the receive buffers or gloo's copies
            return reduction_buffers(grads, inputs, n, all_reduce=not scatter)
        return flat.element_bytes * reduce_scatters_in_flight(inputs if scatter else [], n, setup.profile)[1]

    # Reduce-scatters in flight during backward and at its end: reducing once per step launches every bucket and
    # waits in the step; reducing every micro-batch waits whenever it needs a staging buffer beyond its pool.
    pool = STAGING_BUFFERS_BEFORE_WAIT if reduces_every_micro_batch(traits, setup.whole_gradients) else None
    flow = flat_gradient_flow(flat, pool, held)
    launched = list(flow.final)
    in_flight = flat.element_bytes * reduce_scatters_in_flight(launched if scatter else [], n, setup.profile)[0]
    packed = held(launched)
    if grads is not None:
        in_flight = 0
        if not scatter:  # stage 0 waits on a bucket by gathering its summed chunks, the others still in flight
            largest = flat.largest_segment
            gather_temp = packed + FP32 * n * chunk(largest, n) + gather_buffers(grads, [largest], n, largest, copies)
    if weights is not None and traits.gathers_after_step:
        segments = [size for _, sizes in flat.groups for size in sizes]
        gather_temp = gather_buffers(weights, segments, n, flat.largest_segment, copies)
    return state, 0, 0, None, gather_temp, in_flight, packed, flow.layers


def reduce_scatters_in_flight(inputs: Sequence[int], n: int, profile: DeviceProfile) -> Tuple[int, int]:
    """``(library copies, tensors)``, in elements, that reduce-scatters of ``inputs`` (elements each) over ``n``
    ranks hold while in flight, whole parameters (stages 1-2). As hybrid's point-to-point messages
    (``profile.p2p_reduce_scatter``, gloo) each sends from its input and receives into
    :func:`hybrid.p2p_collectives.scratch_chunks` tensors of its output's size, the ``n - 1`` chunks of
    :class:`hybrid.p2p_collectives.DirectReduceScatter` (``(n-1)/n`` of the input); a backend that copies its
    input (``profile.reduce_scatter_copies_input``) holds the whole input outside tensors; NCCL holds neither."""
    if profile.p2p_reduce_scatter:
        return 0, sum(scratch_chunks(n) * chunk(numel, n) for numel in inputs)
    return (sum(inputs) if profile.reduce_scatter_copies_input else 0), 0


def estimate_memory(config: GPTConfig, candidate: Candidate, setup: TrainingSetup = TrainingSetup(),
                    micro_batches: Optional[int] = None) -> MemoryEstimate:
    """Predict the memory of one device for ``config`` trained as ``candidate``: with a pipeline, that of its
    busiest pipeline rank (:func:`estimate_stages`; ``micro_batches`` per step, which the schedule's activations
    in flight depend on, must then be given). Stage 3 holds a little less with one micro-batch per step
    (``micro_batches=1``: its reductions land in the partition itself)."""
    if candidate.pp > 1:
        return max(estimate_stages(config, candidate, setup, micro_batches), key=lambda m: m.total)
    act = _activations(config, candidate, setup)
    return _estimate(config, candidate, setup, act, act.total, first=True, last=True, micro_batches=micro_batches)


def estimate_stages(config: GPTConfig, candidate: Candidate, setup: TrainingSetup = TrainingSetup(),
                    micro_batches: Optional[int] = None) -> List[MemoryEstimate]:
    """The memory of every pipeline rank of ``candidate`` (:mod:`hybrid.plan.pipeline_stages`), in rank order,
    for steps of ``micro_batches`` micro-batches."""
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"a pipeline's memory depends on the micro-batches per step: give micro_batches >= 1, "
                         f"got {micro_batches!r}")
    act = _activations(config, candidate, setup)
    out = []
    for rank in range(candidate.pp):
        share = stage_share(config, candidate, act, micro_batches, rank)
        receives, nbytes = transfers(config, candidate, micro_batches, rank)
        out.append(_estimate(config, candidate, setup, share.activations, share.held, first=share.first,
                             last=share.last, pp_rank=rank, in_flight=share.in_flight,
                             posted_receives=min(setup.profile.receives_ahead, receives) * nbytes))
    return out


def _activations(config: GPTConfig, candidate: Candidate, setup: TrainingSetup) -> ActivationBytes:
    """What one micro-batch of ``candidate`` saves through the whole model on one TP rank."""
    return activation_bytes(config, candidate.micro_batch, tp=candidate.tp,
                            sequence_parallel=candidate.sequence_parallel, recompute=candidate.recompute,
                            precision=candidate.precision, profile=setup.profile, ep=candidate.parallel.ep)


def _estimate(config: GPTConfig, candidate: Candidate, setup: TrainingSetup, act: ActivationBytes, held: int, *,
              first: bool, last: bool, pp_rank: int = 0, in_flight: int = 1,
              micro_batches: Optional[int] = None, posted_receives: int = 0) -> MemoryEstimate:
    """The peaks of one rank whose micro-batch saves ``act`` and that holds ``held`` bytes of activations at the
    worst moment of its schedule (``act.total`` without a pipeline); ``first``/``last``: it holds the
    embedding / the head and loss; ``posted_receives``: the pipeline receive buffers it has posted ahead of
    their use, there through forward and backward."""
    state, gathered, gathered_backward, staging3, gather_temp, in_flight_bytes, packed, layer_flight = _model_state(
        config, candidate, setup, pp_rank, micro_batches)
    p = DTYPE_BYTES[candidate.precision]
    base = state.device_total
    n = config.seq_length * candidate.micro_batch
    h, t = config.hidden_size, candidate.tp
    v_local = config.padded_vocab_size(t) // t
    logits, fp32_nv, loss_saved = p * n * v_local, 4 * n * v_local, 4 * n * v_local + 9 * n
    head_grad = p * v_local * h
    if last:
        before_loss = held - loss_saved
        # End of forward: the loss shifts the logits and exponentiates them in fp32, in the logits' own memory
        # (the model gives them up) or, for low-precision logits, in their fp32 copy.
        forward = base + gathered + before_loss + logits + (fp32_nv if p != 4 else 0)
        # Start of backward: the fp32 loss gradient (and its cast) beside everything saved.
        cast = logits if p != 4 else 0
        backward = max(base + held + fp32_nv + cast,
                       # the head's matmuls: the logits gradient, the weight gradient and the hidden gradient
                       base + before_loss + logits + head_grad + p * n * h)
        final_norm = act.head - loss_saved
    else:  # a pipeline rank without the head: its forward ends with its output, kept for its backward
        before_loss, final_norm = held, 0
        forward = backward = base + gathered + held
    # A layer's backward: its largest weight gradient and input gradient in flight, the residual gradient
    # (received from the next pipeline part, in a pipeline), a recomputed layer's activations, and a tied head's
    # gradient waiting for the embedding's (in one process; pipeline copies are separate weights). The rebuilt
    # layer's first norm saves the layer's input, which is the tensor the recomputation kept: already among
    # the saved activations (``per_layer``), so it is not counted twice.
    tied = head_grad if config.tie_embeddings and first and last else 0
    rebuilt = act.layer_full - act.per_layer if candidate.recompute == "full" else 0
    weight_grad = p * max(largest_layer_weight(config) // t, 1)
    layer = before_loss - final_norm + rebuilt + tied + weight_grad + p * n * config.ffn_size // t + p * n * h
    # Each layer from the last down: the saved activations of the layers backward has passed are gone, and the
    # gradients of the layers passed are on the wire (stages 1-2: the receive buffers of the reductions in flight
    # beside the layer's worst gradient, flat_gradient_flow) or, under stage 3, also wait in staging buffers (the
    # replay's figure as the layer begins). Those grow by a layer's gradients while the activations shrink by
    # what a layer saves, so with large buckets (and for stage 1, which waits on none before the step) the first
    # layer can be the worst.
    staged = layer_flight or (0,)
    # (bytes, the communication buffers among them) at the worst moment so far
    backward, backward_comm = max([(backward, 0)] + [(base + layer - i * act.per_layer + gradients, gradients)
                                                     for i, gradients in enumerate(staged)])
    backward, backward_comm = backward + gathered_backward, backward_comm + gathered_backward
    forward, backward = forward + posted_receives, backward + posted_receives
    # Reduce-scatters on point-to-point messages keep no library copy (the module docstring), at every stage.
    gloo_copies = setup.profile.reduce_scatter_copies_input and not setup.profile.p2p_reduce_scatter
    # (tensor bytes, library copies beyond them) at the moments where reduce-scatters are in flight
    moments = [(base + act.embedding + staging3.final, staging3.final_on_wire)] if staging3 else []
    if staging3:
        # Mid-backward: one unit gathered with the next ones prefetched, its gradient being staged, the last
        # buckets on the wire; the activations of the layers backward already passed are gone.
        mid = base + act.embedding + staging3.worst
        moments.append((mid, staging3.worst_on_wire))
        for tensors, _ in moments:
            if tensors > backward:
                backward, backward_comm = tensors, tensors - base - act.embedding
    elif in_flight_bytes or packed:
        # Whole parameters: the end of backward, with the tensors its reductions in flight hold (point-to-point
        # receive buffers, or the quantized reductions' packed buffers).
        end = base + act.embedding + packed + posted_receives
        moments.append((end, in_flight_bytes))
        if end > backward:
            backward, backward_comm = end, packed
    step = base + state.step_workspace + gather_temp
    # Stage-3 buffers (gathered units, in-flight gradient buckets) at whichever moment is the peak.
    peak_comm = max((forward, gathered), (backward, backward_comm), (step, gather_temp))[1]
    transient = max(forward, backward, step) - base
    untracked = 0
    if gloo_copies:
        # The library's private copies of the in-flight reduce-scatters, beyond the tensor peak.
        peak = max(forward, backward, step)
        untracked = max([0] + [tensors + copies - peak for tensors, copies in moments])
    return MemoryEstimate(candidate, state, act, peak_comm, forward, backward, step,
                          int(setup.fragmentation * transient), untracked,
                          _snapshot(config, candidate, setup, pp_rank), pp_rank, held, in_flight, posted_receives,
                          _next_forward(config, candidate, setup), _routed_worst(config, candidate, act, in_flight))


def _routed_worst(config: GPTConfig, candidate: Candidate, act: ActivationBytes, in_flight: int) -> int:
    """:attr:`MemoryEstimate.routed_worst`: the worst case's extra bytes per MoE layer, for each MoE layer of the
    rank and micro-batch in flight whose activations are saved, or the one layer full recomputation
    rebuilds."""
    if not act.routed_worst_extra:
        return 0
    if candidate.recompute == "full":
        return act.routed_worst_extra
    return act.routed_worst_extra * -(-moe_layers_of(config) // candidate.pp) * in_flight


def _snapshot(config: GPTConfig, candidate: Candidate, setup: TrainingSetup, pp_rank: int = 0) -> int:
    """A background checkpoint save's host copy on DP rank 0 (0 when saves are synchronous)."""
    if not setup.async_save:
        return 0
    layout = zero_layout(config, candidate, setup, pp_rank)
    if isinstance(layout, Stage3Layout):
        model, partition = sum(layout.units) + layout.persistent, layout.partition_numel
    else:
        model, partition = layout.unpadded, layout.numel // partition_count(candidate.zero_stage, layout.dp)
    chunk = setup.async_save_chunk_mb << 20 if setup.async_save_chunk_mb is not None else None
    return snapshot_bytes(model, layout.element_bytes, partition, optimizer=setup.optimizer,
                          momentum=setup.momentum, chunk_bytes=chunk)
