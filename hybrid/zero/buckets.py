"""Bucketed data-parallel gradient reduction, overlapped with backward.

A *bucket* is one segment of a flat group (see :mod:`hybrid.zero.flat_buffer`).
A post-accumulate-grad hook on every trainable parameter counts the
parameters of its segment whose gradient is complete; when the count reaches
the segment's size the segment is *ready*. Ready segments are launched as
async collectives over the ``dp`` axis in one fixed order -- segments sorted
by their earliest-registered parameter, last first, which is the order a
backward pass normally completes them -- so every rank issues the same
collectives in the same order even if hooks fire in a different order. What
a hook never marks (a parameter unused this micro-step) is launched, in the
same order, when backward returns.

Two reducers:

* :class:`FullGradReducer` (stages 0 and 1): every rank holds the full
  gradient in a flat buffer per group, and each ``param.grad`` is a view into
  it, so autograd accumulates micro-steps in place. Only the accumulation
  boundary communicates: stage 0 all-reduces each segment, stage 1
  reduce-scatters it in place so this rank's chunk holds the DP sum.
* :class:`PartitionedGradReducer` (stage 2): a rank keeps only its partition's
  gradients ([partition_numel] per group, in the parameter dtype). Hooks copy
  each fresh ``param.grad`` into a staging bucket and drop it; a full bucket
  is reduce-scattered (every micro-step) into the partition, accumulating.
  A backward pass through one model chunk of an interleaved pipeline stage
  reaches only that chunk's parameters (its *reach*): a segment waits for
  those of its parameters alone, and one holding none of them is neither
  waited for nor sent (as zeros) in that pass. A segment's gradient is final
  after the last pass of the batch through the chunks it holds (``final``).

Both sum over DP; the 1/dp of the average is folded into the optimizer's
single unscale-and-clip factor.
"""

from __future__ import annotations

import collections
import functools
from typing import AbstractSet, Callable, Deque, Dict, List, Optional, Tuple

import torch

from hybrid.comm import Communicator, Handle
from hybrid.compression import Quantization
from hybrid.zero.flat_buffer import FlatGroup

STAGING_BUFFERS_BEFORE_WAIT = 2  # staging buckets per dtype allocated before backward waits on one


class _LaunchQueue:
    """Launches ready segments strictly in a fixed global order."""

    def __init__(self, order: List[Tuple[int, int]], sizes: List[int], launch: Callable[[int], None]):
        self.order = order  # global segment id -> (group, segment), in launch order
        self.sizes = sizes  # records per global segment id
        self._launch = launch
        self.reset()

    def reset(self, expected: Optional[Dict[int, int]] = None) -> None:
        """Start a backward pass; ``expected``: the only segments it launches, each with the number of its
        records the pass reaches (None: every segment, all its records)."""
        if expected is None:
            self.skip, self.pending = [False] * len(self.order), list(self.sizes)
        else:
            self.skip = [sid not in expected for sid in range(len(self.order))]
            self.pending = [expected.get(sid, 0) for sid in range(len(self.order))]
        self.cursor = 0

    def mark(self, sid: int) -> None:
        self.pending[sid] -= 1
        while self.cursor < len(self.order) and self.pending[self.cursor] <= 0:
            self._advance()

    def flush(self) -> None:
        while self.cursor < len(self.order):
            self._advance()

    def _advance(self) -> None:
        self.cursor += 1
        if not self.skip[self.cursor - 1]:
            self._launch(self.cursor - 1)


