"""Stages 1-2 under ``zero.overlap_param_gather``: the updated weights' all-gather runs behind the next forward.

Without it the step ends by all-gathering every segment of the parameter
buffers over ``dp`` and waiting for all of them (:meth:`FlatZeroOptimizer._publish_params
<hybrid.zero.flat.FlatZeroOptimizer._publish_params>`): on a slow link the whole
gather is exposed. With it the step only launches the gathers, one per segment,
in the order forward first uses them (a segment's first parameter in
registration order: :meth:`~hybrid.zero.flat_buffer.FlatGroup.segment_first_position`).

Each attribute read of a parameter (``module.weight``: :mod:`hybrid.zero.param_reads`)
whose gather is still in flight waits for every gather launched up to that
parameter's segment first. The modules holding such parameters get their
watching ``_parameters`` at the launch and their ordinary dict back as soon
as the last gather holding one of their parameters landed, so a forward that
finds every gather landed (and a compiled block whose gathers were waited for
before it is entered, :meth:`DeferredParamGather.wait_for`) runs on ordinary
modules. That covers the reads in a module's own forward
and those outside it (the LM head's read of a tied embedding or of its own
weight, a parent reading its child's position table) alike, so nothing
computes with the last step's weights, and the waits move through the launch
order as forward does: the link carries segment ``k + 1`` while the modules
of segment ``k`` compute. A parameter kept in a plain list or closure and
read from there is not covered; the model zoo keeps none.

Everything else that reads or writes the weights between the step and the
next forward waits for all of them first (:meth:`DeferredParamGather.wait_all`):
a save, the masters' norm when the masters are the parameter chunks
themselves, a load, the next update. A module's parameters listed while in
flight (``named_parameters``, ``state_dict``, ``.to()``) wait for theirs.
"""

from __future__ import annotations

import heapq
from typing import Callable, Dict, Iterable, List, Sequence, Tuple

import torch

from hybrid.comm import Handle
from hybrid.zero.param_reads import ParameterReads

# (flat group index, segment index)
SegmentKey = Tuple[int, int]


class DeferredParamGather:
    """Launches the post-step all-gathers of ``groups`` and waits for each one when a parameter of it is first read.

    ``groups``: the optimizer's :class:`~hybrid.zero.flat_buffer.FlatGroup` list; ``model``: the module tree
    whose modules hold their parameters (their reads are watched while their gathers are in flight). The
    parameters are keyed by identity; ``groups`` keeps them alive.
    """

    def __init__(self, model: torch.nn.Module, groups: Sequence):
        keys = [(g.index, s) for g in groups for s in range(len(g.segments))]
        by_index = {g.index: g for g in groups}
        # forward's order: a segment is needed from the module owning its first parameter on
        self.order: List[SegmentKey] = sorted(keys, key=lambda k: by_index[k[0]].segment_first_position(k[1]))
        rank = {key: i for i, key in enumerate(self.order)}
        self._place: Dict[int, int] = {}  # id(parameter) -> its segment's place in self.order
        for g in groups:
            for p, record in zip(g.params, g.records):
                self._place[id(p)] = rank[(g.index, record.segment)]
        self._pending: List[Handle] = []  # in self.order
        self.landed = 0  # gathers of self._pending waited for, the first ones in order
        self._reads = ParameterReads(model, self)
        # watched modules by the place of the last gather they wait for: (place, tie-break, module)
        self._unwatch_queue: List[Tuple[int, int, torch.nn.Module]] = []

    def watches(self, param: torch.nn.Parameter) -> bool:
        return id(param) in self._place

    def read(self, param: torch.nn.Parameter) -> None:
        """An attribute read of ``param``: wait for its segment's gather (and those before it) if in flight."""
        place = self._place.get(id(param))
        if place is not None and place >= self.landed:
            self.wait_through(place)

    def listed(self, params: Iterable[torch.nn.Parameter]) -> None:
        """A module hands its parameters out in bulk (their values may be read): wait for all of their gathers."""
        places = [self._place[id(p)] for p in params if id(p) in self._place]
        if places and max(places) >= self.landed:
            self.wait_through(max(places))

    def wait_for(self, module: torch.nn.Module) -> None:
        """Wait for every gather holding a parameter of ``module`` or its submodules, which then hold ordinary
        ``_parameters`` dicts: the explicit wait before entering a compiled region (a transformer block), so that
        the region never meets the read watch."""
        for m in module.modules():
            self.listed(self._reads.watched_params(m))

    @property
    def in_flight(self) -> int:
        """Gathers launched and not waited for yet."""
        return len(self._pending) - self.landed

    def has_landed(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param``'s segment holds the last update's weights (its gather was waited for); a parameter
        of no segment has nothing in flight."""
        place = self._place.get(id(param))
        return place is None or place < self.landed or not self._pending

    def launch(self, gather: Callable[[SegmentKey], Handle]) -> None:
        """Start every segment's all-gather (``gather(key)`` launches one and returns its handle), in forward's
        order, and watch the modules holding their parameters. Gathers of the last step still in flight are
        waited for first."""
        self.wait_all()
        self._pending = [gather(key) for key in self.order]
        self.landed = 0
        self._watch_in_flight()

    def _watch_in_flight(self) -> None:
        """Watch every module holding a parameter of a gather in flight (a fresh scan of the model), queued by
        the last gather it waits for."""
        self._unwatch_queue = []
        for tie, (module, params) in enumerate(self._reads.holders()):
            self._reads.watch(module)
            self._unwatch_queue.append((max(self._place[id(p)] for p in params), tie, module))
        heapq.heapify(self._unwatch_queue)
        self._unwatch_landed()

    def _unwatch_landed(self) -> None:
        """Give the modules whose gathers all landed their ordinary dicts back. A module is checked again as it
        is now: one given an in-flight parameter since the launch stays watched until that one lands too."""
        queue = self._unwatch_queue
        while queue and (queue[0][0] < self.landed or not self.in_flight):
            _, tie, module = heapq.heappop(queue)
            places = [self._place[id(p)] for p in self._reads.watched_params(module)]
            last = max(places, default=-1)
            if last < self.landed or not self.in_flight:
                self._reads.unwatch(module)
            else:
                heapq.heappush(queue, (last, tie, module))

    def wait_through(self, place: int) -> None:
        """Wait for every gather launched up to ``place`` in :attr:`order` (the ones before it first)."""
        while self.landed <= place and self.landed < len(self._pending):
            self._pending[self.landed].wait()
            self.landed += 1
        self._unwatch_landed()

    def wait_all(self) -> None:
        self.wait_through(len(self._pending) - 1)

    def remove_hooks(self) -> None:
        self._unwatch_queue = []
        self._reads.remove()
