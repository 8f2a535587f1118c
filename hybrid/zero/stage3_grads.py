"""ZeRO-3 gradient reduction: unit gradients reduce-scattered in buckets into each rank's partition.

A post-accumulate-grad hook copies each fresh ``param.grad`` into its unit's
``[unit.numel]`` staging buffer and drops it (the full gradient never stays
on a rank). The buffer is not zero-filled: a parameter's first gradient is
copied in, and only the padding and the parameters that got no gradient are
zeroed (the latter when the unit is reduced). A unit that is one parameter
without padding (most units: a linear layer's unit is its weight alone, its
bias being in the persistent pool) takes that parameter's fresh gradient as
its staging buffer, with no copy. When every parameter of a unit
has its gradient the unit is *ready*: its gathered weights are released and it
joins the open bucket (the bucket is launched first if the unit would take it
past ``bucket_numel`` elements). A bucket holding ``bucket_numel`` elements or
more is reduce-scattered over ``dp`` asynchronously; the rank's chunk of every
unit in it is written (first micro-step after :meth:`zero`) or added (later
micro-steps) into the gradient partition, which has the partition layout of
:mod:`hybrid.zero.stage3_layout`.

A unit's staging buffer is already in reduce-scatter order (chunk ``k`` is
DP rank ``k``'s); a bucket of several units is reduced as their staging
buffers interleaved rank by rank, ``[u0.chunk0 u1.chunk0 .. | u0.chunk1
u1.chunk1 .. | ..]``, in unit order (the communicator's segments: the ring
reads the buffers in place). Backward readies units in reverse order, so a
bucket is usually a run of consecutive units, whose chunks are one slice of
the gradient partition: on a first micro-step it is reduced straight into it.

The elements on the wire are capped (:mod:`hybrid.zero.inflight`: two
buckets' worth): launching a bucket lands the oldest ones first until it fits,
so the gradient held beyond the partition is bounded by a few buckets, not the
model.

Units are launched in the order they became ready, which is the backward's
order; :class:`~hybrid.zero.order_check.OrderCheck` verifies it is the same on
every DP rank. Units that got no gradient in this backward (unused), or only
part of it, are reduced when backward ends, in unit order, so every rank
issues the same collectives. With ``offload`` the reduced chunks are copied
into a gradient partition in host memory as they land.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch

from hybrid.comm import Communicator
from hybrid.compression import Quantization
from hybrid.zero.inflight import InflightReductions, closes_before, inflight_limit
from hybrid.zero.order_check import OrderCheck
from hybrid.zero.stage3_layout import Unit


class Stage3GradReducer:
    """Owns the gradient partition ``grads`` ([partition_numel], on ``grad_device``) of one rank."""

    def __init__(self, units: List[Unit], comm: Communicator, order: OrderCheck, dp_rank: int, bucket_numel: int,
                 dtype: torch.dtype, device: torch.device, grad_device: torch.device,
                 on_unit_done: Callable[[int], None], shape_for_grad: Callable[[torch.nn.Parameter], None],
                 unshape: Callable[[torch.nn.Parameter], None], quant: Optional[Quantization] = None,
                 two_level: bool = False):
        self.units = units
        self.comm = comm
        # zero.quantized_gradients and zero.two_level_reduce: how every reduction travels
        self.wire = {"quant": quant, "two_level": two_level}
        self.order = order
        self.dp_rank = dp_rank
        self.bucket_numel = bucket_numel
        self.device = device
        self.dtype = dtype
        numel = sum(u.chunk_numel for u in units)
        pin = grad_device.type == "cpu" and device.type == "cuda"
        self.grads = torch.zeros(numel, dtype=dtype, device=grad_device, pin_memory=pin)
        self._on_unit_done = on_unit_done
        self._shape_for_grad, self._unshape = shape_for_grad, unshape
        self._slot: Dict[int, Tuple[int, int]] = {}  # id(param) -> (unit, record)
        for u in units:
            for r, p in enumerate(u.params):
                self._slot[id(p)] = (u.index, r)
        self._staging: Dict[int, torch.Tensor] = {}
        self._arrived: Dict[int, Set[int]] = {}  # unit -> records whose gradient is in its staging buffer
        self._reduced = set()
        self._bucket: List[int] = []
        self._bucket_size = 0
        self._fresh = [True] * len(units)
        self._inflight = InflightReductions(inflight_limit(bucket_numel))
        self._hooks = []
        self._wire_bytes = 0  # inputs and outputs of the buckets in flight
        self.transient_peak_bytes = 0  # most gradient bytes held beyond the partition (staging + in flight)
        self._active = False

    def attach_hooks(self) -> None:
        for u in self.units:
            for p in u.params:
                self._hooks.append(p.register_hook(functools.partial(self._before_accumulate, p)))
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ---- backward -------------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        self._active = True
        self._arrived.clear()
        self._reduced.clear()

    def _stage_buffer(self, i: int) -> torch.Tensor:
        buf = self._staging.get(i)
        if buf is None:
            u = self.units[i]
            buf = self._staging[i] = torch.empty(u.numel, dtype=self.dtype, device=self.device)
            buf[u.used:].zero_()  # padding contributes nothing to the sum
            self._note_peak()
        return buf

    def _staged(self, i: int) -> torch.Tensor:
        """Unit ``i``'s staging buffer, taken for reduction, with zeros where no gradient arrived."""
        u = self.units[i]
        buf = self._staging.pop(i, None)
        if buf is None:
            return torch.zeros(u.numel, dtype=self.dtype, device=self.device)
        arrived = self._arrived.get(i, ())
        for r, rec in enumerate(u.records):
            if r not in arrived:  # unused in this backward: no gradient
                buf[rec.offset: rec.offset + rec.numel].zero_()
        return buf

    def _adopt(self, i: int, grad: torch.Tensor) -> bool:
        """Take ``grad`` itself as unit ``i``'s staging buffer when it is the whole unit: one parameter, no
        padding, a contiguous tensor of the reduction's dtype and device that owns all of its memory (no view
        keeping a larger buffer alive). Saves copying the gradient, and allocating the buffer."""
        u = self.units[i]
        if (not u.whole_parameter or grad.numel() != u.numel or grad.dtype != self.dtype
                or grad.device != self.device or grad.layout != torch.strided or not grad.is_contiguous()
                or grad._base is not None or grad.storage_offset() != 0
                or grad.untyped_storage().nbytes() != u.numel * grad.element_size()):
            return False
        self._staging[i] = grad.detach().view(-1)
        self._note_peak()
        return True

    def _note_peak(self, extra: int = 0) -> None:
        held = sum(b.numel() * b.element_size() for b in self._staging.values()) + self._wire_bytes + extra
        self.transient_peak_bytes = max(self.transient_peak_bytes, held)

    def _before_accumulate(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        self._shape_for_grad(param)

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if not self._active or param.grad is None:
            self._unshape(param)
            return
        i, r = self._slot[id(param)]
        if i in self._reduced:
            raise RuntimeError(f"parameter {self.units[i].records[r].name!r} received another gradient after its "
                               f"unit was reduced in this backward (is it used in several re-entrant "
                               f"checkpointed regions?)")
        rec = self.units[i].records[r]
        arrived = self._arrived.setdefault(i, set())
        if not arrived and self._adopt(i, param.grad):
            arrived.add(r)
        else:
            dst = self._stage_buffer(i)[rec.offset: rec.offset + rec.numel].view(rec.shape)
            if r in arrived:
                dst.add_(param.grad)
            else:
                dst.copy_(param.grad)
                arrived.add(r)
        param.grad = None
        self._unshape(param)
        if len(arrived) == len(self.units[i].params):
            self._ready(i)

    def _ready(self, i: int) -> None:
        self._reduced.add(i)
        self._on_unit_done(i)
        if closes_before(self._bucket_size, self.units[i].numel, self.bucket_numel):
            self._flush()
        self._bucket.append(i)
        self._bucket_size += self.units[i].numel
        if self._bucket_size >= self.bucket_numel:
            self._flush()

    def end_backward(self) -> None:
        """Reduce every unit not reduced yet (unused or partly used ones), then the open bucket."""
        self._active = False
        for u in self.units:
            if u.index not in self._reduced:
                self._ready(u.index)
        self._flush(last=True)

    # ---- communication ----------------------------------------------------------------------------------
    def _flush(self, last: bool = False) -> None:
        """Reduce-scatter the open bucket. ``last``: the end of backward, which the order check marks (with
        the bucket's own check, or alone when no bucket is open) so that ranks that issued a different number
        of reductions disagree there."""
        if not self._bucket:
            if last:
                self.order.verify("end-backward", (), "end of backward")
            return
        bucket, numel, self._bucket, self._bucket_size = self._bucket, self._bucket_size, [], 0
        # Land older buckets first (freeing their inputs and gloo's copies) until this one fits the cap.
        self._inflight.make_room(numel)
        names = ", ".join(self.units[i].module_name for i in bucket)
        kind = "reduce-last" if last else "reduce"
        self.order.verify(kind, bucket, f"reduce-scatter [{names}]{' (end of backward)' if last else ''}")
        bucket = sorted(bucket)  # unit order: the partition's
        staged = [self._staged(i) for i in bucket]
        numel = sum(t.numel() for t in staged)
        size = staged[0].element_size()
        out = self._direct_target(bucket)
        direct = out is not None
        # Decided now, not when the bucket lands: the next micro-step's reduction of these units may be
        # launched before this one lands, and must add to it.
        fresh = [self._fresh[i] for i in bucket]
        for i in bucket:
            self._fresh[i] = False
        if not direct:
            out = torch.empty(numel // self.units[0].dp, dtype=self.dtype, device=self.device)
        # a communicator that interleaves the buckets' units builds a copy beside the staging buffers
        self._note_peak(numel * size if len(bucket) > 1 else 0)
        self._wire_bytes += (numel + out.numel()) * size
        self._note_peak()
        handle = self.comm.reduce_scatter_tensor(out, staged, "dp", async_op=True, **self.wire)
        # keep the input alive until the collective is done
        self._inflight.add(handle, functools.partial(self._land, bucket, out, staged, direct, fresh), numel)

    def _direct_target(self, bucket: List[int]) -> Optional[torch.Tensor]:
        """The gradient partition's slice for ``bucket`` (sorted) when the reduction may land there itself: its
        units are consecutive, none holds a gradient yet (first micro-step), and the partition is on the device
        the reduction runs on. None otherwise."""
        if self.grads.device != self.device or not all(self._fresh[i] for i in bucket):
            return None
        if bucket[-1] - bucket[0] != len(bucket) - 1:
            return None
        first, last = self.units[bucket[0]], self.units[bucket[-1]]
        return self.grads[first.partition_offset: last.partition_offset + last.chunk_numel]

    def _land(self, bucket: List[int], out: torch.Tensor, staged: List[torch.Tensor], direct: bool,
              fresh: List[bool]) -> None:
        """Write (``fresh``: first of the step) or add the reduced chunks ``out`` into the gradient partition;
        nothing to move when ``direct``: the reduction wrote the partition itself. Buckets land in launch
        order."""
        o = 0
        for i, first in zip(bucket, fresh):
            u = self.units[i]
            c = u.chunk_numel
            if not direct:
                target = self.grads[u.partition_offset: u.partition_offset + c]
                if first:
                    target.copy_(out[o: o + c], non_blocking=True)
                else:
                    target.add_(out[o: o + c].to(target.device))
            o += c
        self._wire_bytes -= (sum(t.numel() for t in staged) + out.numel()) * out.element_size()

    def wait(self) -> None:
        self._inflight.land_all()
        if self.grads.device != self.device and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def zero(self) -> None:
        self._fresh = [True] * len(self.units)
        self.grads.zero_()

    def chunk(self, i: int) -> torch.Tensor:
        u = self.units[i]
        return self.grads[u.partition_offset: u.partition_offset + u.chunk_numel]

    def bytes_held(self) -> Dict[str, int]:
        staging = sum(b.numel() * b.element_size() for b in self._staging.values())
        return {"grads": self.grads.numel() * self.grads.element_size(), "grad_buckets": staging}