class _ReducerBase:
    """Hook plumbing shared by both reducers."""

    def __init__(self, groups: List[FlatGroup], comm: Communicator, dp_rank: int, overlap: bool,
                 quant: Optional[Quantization] = None, two_level: bool = False):
        self.groups = groups
        self.comm = comm
        self.dp_rank = dp_rank
        self.overlap = overlap
        # zero.quantized_gradients and zero.two_level_reduce: how every reduction travels
        self.wire = {"quant": quant, "two_level": two_level}
        keys = [(g.index, s) for g in groups for s in range(len(g.segments))]
        keys.sort(key=lambda k: -self.groups[k[0]].segment_first_position(k[1]))
        self.order = keys
        self.sid_of: Dict[Tuple[int, int], int] = {k: i for i, k in enumerate(keys)}
        self.queue = _LaunchQueue(keys, [len(groups[g].segments[s].records) for g, s in keys],
                                  self._launch)
        self._active = False
        self._reduce_now = False
        self._inflight: Deque[Tuple[Handle, Optional[Callable[[], None]]]] = collections.deque()
        self._hooks = []
        self._arrived = [bytearray(len(g.records)) for g in groups]  # gradient seen in this backward
        # Called as (group, segment) once this rank's reduced chunk of a segment holds the step's gradient
        # (after the batch's last pass that reaches the segment), so offload can stream it during backward.
        self.on_final: Optional[Callable[[int, int], None]] = None
        self._reach: Optional[AbstractSet[Tuple[int, int]]] = None  # (group, record) this pass reaches; None: all
        self._expected: Dict[AbstractSet[Tuple[int, int]], Dict[int, int]] = {}  # reach -> records per segment
        self._final: AbstractSet[int] = frozenset()     # segments whose gradient this pass completes
        self._every = frozenset(range(len(keys)))

    def attach_hooks(self) -> None:
        for g in self.groups:
            for r, p in enumerate(g.params):
                sid = self.sid_of[(g.index, g.records[r].segment)]
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    functools.partial(self._on_grad, g.index, r, sid)))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def begin_backward(self, reduce_now: bool, reach: Optional[AbstractSet[Tuple[int, int]]] = None,
                       final: Optional[AbstractSet[int]] = None) -> None:
        """Called before ``loss.backward()``; ``reduce_now`` says whether this micro-step communicates.

        ``reach``: the (group, record) pairs this pass can give gradients to (None: all); only the segments
        holding one are launched, each once those have arrived. ``final``: the segment ids whose gradient for the
        batch is complete after this pass (None: all of them when ``reduce_now``, else none)."""
        self.queue.reset(None if reach is None else self._expected_in(reach))
        self._active = True
        self._reduce_now = reduce_now
        self._reach = reach
        self._final = self._finals(final, reduce_now)
        for flags in self._arrived:
            flags[:] = bytes(len(flags))

    def end_backward(self) -> None:
        """Called after ``loss.backward()`` returns: launch every segment not launched yet."""
        self._active = False
        if self._reduce_now:
            self.queue.flush()

    def wait(self) -> None:
        """Block until every launched reduction has landed in the gradient store."""
        while self._inflight:
            self._wait_oldest()

    def _then_final(self, g: int, s: int, finish: Optional[Callable[[], None]]) -> Optional[Callable[[], None]]:
        """``finish``, followed by ``on_final(g, s)`` when this pass completes the segment's gradient."""
        if self.on_final is None or self.sid_of[(g, s)] not in self._final:
            return finish

        def done() -> None:
            if finish is not None:
                finish()
            self.on_final(g, s)
        return done

    def _wait_oldest(self) -> None:
        handle, finish = self._inflight.popleft()
        handle.wait()
        if finish is not None:
            finish()

    def _first_arrival(self, g: int, r: int, sid: int) -> bool:
        """Record that parameter ``r`` of group ``g`` has its gradient; False if it already had one.

        A second gradient in one backward (a weight used in several reentrant
        checkpointed regions) is fine until its bucket is on the wire, and an
        error after, when it could no longer be included.
        """
        self._check_reach(g, r)
        if not self._arrived[g][r]:
            self._arrived[g][r] = 1
            return True
        if sid < self.queue.cursor:
            name = self.groups[g].records[r].name
            raise RuntimeError(f"parameter {name!r} received another gradient after its bucket was reduced "
                               f"in this backward (is it used in several re-entrant checkpointed regions?); "
                               f"build the optimizer with overlap_comm=False to reduce after backward")
        return False

    def _finals(self, final: Optional[AbstractSet[int]], last: bool) -> AbstractSet[int]:
        """``final`` as given, or by default every segment on the batch's last pass and none before it."""
        if final is not None:
            return final
        return self._every if last else frozenset()

    def _expected_in(self, reach: AbstractSet[Tuple[int, int]]) -> Dict[int, int]:
        """Records per segment id that a pass with ``reach`` gives gradients to (worked out once per reach)."""
        expected = self._expected.get(reach)
        if expected is None:
            expected = self._expected[reach] = dict(collections.Counter(
                self.sid_of[(g, self.groups[g].records[r].segment)] for g, r in reach))
        return expected

    def _check_reach(self, g: int, r: int) -> None:
        """A gradient outside the pass's reach would never be sent: a wrong reach is a bug, not bad input."""
        if self._reach is not None and (g, r) not in self._reach:
            name = self.groups[g].records[r].name
            raise RuntimeError(f"parameter {name!r} received a gradient in a backward pass through a model chunk "
                               f"that does not hold it (the model's parameters_of_part left it out)")

    def _on_grad(self, g: int, r: int, sid: int, param: torch.nn.Parameter) -> None:
        raise NotImplementedError

    def _launch(self, sid: int) -> None:
        raise NotImplementedError


