"""ZeRO-3 parameter gathering: make a unit's parameters whole while they are used, and only then.

Between uses every partitioned parameter's ``.data`` is an empty tensor of its
dtype; the values live only in the DP ranks' partitions (see
:mod:`hybrid.zero.stage3_layout`). A unit is *gathered* by one all-gather of
its chunks over ``dp`` into a fresh ``[unit.numel]`` buffer, and each of its
parameters' ``.data`` becomes a view into that buffer.

When a unit is gathered and released:

* **forward**: a forward pre-hook on the owning module gathers its unit and
  the post-hook releases it. A read of a partitioned parameter as a module
  attribute outside its module (a tied embedding's ``weight`` read by the LM
  head, a position table read by its parent) is caught by the module's
  ``_parameters`` dict (:mod:`hybrid.zero.param_reads`, which
  ``nn.Module.__getattr__`` reads from) while a forward runs: the unit is
  gathered on demand and held until the innermost running module returns.
  The watching dicts are there only while a forward runs and only on the
  modules holding a parameter of a unit no running module holds (a read
  anywhere else would change nothing): between forwards, and inside a
  unit's own module, modules keep ordinary dicts.
  Only attribute reads are watched, not every op (a ``TorchFunctionMode``
  would run Python on each of the forward's ops): a parameter kept in a
  plain list or closure and used outside its module is not gathered, and
  the op fails on its empty ``.data``.
* **backward**: tensors autograd saves that live in a gathered buffer (the
  weight itself, or views of it) are replaced by a small reference
  (``saved_tensors_hooks``); unpacking it in backward gathers the unit again.
  The unit is released once all of its parameters have received their
  gradient (or when backward ends).
* **prefetch**: the sequence of units each phase fetched in the first step is
  recorded; later, after each fetch, the next units of that sequence are
  gathered asynchronously while the current module computes.
* **keep**: from the second step on, forward does not release a unit that
  the recorded sequence (the rest of forward, then backward's when autograd
  records) uses again within the next :func:`keep_numel` elements: the
  prefetch window (``prefetch_numel``, whose units the prefetcher would
  gather again before they are used) or ``reuse_numel``
  (``zero.max_reuse_distance``) when larger. A tied embedding stays gathered
  from the lookup to the LM head when the model fits the window, and the last
  units of forward, which backward starts with, stay gathered into backward
  instead of being released and gathered again. Kept units count against the
  prefetch window like prefetched ones: the units gathered ahead of the
  cursor and not yet used, kept, landed or still in flight, hold at most
  ``keep_numel`` elements, so keeping adds no memory to what prefetching
  would hold. A kept unit can still be evicted when a gather needs room.
* **across the step**: once an update has written the partitions, the next
  forward's first units (the prefetch window of its recorded sequence) start
  moving (:meth:`ParamGatherer.prefetch_next_forward`), so between steps at
  most ``prefetch_numel`` elements are gathered or in flight.
* **hpZ** (``secondary``, :mod:`hybrid.zero.secondary_partition`): every
  gather over ``dp`` leaves this rank's ``1/l`` slice of the unit in the
  secondary partition; a backward gather of a unit whose slice is fresh
  all-gathers the slices over ``dp_node`` instead (inside the node,
  unquantized, the same values). Without it every gather is over ``dp``.

Buffers are never recycled by hand: a released buffer may still be referenced
by a view autograd holds for a moment, so reusing it would corrupt that view.
The allocator recycles the memory once the last view is gone.

``max_live_numel`` bounds the elements of all gathered (and in-flight)
buffers: before a gather, units no module is using are released until the
new one fits; prefetching never evicts. ``peak_live_numel`` records the
largest total seen.

Every gather is announced to :class:`~hybrid.zero.order_check.OrderCheck`
first, so ranks that diverge raise :class:`GatherOrderError` instead of hanging.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch
import torch.utils.checkpoint
from torch import nn

from hybrid.comm import CollectiveError, Communicator, Handle
from hybrid.compile_marks import eager
from hybrid.compression import Quantization
from hybrid.zero.order_check import OrderCheck
from hybrid.zero.param_reads import ParameterReads
from hybrid.zero.secondary_partition import SecondaryPartition
from hybrid.zero.stage3_layout import Unit


def keep_numel(prefetch_numel: int, reuse_numel: int) -> int:
    """Elements of the recorded sequence ahead of use that gathered units may cover, kept or prefetched: a unit
    forward is done with stays gathered when it is used again within them (``prefetch_numel``:
    ``zero.prefetch_bucket_size``, ``reuse_numel``: ``zero.max_reuse_distance``)."""
    return max(prefetch_numel, reuse_numel)


@dataclasses.dataclass(frozen=True)
class _SavedView:
    """What autograd keeps instead of a tensor that lives in a gathered buffer."""

    unit: int
    offset: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _OuterSaved:
    """What a nested gatherer keeps for a tensor its outer gatherer packed (:attr:`ParamGatherer.outer`)."""

    saved: object


class ParamGatherer:
    """Gathers, prefetches and releases the units of one model (see the module docstring).

    ``chunks[u]`` is this rank's ``[unit.chunk_numel]`` slice of unit ``u`` (a
    view of the partition, updated in place by the optimizer); gathers run
    over the ``dp`` group, or with ``secondary`` (hpZ) backward's over
    ``dp_node`` where the unit's secondary slice is fresh.
    """

    def __init__(self, units: List[Unit], chunks: List[torch.Tensor], comm: Communicator, order: OrderCheck,
                 max_live_numel: int, prefetch_numel: int, quant: Optional[Quantization] = None,
                 secondary: Optional[SecondaryPartition] = None, reuse_numel: int = 0,
                 outer: Optional["ParamGatherer"] = None):
        self.units = units
        self.chunks = chunks
        self.comm = comm
        self.quant = quant  # zero.quantized_weights: gathers travel in this format
        self.secondary = secondary  # zero.hpz_partition_size > 1: backward re-gathers inside the node
        # outer: the gatherer of the rest of the same model, whose forward encloses this one's (the expert
        # split's dense half); autograd calls only the innermost saved-tensor hooks, so this one's pass what
        # they do not own on to it
        self.outer = outer
        self.order = order
        self.max_live_numel = max_live_numel
        self.prefetch_numel = prefetch_numel
        self.keep_numel = keep_numel(prefetch_numel, reuse_numel)
        self.unit_of_param: Dict[int, int] = {id(p): u.index for u in units if not u.persistent for p in u.params}
        self.live: Dict[int, torch.Tensor] = {}  # unit -> gathered buffer (persistent units included)
        self.inflight: Dict[int, Tuple[Handle, torch.Tensor, bool]] = {}  # unit -> (handle, buffer, over dp)
        self.in_use: Dict[int, int] = {}  # unit -> frames holding it
        self._storage: Dict[int, int] = {}  # data_ptr of a live buffer -> unit
        self.live_numel = 0
        self.peak_live_numel = 0
        self.gathered_numel_total = 0
        self.prefetch_issued = 0  # units gathered ahead of use
        self.prefetch_hits = 0  # fetches that found their unit already prefetched
        self.busy = False  # inside our own bookkeeping: parameter reads are not uses
        self.watching = False  # a forward runs: reads of released parameters gather them (hybrid.zero.param_reads)
        self._reads: Optional[ParameterReads] = None  # watch_reads()
        self._units_of_holder: Dict[int, List[int]] = {}  # id(module) -> units of the partitioned params it holds
        self._holders_of_unit: Dict[int, List[nn.Module]] = {}  # unit -> modules holding a parameter of it
        self.phase = "idle"
        self.traces: Dict[str, List[int]] = {}
        self._recording: Optional[List[int]] = None
        self._cursor = 0
        self.frames: List[List[int]] = []
        self._orphans: List[int] = []  # externally used outside any module frame
        self._ctx = []
        self._backward_follows = False  # the forward running now records a graph (autograd on)
        self._empty = {u.index: torch.empty(0, dtype=chunks[u.index].dtype, device=chunks[u.index].device)
                       for u in units}
        self._shape_of: Dict[int, Tuple[int, ...]] = {id(p): rec.shape for u in units
                                                      for rec, p in zip(u.records, u.params)}
        for u in units:
            if u.persistent:
                self._persist(u)
            else:
                self._unbind(u)

    # ---- binding ----------------------------------------------------------------------------
    def _bind(self, u: Unit, buf: torch.Tensor) -> None:
        for rec, p in zip(u.records, u.params):
            p.data = buf[rec.offset: rec.offset + rec.numel].view(rec.shape)

    def _unbind(self, u: Unit) -> None:
        for p in u.params:
            p.data = self._empty[u.index]

    def shape_for_grad(self, p: nn.Parameter) -> None:
        """Give a released parameter its shape (a one-element stride-0 stub) while autograd accumulates its gradient.

        Autograd lays out a new ``.grad`` after the parameter's shape and
        strides; a released parameter (``[0]``) would make it fail. The stub
        is never read: the reducer takes the gradient right away and calls
        :meth:`unshape`.
        """
        i = self.unit_of_param.get(id(p))
        if i is None or i in self.live:
            return
        p.data = self._empty[i].new_zeros(1).expand(self._shape_of[id(p)])

    def unshape(self, p: nn.Parameter) -> None:
        i = self.unit_of_param.get(id(p))
        if i is None or i in self.live:
            return
        p.data = self._empty[i]

    def _persist(self, u: Unit) -> None:
        """Persistent units stay gathered for good; their buffer is refreshed after every update."""
        buf = torch.empty(u.numel, dtype=self.chunks[u.index].dtype, device=self.chunks[u.index].device)
        self.comm.all_gather_into_tensor(buf, self.chunks[u.index], "dp", quant=self.quant)
        self.live[u.index] = buf
        self._bind(u, buf)

    def refresh_persistent(self, while_waiting=None) -> None:
        """All-gather every persistent unit's updated chunk into its buffer (after an optimizer step), running
        ``while_waiting()`` (if given) while the gathers travel."""
        handles = [self.comm.all_gather_into_tensor(self.live[u.index], self.chunks[u.index], "dp", async_op=True,
                                                 quant=self.quant)
                   for u in self.units if u.persistent]
        if while_waiting is not None:
            while_waiting()
        for h in handles:
            h.wait()

    # ---- gathering ----------------------------------------------------------------------------
    def _issue(self, indices: List[int], why: str, checked: bool = True) -> None:
        """Gather units ``indices`` asynchronously over ``dp`` (or the node, hpZ); ``checked``: compare the
        request with every DP rank's first (:meth:`OrderCheck.verify`), else only fold it in (``fold``)."""
        names = ", ".join(self.units[i].module_name for i in indices)
        check = self.order.verify if checked else self.order.fold
        check("gather-" + self.phase, indices, f"gather [{names}] ({why}, {self.phase})")
        for i in indices:
            u = self.units[i]
            buf = torch.empty(u.numel, dtype=self.chunks[i].dtype, device=self.chunks[i].device)
            if self._from_secondary(i):
                self.inflight[i] = (self.secondary.gather(i, buf), buf, False)
            else:
                handle = self.comm.all_gather_into_tensor(buf, self.chunks[i], "dp", async_op=True,
                                                          quant=self.quant)
                self.inflight[i] = (handle, buf, True)
            self.live_numel += u.numel
            self.gathered_numel_total += u.numel
        self.peak_live_numel = max(self.peak_live_numel, self.live_numel)

    def _from_secondary(self, i: int) -> bool:
        """hpZ: backward re-gathers a unit from the node's secondary slices when they hold the current weights.

        Only backward: forward's gathers over ``dp`` are what refresh the slices after a step. Every dp rank
        decides alike, since freshness follows the gathers (checked identical by the order check) and steps.
        """
        return self.secondary is not None and self.phase == "backward" and self.secondary.fresh(i)

    def _complete(self, i: int) -> None:
        handle, buf, over_dp = self.inflight.pop(i)
        handle.wait()
        if over_dp and self.secondary is not None:
            self.secondary.store(i, buf)
        self.live[i] = buf
        self._storage[buf.untyped_storage().data_ptr()] = i
        self._bind(self.units[i], buf)

    def ensure(self, i: int) -> torch.Tensor:
        """Make unit ``i`` gathered (waiting for its prefetch, or gathering it now); returns its buffer."""
        if i in self.live:
            return self.live[i]
        self.busy = True
        try:
            self._note_fetch(i)
            if i in self.inflight:
                self.prefetch_hits += 1
            else:
                self._make_room(self.units[i].numel, protect=i)
                self._issue([i], "demand")
            self._complete(i)
            self._prefetch()
        finally:
            self.busy = False
        return self.live[i]

    def release(self, i: int) -> None:
        """Drop unit ``i``'s gathered buffer unless it is persistent or still in use by a running module."""
        u = self.units[i]
        if u.persistent or self.in_use.get(i, 0) > 0:
            return
        if i in self.inflight:
            self._complete(i)
        buf = self.live.pop(i, None)
        if buf is None:
            return
        self._storage.pop(buf.untyped_storage().data_ptr(), None)
        self.live_numel -= u.numel
        self._unbind(u)

    def reset(self) -> None:
        """Forget every module frame and release every gathered unit.

        Called before the optimizer updates the partition: a unit still
        gathered then would hold stale weights in the next forward (and so
        would the secondary partition's slices, with hpZ).
        """
        self.frames.clear()
        self._orphans = []
        self.in_use.clear()
        self._rewatch_all()
        self.release_all()
        if self.secondary is not None:  # after release_all: landing a gather over dp stores a slice
            self.secondary.invalidate()

    def release_all(self) -> None:
        for i in list(self.inflight):
            self._complete(i)
        for i in list(self.live):
            self.release(i)

    def detach(self) -> None:
        """Release every unit, landing the gathers still in flight (those started for a next forward that will
        not run); gathers a failed peer will not complete are given up (the communicator stops tracking them)
        instead of raising, since nothing reads them any more."""
        handles = [handle for handle, _, _ in self.inflight.values()]
        try:
            self.release_all()
        except CollectiveError:  # the failed one among them too: landing took it out of ``inflight``
            self.comm.abandon(handles)
            self.inflight.clear()
            self.live.clear()
            self.live_numel = 0

    def _make_room(self, numel: int, protect: int) -> None:
        if self.live_numel + numel <= self.max_live_numel:
            return
        for i in list(self.inflight):  # finished prefetches become evictable
            if i != protect and self.in_use.get(i, 0) == 0:
                self._complete(i)
        for i in list(self.live):
            if self.live_numel + numel <= self.max_live_numel:
                return
            if i != protect and self.in_use.get(i, 0) == 0:
                self.release(i)

    # ---- prefetch -------------------------------------------------------------------------------------
    def _note_fetch(self, i: int) -> None:
        """Record the fetch in this phase's trace (first step) or advance the cursor along it."""
        if self._recording is not None:
            self._recording.append(i)
            return
        trace = self.traces.get(self.phase)
        if trace is None:
            return
        if self._cursor < len(trace) and trace[self._cursor] == i:
            self._cursor += 1
            return
        try:  # the step took a different path: resynchronise on the next occurrence, if any
            self._cursor = trace.index(i, self._cursor) + 1
        except ValueError:
            self._cursor = len(trace)

    def _window(self, sequence: List[int]) -> List[int]:
        """The distinct units at the head of ``sequence`` that fit ``keep_numel`` elements (up to the first that
        does not): the units kept rather than released."""
        out: List[int] = []
        budget = self.keep_numel
        for i in sequence:
            if i in out:
                continue
            n = self.units[i].numel
            if n > budget:
                break
            out.append(i)
            budget -= n
        return out

    def _prefetch(self, checked: bool = True) -> None:
        """Gather the next units of the recorded sequence while those ahead of the cursor (kept, landed or in
        flight) fit ``prefetch_numel`` elements, each unit counted once (``checked``: see :meth:`_issue`)."""
        trace = self.traces.get(self.phase)
        if trace is None or self.prefetch_numel <= 0:
            return
        batch, seen, budget, k = [], set(), self.prefetch_numel, self._cursor
        pending = self.live_numel
        while k < len(trace) and budget > 0:
            i = trace[k]
            k += 1
            if i in seen:
                continue
            seen.add(i)
            n = self.units[i].numel
            if i in self.live or i in self.inflight:  # kept, or gathered ahead already: it holds its share
                budget -= n
                continue
            if n > budget or pending + n > self.max_live_numel:
                break
            batch.append(i)
            budget -= n
            pending += n
        if batch:
            self._issue(batch, "prefetch", checked)
            self.prefetch_issued += len(batch)

    def prefetch_next_forward(self) -> None:
        """Start gathering the next forward's first units (its recorded sequence, within the prefetch window).

        Called once the update has written the partitions: the gathers travel
        while the step ends and the next batch is prepared, and the forward's
        first fetches find them in flight or landed instead of waiting for
        the first unit from scratch. A write to the weights before that
        forward (a load) resets the gatherer, which drops them. The request
        is folded into the order check, not compared: every rank takes the
        same units off the head of the same recorded sequence (recorded in
        the first step, whose every gather was compared), and the next
        comparison covers it -- one synchronisation of the ranks less a step.
        """
        if "forward" not in self.traces:
            return
        self.phase, self._cursor = "forward", 0
        try:
            self._prefetch(checked=False)
        finally:
            self.phase = "idle"

    # ---- phases ------------------------------------------------------------------------------------------
    def begin_phase(self, phase: str) -> None:
        self.phase = phase
        self._cursor = 0
        self._recording = [] if phase not in self.traces else None
        self._prefetch()  # the first units of the phase start moving right away

    def end_phase(self) -> None:
        if self._recording is not None:
            self.traces[self.phase] = self._recording
        self._recording = None
        self.phase = "idle"

    # ---- forward hooks ----------------------------------------------------------------------------
    def _use(self, i: int) -> None:
        """A module or op is about to use unit ``i``: gather it, or count the use of a unit kept gathered."""
        if i in self.live:
            self._note_fetch(i)  # kept (or prefetched and landed): the recorded sequence moves on past it
        else:
            self.ensure(i)

    def _done(self, i: int) -> None:
        """No running module uses unit ``i`` any more: release it, unless it is used again soon (:meth:`_ahead`)."""
        if self.phase == "forward" and i in self._window(self._ahead()):
            return
        self.release(i)

    def _ahead(self) -> List[int]:
        """Forward's recorded units still to come in this forward, then backward's when a backward follows."""
        rest = self.traces.get("forward", [])[self._cursor:]
        return rest + self.traces.get("backward", []) if self._backward_follows else rest

    @eager  # inside a compiled block: one graph break, run eagerly (model_zoo.compile)
    def module_pre(self, unit: Optional[int]) -> None:
        frame: List[int] = []
        if unit is not None:
            self._use(unit)
            self._hold(unit)
            frame.append(unit)
        self.frames.append(frame)

    @eager  # inside a compiled block: one graph break, run eagerly (model_zoo.compile)
    def module_post(self) -> None:
        if not self.frames:
            return
        for i in self.frames.pop():
            self.in_use[i] -= 1
            if self.in_use[i] == 0:
                self._rewatch_unit(i)
                self._done(i)

    def watches(self, param) -> bool:
        """Whether ``param`` is one of the partitioned parameters (:mod:`hybrid.zero.param_reads`)."""
        return id(param) in self.unit_of_param

    def listed(self, params) -> None:
        """Parameters handed out in bulk (``named_parameters``, ``state_dict``): nothing to do, a released one is
        empty by design between uses (``gathered_parameters()`` makes them whole)."""

    # ---- the read watch: only where a read would gather -------------------------------------------------
    def watch_reads(self, model: nn.Module) -> ParameterReads:
        """Watch the attribute reads of the partitioned parameters in ``model`` during each forward; the returned
        object's ``remove()`` ends it."""
        self._reads = ParameterReads(model, self)
        return self._reads

    def _hold(self, i: int) -> None:
        """A running module (or the frame of an external read) holds unit ``i``."""
        self.in_use[i] = self.in_use.get(i, 0) + 1
        if self.in_use[i] == 1:
            self._rewatch_unit(i)

    def _watch_forward(self) -> None:
        """Start of a forward: find the modules holding partitioned parameters (a fresh scan of the model, so
        modules and parameters added since are found) and watch those a read would gather for."""
        self._units_of_holder, self._holders_of_unit = {}, {}
        if self._reads is None:
            return
        for module, params in self._reads.holders():
            units = sorted({self.unit_of_param[id(p)] for p in params})
            self._units_of_holder[id(module)] = units
            for i in units:
                self._holders_of_unit.setdefault(i, []).append(module)
        self._rewatch_all()

    def _rewatch(self, module: nn.Module) -> None:
        """A watching dict on ``module`` while one of its units is held by no running module, a plain one else
        (every read there would find its unit gathered and held: :meth:`use_external` returns at once)."""
        if all(self.in_use.get(i, 0) > 0 for i in self._units_of_holder[id(module)]):
            self._reads.unwatch(module)
        else:
            self._reads.watch(module)

    def _rewatch_unit(self, i: int) -> None:
        if self.watching:
            for module in self._holders_of_unit.get(i, ()):
                self._rewatch(module)

    def _rewatch_all(self) -> None:
        if self.watching:
            for modules in self._holders_of_unit.values():
                for module in modules:
                    self._rewatch(module)

    @eager  # inside a compiled block: one graph break, run eagerly (model_zoo.compile)
    def read(self, param) -> None:
        """An attribute read of ``param``: during a forward, outside our own bookkeeping, a use of its unit."""
        if self.watching and not self.busy:
            i = self.unit_of_param.get(id(param))
            if i is not None:
                self.use_external(i)

    def use_external(self, i: int) -> None:
        """A parameter of unit ``i`` was read during the forward (used inside its module, or outside it)."""
        if i in self.live and self.in_use.get(i, 0) > 0:
            return
        self._use(i)
        self._hold(i)
        (self.frames[-1] if self.frames else self._orphans).append(i)

    def enter_forward(self) -> None:
        """Start of the root module's forward: install the saved-tensor hooks and watch parameter reads."""
        self.exit_forward()  # a forward that raised never ran its post-hook
        self._backward_follows = torch.is_grad_enabled()
        self.begin_phase("forward")
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        # Activation checkpointing stops a recomputation as soon as it has what backward needs, which would
        # skip the forward post-hooks that release units: recompute whole modules instead.
        whole = torch.utils.checkpoint.set_checkpoint_early_stop(False)
        for ctx in (hooks, whole):
            ctx.__enter__()
        self._ctx = [hooks, whole]
        self.watching = True
        self._watch_forward()

    def exit_forward(self) -> None:
        """End of the root module's forward: release what it gathered, except the units backward starts with.

        Those (the ``keep_numel`` window of backward's recorded sequence)
        stay gathered into backward when the forward ran with autograd on;
        the weights cannot change in between (an update resets the gatherer).
        """
        if not self._ctx:
            return
        ctxs, self._ctx = self._ctx, []
        self.watching = False
        if self._reads is not None:
            self._reads.remove()  # ordinary modules between forwards
        for ctx in reversed(ctxs):
            ctx.__exit__(None, None, None)
        while self.frames:
            self.module_post()
        for i in self._orphans:
            self.in_use[i] -= 1
        self._orphans = []
        keep = set(self._window(self.traces.get("backward", []))) if self._backward_follows else set()
        for i in list(self.inflight):
            self._complete(i)
        for i in list(self.live):
            if i not in keep:
                self.release(i)
        self.end_phase()

    # ---- saved tensors --------------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor):
        i = self._unit_holding(t)
        if i is None:
            return t if self.outer is None else _OuterSaved(self.outer._pack(t))
        return _SavedView(i, t.storage_offset(), tuple(t.size()), tuple(t.stride()))

    def _unit_holding(self, t: torch.Tensor) -> Optional[int]:
        """The unit whose gathered buffer ``t`` lives in, or None."""
        if not self._storage or t.is_sparse or t.device.type == "meta":
            return None
        try:
            return self._storage.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            return None

    def _unpack(self, saved):
        if isinstance(saved, _OuterSaved):
            return self.outer._unpack(saved.saved)
        if not isinstance(saved, _SavedView):
            return saved
        buf = self.ensure(saved.unit)
        return buf.as_strided(saved.size, saved.stride, saved.offset)
