"""Stages 1-2 under ``zero.overlap_param_gather``: the updated weights' all-gather runs behind the next forward.

Without it the step ends by all-gathering every segment of the parameter
buffers over ``dp`` and waiting for all of them (:meth:`FlatZeroOptimizer._publish_params
<hybrid.zero.flat.FlatZeroOptimizer._publish_params>`): on a slow link the whole
gather is exposed. With it the step only launches the gathers, one per segment,
in the order forward first uses them (a segment's first parameter in
registration order: :meth:`~hybrid.zero.flat_buffer.FlatGroup.segment_first_position`).

Each attribute read of a parameter (``module.weight``: :mod:`hybrid.zero.param_reads`)
whose gather is still in flight waits for every gather launched up to that
parameter's segment first. That covers the reads in a module's own forward
and those outside it (the LM head's read of a tied embedding or of its own
weight, a parent reading its child's position table) alike, so nothing
computes with the last step's weights, and the waits move through the launch
order as forward does: the link carries segment ``k + 1`` while the modules
of segment ``k`` compute. A parameter kept in a plain list or closure and
read from there is not covered; the model zoo keeps none.

Everything else that reads or writes the weights between the step and the
next forward waits for all of them first (:meth:`DeferredParamGather.wait_all`):
a save, the masters' norm when the masters are the parameter chunks
themselves, a load, the next update.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch

from hybrid.comm import Handle
from hybrid.zero.param_reads import ParameterReads

# (flat group index, segment index)
SegmentKey = Tuple[int, int]


class DeferredParamGather:
    """Launches the post-step all-gathers of ``groups`` and waits for each one when a parameter of it is first read.

    ``groups``: the optimizer's :class:`~hybrid.zero.flat_buffer.FlatGroup` list; ``model``: the module tree
    whose modules hold their parameters (their reads are watched).
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

    def watches(self, param: torch.nn.Parameter) -> bool:
        return id(param) in self._place

    def read(self, param: torch.nn.Parameter) -> None:
        """An attribute read of ``param``: wait for its segment's gather (and those before it) if in flight."""
        place = self._place[id(param)]
        if place >= self.landed:
            self.wait_through(place)

    @property
    def in_flight(self) -> int:
        """Gathers launched and not waited for yet."""
        return len(self._pending) - self.landed

    def has_landed(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param``'s segment holds the last update's weights (its gather was waited for)."""
        return self._place[id(param)] < self.landed or not self._pending

    def launch(self, gather: Callable[[SegmentKey], Handle]) -> None:
        """Start every segment's all-gather (``gather(key)`` launches one and returns its handle), in forward's
        order. Gathers of the last step still in flight are waited for first."""
        self.wait_all()
        self._pending = [gather(key) for key in self.order]
        self.landed = 0

    def wait_through(self, place: int) -> None:
        """Wait for every gather launched up to ``place`` in :attr:`order` (the ones before it first)."""
        while self.landed <= place and self.landed < len(self._pending):
            self._pending[self.landed].wait()
            self.landed += 1

    def wait_all(self) -> None:
        self.wait_through(len(self._pending) - 1)

    def remove_hooks(self) -> None:
        self._reads.remove()