class FullGradReducer(_ReducerBase):
    """Stages 0/1: full flat gradient buffers; reduce at the accumulation boundary only.

    ``grads[g]`` is a [numel] tensor of group ``g``'s dtype, and each
    parameter's ``.grad`` is the matching view. Stage 0 all-reduces (sum)
    each segment over ``dp``; stage 1 reduce-scatters each segment over ``dp``
    in place, leaving the DP sum in this rank's chunk (the rest is stale).
    """

    def __init__(self, groups: List[FlatGroup], comm: Communicator, dp_rank: int, overlap: bool,
                 scatter: bool, quant: Optional[Quantization] = None, two_level: bool = False):
        super().__init__(groups, comm, dp_rank, overlap, quant, two_level)
        self.scatter = scatter
        self.grads = [torch.zeros(g.numel, dtype=g.dtype, device=g.device) for g in groups]
        self.views = [[g.view_of(self.grads[g.index], r) for r in range(len(g.records))] for g in groups]
        self._bind()

    def _bind(self) -> None:
        for g in self.groups:
            for p, v in zip(g.params, self.views[g.index]):
                p.grad = v

    def zero(self) -> None:
        for buf in self.grads:
            buf.zero_()
        self._bind()

    def begin_backward(self, reduce_now: bool, reach: Optional[AbstractSet[Tuple[int, int]]] = None,
                       final: Optional[AbstractSet[int]] = None) -> None:
        # the whole gradient is reduced once, on the batch's last pass, whichever model chunk that runs through
        super().begin_backward(reduce_now)

    def _on_grad(self, g: int, r: int, sid: int, param: torch.nn.Parameter) -> None:
        view = self.views[g][r]
        if param.grad is not view and param.grad.data_ptr() != view.data_ptr():
            # Something replaced .grad (e.g. model.zero_grad() set it to None): take the new
            # gradient as the value and point .grad back at the flat buffer.
            view.copy_(param.grad)
            param.grad = view
        if self._active and self._reduce_now and self.overlap and self._first_arrival(g, r, sid):
            self.queue.mark(sid)

    def _launch(self, sid: int) -> None:
        gi, s = self.order[sid]
        group = self.groups[gi]
        seg = group.segments[s]
        flat = self.grads[gi][seg.start: seg.start + seg.size]
        if self.scatter:
            out = group.chunk(self.grads[gi], s, self.dp_rank)
            handle = self.comm.reduce_scatter_tensor(out, flat, "dp", async_op=True, **self.wire)
        else:
            handle = self.comm.all_reduce(flat, "dp", async_op=True, **self.wire)
        self._inflight.append((handle, self._then_final(gi, s, None) if self.scatter else None))

    def grad_chunks(self, g: int, part: int) -> List[torch.Tensor]:
        """Per-segment views of the reduced gradient this rank steps with."""
        group = self.groups[g]
        return [group.chunk(self.grads[g], s, part) for s in range(len(group.segments))]

    def bytes_held(self) -> Dict[str, int]:
        return {"grads": sum(b.numel() * b.element_size() for b in self.grads)}


