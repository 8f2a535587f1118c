"""Stages 1-2 under ``zero.overlap_param_gather``: the updated weights' all-gather runs behind the next forward.

Without it the step ends by all-gathering every segment of the parameter
buffers over ``dp`` and waiting for all of them (:meth:`FlatZeroOptimizer._publish_params
<hybrid.zero.flat.FlatZeroOptimizer._publish_params>`): on a slow link the whole
gather is exposed. With it the step only launches the gathers, one per segment,
in the order forward first uses them (a segment's first parameter in
registration order: :meth:`~hybrid.zero.flat_buffer.FlatGroup.segment_first_position`).
A forward pre-hook on every module that owns parameters waits, before the module
runs, for every gather launched up to the last segment holding one of its
parameters. A module therefore never computes with weights of the last step,
and the waits move through the launch order as forward does, so the link carries
segment ``k + 1`` while the modules of segment ``k`` compute.

Everything else that reads or writes the weights between the step and the next
forward waits for all of them first (:meth:`DeferredParamGather.wait_all`): a
save, the masters' norm when the masters are the parameter chunks themselves, a
load, the next update. A parameter read outside the forward of a module that owns
it, before any module that owns it has run, is not guarded: the model zoo's only
such read, the LM head's tied embedding weight, comes after the embedding's own
forward.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch

from hybrid.comm import Handle

# (flat group index, segment index)
SegmentKey = Tuple[int, int]


class DeferredParamGather:
    """Launches the post-step all-gathers of ``groups`` and waits for each one when forward first needs it.

    ``groups``: the optimizer's :class:`~hybrid.zero.flat_buffer.FlatGroup` list; ``model``: the module tree
    whose forward reads them (its modules get the pre-hooks).
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
        self._hooks = []
        for module in model.modules():
            places = [self._place[id(p)] for p in module.parameters(recurse=False) if id(p) in self._place]
            if places:
                self._hooks.append(module.register_forward_pre_hook(self._waiter(max(places))))

    def _waiter(self, last: int) -> Callable:
        def hook(module, args):
            self.wait_through(last)
        return hook

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
        for h in self._hooks:
            h.remove()
        self._hooks = []