class PartitionedGradReducer(_ReducerBase):
    """Stage 2: only this rank's gradient partition is kept, reduce-scattered every micro-step.

    ``grads[g]`` is a [partition_numel] tensor of group ``g``'s dtype. The
    first reduction into a chunk after :meth:`zero` writes it; later ones (more
    micro-steps) reduce-scatter into the staging bucket and add.
    """

    def __init__(self, groups: List[FlatGroup], comm: Communicator, dp_rank: int, overlap: bool,
                 quant: Optional[Quantization] = None, two_level: bool = False):
        super().__init__(groups, comm, dp_rank, overlap, quant, two_level)
        self.grads = [torch.zeros(g.partition_numel, dtype=g.dtype, device=g.device) for g in groups]
        self._fresh = [True] * len(self.order)  # chunk not yet written since zero()
        self._staging: Dict[int, torch.Tensor] = {}  # global segment id -> bucket being filled
        self._free: Dict[torch.dtype, List[torch.Tensor]] = collections.defaultdict(list)
        self._allocated: Dict[torch.dtype, List[torch.Tensor]] = collections.defaultdict(list)
        self._bucket_numel: Dict[torch.dtype, int] = {}
        for g in groups:
            biggest = max(seg.size for seg in g.segments)
            self._bucket_numel[g.dtype] = max(self._bucket_numel.get(g.dtype, 0), biggest)
        for g in groups:
            for p in g.params:
                p.grad = None

    def zero(self) -> None:
        self._fresh = [True] * len(self.order)
        for g in self.groups:
            for p in g.params:
                p.grad = None

    def begin_backward(self, reduce_now: bool, reach: Optional[AbstractSet[Tuple[int, int]]] = None,
                       final: Optional[AbstractSet[int]] = None) -> None:
        # stage 2 communicates every micro-step; its gradients are final on the last one
        super().begin_backward(True, reach, self._finals(final, reduce_now))

    def _acquire(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        while not self._free[dtype]:
            if len(self._allocated[dtype]) < STAGING_BUFFERS_BEFORE_WAIT or not self._inflight:
                buf = torch.empty(self._bucket_numel[dtype], dtype=dtype, device=device)
                self._allocated[dtype].append(buf)
                return buf
            self._wait_oldest()
        return self._free[dtype].pop()

    def _stage(self, g: int, r: int, sid: int, param: torch.nn.Parameter, first: bool) -> None:
        """Move ``param.grad`` into its segment's staging bucket (adding when it is not the first)."""
        group = self.groups[g]
        rec = group.records[r]
        seg = group.segments[rec.segment]
        buf = self._staging.get(sid)
        if buf is None:
            buf = self._staging[sid] = self._acquire(group.dtype, group.device)
        lo = rec.offset - seg.start
        dst = buf[lo: lo + rec.numel].view(rec.shape)
        if first:
            dst.copy_(param.grad)
        else:
            dst.add_(param.grad)
        param.grad = None

    def _on_grad(self, g: int, r: int, sid: int, param: torch.nn.Parameter) -> None:
        if not self._active or param.grad is None or not self.overlap:
            return
        first = self._first_arrival(g, r, sid)
        self._stage(g, r, sid, param, first)
        if first:
            self.queue.mark(sid)

    def end_backward(self) -> None:
        if not self.overlap:
            # Without overlap the hooks left every .grad in place: stage them segment by segment.
            for sid, (gi, s) in enumerate(self.order):
                group = self.groups[gi]
                for r in group.segments[s].records:
                    if group.params[r].grad is not None:
                        self._check_reach(gi, r)
                        self._arrived[gi][r] = 1
                        self._stage(gi, r, sid, group.params[r], first=True)
        super().end_backward()

    def _launch(self, sid: int) -> None:
        gi, s = self.order[sid]
        group = self.groups[gi]
        seg = group.segments[s]
        buf = self._staging.pop(sid, None)
        if buf is None:
            buf = self._acquire(group.dtype, group.device)
        arrived = self._arrived[gi]
        for r in seg.records:
            if not arrived[r]:  # unused in this micro-step: contributes zeros
                rec = group.records[r]
                buf[rec.offset - seg.start: rec.offset - seg.start + rec.numel].zero_()
        buf[seg.used: seg.size].zero_()
        flat = buf[: seg.size]
        target = group.partition_chunk(self.grads[gi], s)
        if self._fresh[sid]:
            self._fresh[sid] = False
            handle = self.comm.reduce_scatter_tensor(target, flat, "dp", async_op=True, **self.wire)
            finish = functools.partial(self._release, buf)
        else:
            # Later micro-steps reduce in place into this rank's chunk of the bucket, then add.
            c = seg.chunk_numel(group.parts)
            scratch = flat[self.dp_rank * c: (self.dp_rank + 1) * c]
            handle = self.comm.reduce_scatter_tensor(scratch, flat, "dp", async_op=True, **self.wire)
            finish = functools.partial(self._add_and_release, target, scratch, buf)
        self._inflight.append((handle, self._then_final(gi, s, finish)))

    def _release(self, buf: torch.Tensor) -> None:
        self._free[buf.dtype].append(buf)

    def _add_and_release(self, target: torch.Tensor, scratch: torch.Tensor, buf: torch.Tensor) -> None:
        target.add_(scratch)
        self._release(buf)

    def grad_chunks(self, g: int, part: int) -> List[torch.Tensor]:
        group = self.groups[g]
        return [group.partition_chunk(self.grads[g], s) for s in range(len(group.segments))]

    def bytes_held(self) -> Dict[str, int]:
        staging = sum(b.numel() * b.element_size() for bufs in self._allocated.values() for b in bufs)
        return {"grads": sum(b.numel() * b.element_size() for b in self.grads),
                "grad_buckets": staging}
