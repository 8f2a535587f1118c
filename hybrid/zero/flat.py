"""ZeRO stages 0-2: every rank keeps the whole low-precision model in flat buffers.

One object owns the whole update path of a model replica (one TP shard):

* the flat buffers the parameters live in (:mod:`hybrid.zero.flat_buffer`);
* the gradient reducer that runs during backward (:mod:`hybrid.zero.buckets`):
  an all-reduce when the stage partitions nothing, a reduce-scatter into the
  partition otherwise -- once per global batch, or on every micro-step when
  the stage partitions gradients too (they are not kept whole, unless
  ``zero.reduce_once`` asks for it: :func:`hybrid.layout.keeps_whole_gradients`);
* this rank's master partition (:mod:`hybrid.zero.partition`), the whole
  buffer when the stage partitions no optimizer state;
* the inner AdamW/Adam/SGD (:mod:`hybrid.zero.inner`) and, under offload, the
  host twins of gradients and weights (:mod:`hybrid.zero.offload`);
* the global gradient norm (:mod:`hybrid.zero.grad_norm`);
* under ``zero.overlap_param_gather``, the post-step all-gathers left in
  flight until the next forward needs them (:mod:`hybrid.zero.deferred_gather`);
* under ``optimizer.type`` ``onebit_adam`` or ``zero_one_adam``, the 1-bit
  optimizer that replaces the reduction and the update on the steps whose
  gradients stay on their rank (:mod:`hybrid.zero.onebit`,
  :mod:`hybrid.zero.zero_one_adam`).

The shared step, the loss scale and the counters are in :mod:`hybrid.zero.base`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

import torch

from hybrid.zero.base import BackwardPass, ZeroOptimizer
from hybrid.zero.buckets import FullGradReducer, PartitionedGradReducer
from hybrid.zero.deferred_gather import DeferredParamGather
from hybrid.zero.flat_buffer import (build_flat_groups, collect_trainable, dtype_name, param_chunk_sets,
                                     param_owners)
from hybrid.zero.grad_norm import GradNorm, world_sum
from hybrid.zero.offload import ChunkOffload, host_device, poison_requested
from hybrid.zero.onebit import OneBitAdam
from hybrid.zero.zero_one_adam import ZeroOneAdam, ZeroOneSchedule
from hybrid.zero.partition import GroupPartition
from hybrid.compression import ONEBIT_ADAM, ZERO_ONE_ADAM
from hybrid.layout import keeps_whole_gradients, partition_count

logger = logging.getLogger("hybrid.zero")


class FlatZeroOptimizer(ZeroOptimizer):
    """ZeRO stages 0-2 for ``model`` (already in its training dtype) over ``topology``'s DP group.

    Stage 0 is plain data parallelism (bucketed all-reduce); stage 1
    partitions master weights and optimizer state; stage 2 the reduced
    gradients too. ``zero.offload_optimizer="cpu"`` (stages that partition
    the optimizer state) keeps master weights and optimizer state in host
    memory. See :class:`~hybrid.zero.base.ZeroOptimizer` for the arguments and
    ``docs/zero.md`` for the design.
    """

    def __init__(self, model: torch.nn.Module, topology, zero, optimizer, **runtime):
        super().__init__(model, topology, zero, optimizer, **runtime)
        traits, dp = self.traits, topology.dp_size
        self.partition_count = partition_count(self.stage, dp)
        self.part = topology.dp_rank if traits.optimizer_states else 0

        self.groups = build_flat_groups(model, self.partition_count, dp, zero.bucket_size, self.decays,
                                        self.no_weight_decay, self.chunk_params, select=self.param_filter,
                                        decoupled=optimizer.decoupled_lr is not None)
        self.param_index = sorted((r for g in self.groups for r in g.records), key=lambda r: r.position)
        self._frozen = collect_trainable(model, self.param_filter)[1]
        self._sync_replicas()
        host = host_device(self.offload_optimizer, self.groups[0].device)
        self.partitions = [GroupPartition(g, self.part, self.master_dtype, master_device=host) for g in self.groups]
        # the 1-bit optimizers' local steps need each rank's whole local gradient, as zero.reduce_once keeps it
        if keeps_whole_gradients(traits, zero.reduce_once or self.one_bit is not None):
            self.reducer = FullGradReducer(self.groups, self.comm, topology.dp_rank, zero.overlap_comm,
                                           scatter=traits.optimizer_states, quant=self.grad_quant,
                                           two_level=self.two_level)
        else:
            self.reducer = PartitionedGradReducer(self.groups, self.comm, topology.dp_rank, zero.overlap_comm,
                                                  quant=self.grad_quant, two_level=self.two_level)
        self.reducer.attach_hooks()
        self._deferred = DeferredParamGather(model, self.groups) if zero.overlap_param_gather else None
        # per segment id, the model chunks whose backward passes reach it, and per chunk the (group, record)
        # pairs its passes reach (set_chunks); None: one chunk
        self._segment_chunks: Optional[List[FrozenSet[int]]] = None
        self._chunk_reach: Optional[List[FrozenSet[Tuple[int, int]]]] = None
        self._grad_chunks = [self.reducer.grad_chunks(g.index, self.part) for g in self.groups]
        # offload: host twins of the reduced gradients and rounded weights (the same tensors on a CPU model)
        poison = poison_requested()
        self._offload = [ChunkOffload(gc, part.param_chunks, host, poison=poison and not part.aliased)
                         for gc, part in zip(self._grad_chunks, self.partitions)] if host is not None else []
        if any(not off.same for off in self._offload):
            # A weight tied across pipeline stages is final only once its copies' gradients are added in the
            # step (_sum_tied_gradients): its group goes to the host there, with the segments not streamed.
            tied = {g.index for g in self.groups if g.tied and topology.size("embed") > 1}
            self.reducer.on_final = lambda g, s: None if g in tied else self._offload[g].grad_to_host(s)
        lamb = self.inner.kind == "lamb"
        for k, (g, part) in enumerate(zip(self.groups, self.partitions)):
            lowp = part.param_chunks if not self._offload else self._offload[k].lowp
            self.inner.add_group(part.master_chunks, decay=g.weight_decay, lowp=None if part.aliased else lowp,
                                 state_device=host, param_owners=param_owners(g, self.part) if lamb else None,
                                 param_count=len(g.records), decoupled_lr=g.decoupled_lr)
        if lamb and self.partition_count > 1:
            # each parameter's elements are spread over the dp ranks' chunks: sum their squares over dp
            self.inner.norm_reduce = lambda sums: self.comm.all_reduce(sums, "dp")
        self.grad_norm = GradNorm(self.groups, self._grad_chunks, topology, self.part,
                                  counts_whole_gradient=traits.optimizer_states)
        # the masters are laid out as the gradient chunks: the same counting rule gives the parameter norm
        self._master_norm = GradNorm(self.groups, [part.master_chunks for part in self.partitions], topology,
                                     self.part, counts_whole_gradient=traits.optimizer_states)
        tp = (topology.tp_size, topology.tp_rank)
        self.onebit: Optional[OneBitAdam] = None
        self.zero_one: Optional[ZeroOneAdam] = None
        if self.one_bit == ONEBIT_ADAM:
            self.onebit = OneBitAdam(self.groups, self.inner, self.comm, topology.dp_rank, dp, self.part,
                                     optimizer.freeze_step, zero.quantization_block, tp=tp)
        elif self.one_bit == ZERO_ONE_ADAM:
            schedule = ZeroOneSchedule(optimizer.var_freeze_step, optimizer.var_update_scaler,
                                       optimizer.local_step_scaler, optimizer.local_step_clipper)
            self.zero_one = ZeroOneAdam(self.groups, self.inner, self.comm, topology.dp_rank, dp, schedule,
                                        zero.quantization_block, tp=tp)
        if self.one_bit:
            # steps on local gradients measure every rank's whole local gradient
            whole = [[self.reducer.grads[g.index][seg.start: seg.start + seg.size] for seg in g.segments]
                     for g in self.groups]
            self._local_norm = GradNorm(self.groups, whole, topology, 0, counts_whole_gradient=True)
        self._finish_setup()

    def _local_gradients(self) -> bool:
        """Whether this step's gradients stay on their rank: 1-bit Adam's compressed phase, and 0/1 Adam's
        steps other than its variance steps."""
        if self.onebit is not None:
            return self.onebit.compressing
        if self.zero_one is not None:
            return not self.zero_one.reduces_gradients()
        return False

    # ---- set-up ----------------------------------------------------------------------
    def _sync_replicas(self) -> None:
        """Make every DP replica start from DP rank 0's weights (one broadcast per flat group over ``dp``)."""
        for g in self.groups:
            self.comm.broadcast(g.buffer, "dp", src=0)
        for p in self._frozen:
            self.comm.broadcast(p.data, "dp", src=0)

    # ---- the training step ---------------------------------------------------------------
    def set_chunks(self, chunks: int, chunk_params: Optional[Sequence[Sequence[torch.nn.Parameter]]] = None) -> None:
        """Also work out what a pass through each chunk reaches: under stage 2 it reduces those parameters'
        segments alone, and a segment's gradient is final once every chunk it holds has had its last pass
        (which chunks hold a parameter: :func:`~hybrid.zero.flat_buffer.param_chunk_sets`)."""
        super().set_chunks(chunks, chunk_params)
        self._segment_chunks, self._chunk_reach = None, None
        held: List[set] = [set() for _ in self.reducer.order]
        reach: List[set] = [set() for _ in range(self._chunks)]
        for g in self.groups:
            chunk_sets = param_chunk_sets(g.params, chunk_params, self._chunks)
            if chunk_sets is None:
                return
            for r, cs in enumerate(chunk_sets):
                held[self.reducer.sid_of[(g.index, g.records[r].segment)]] |= cs
                for c in cs:
                    reach[c].add((g.index, r))
        self._segment_chunks = [frozenset(cs) for cs in held]
        self._chunk_reach = [frozenset(pairs) for pairs in reach]

    @property
    def segment_chunks(self) -> Optional[List[FrozenSet[int]]]:
        """Per gradient segment (the reducer's launch order): the model chunks whose backward passes reduce it
        under stage 2; None with one chunk per rank."""
        return self._segment_chunks

    @contextlib.contextmanager
    def _backward_phase(self, backward_pass: BackwardPass) -> Iterator[None]:
        """Buckets are reduced over ``dp`` as they fill: on the last micro-step of the global batch when
        the gradients are kept whole, on every micro-step when only the partition is kept. A pass through one
        model chunk of an interleaved stage reduces that chunk's segments only."""
        reach = final = None
        chunk, held = backward_pass.chunk, self._segment_chunks
        if chunk is not None and held is not None:
            reach = self._chunk_reach[chunk]
            final = frozenset(sid for sid, cs in enumerate(held) if chunk in cs and cs <= backward_pass.chunks_done)
        self.reducer.begin_backward(reduce_now=backward_pass.last and not self._local_gradients(), reach=reach,
                                    final=final)
        yield
        self.reducer.end_backward()

    def _sum_tied_gradients(self) -> None:
        if self.topology.size("embed") == 1:
            return
        for g in self.groups:
            if not g.tied:
                continue
            if self._local_gradients():  # the 1-bit optimizers' local steps read each rank's whole gradient
                self.comm.all_reduce(self.reducer.grads[g.index], "embed")
                continue
            for chunk in self._grad_chunks[g.index]:
                self.comm.all_reduce(chunk, "embed")

    def _global_sq(self) -> float:
        if self._local_gradients():
            # No reduced gradient exists: each rank's local gradient times dp stands for the DP sum, so the
            # norm the step reports and clips with is the root mean square of the local norms.
            return self._local_norm.global_sq() * self.topology.dp_size
        return self.grad_norm.global_sq()

    def local_grad_sq(self) -> torch.Tensor:
        """This rank's share of the squared gradient norm (a float64 scalar; no communication): the expert split
        adds both halves' shares before its one all-reduce."""
        return self.grad_norm.local_sq()

    def _grad_zeros(self) -> Optional[int]:
        # a local step's gradients are each rank's own: no whole gradient exists to count
        return None if self._local_gradients() else self.grad_norm.global_zeros()

    def local_grad_zeros(self) -> torch.Tensor:
        """This rank's share of the whole gradient's exact zeros (a float64 scalar; no communication)."""
        return self.grad_norm.local_zeros()

    def _params_sq(self) -> float:
        return world_sum(self.local_params_sq(), self.topology)

    def local_params_sq(self) -> torch.Tensor:
        """This rank's share of the squared master-weight norm (a float64 scalar; no communication)."""
        if self.weight_quant is not None and any(part.aliased for part in self.partitions):
            # aliased masters are this rank's parameter chunks, which only a quantized gather rewrites: a plain one
            # reads them and writes the other ranks' chunks, so --log-params-norm need not wait for it every step
            self.wait_for_weights()
        return self._master_norm.local_sq()

    def _apply_update(self, factor: float) -> None:
        # factor carries the 1/dp of a DP sum; for local gradients the 1-bit exchanges' own mean supplies it
        local = factor * self.topology.dp_size
        if self.zero_one is not None:
            self.zero_one.step(self.reducer.grads, local if self._local_gradients() else factor)
        elif self._local_gradients():
            self.onebit.exchange(self.reducer.grads, local)
            self.onebit.update()
        elif self._offload:
            for off in self._offload:
                off.grads_to_host()
            self.inner.step([off.grads for off in self._offload], factor)
            for off in self._offload:
                off.params_to_device()
        else:
            self.inner.step(self._grad_chunks, factor)
        self._publish_params()

    def _publish_params(self, write: bool = False) -> None:
        """Make every rank's model hold the updated weights (all-gather of the partitions over ``dp``).

        The inner step already rounded the masters into this rank's parameter
        chunks; ``write`` does it here instead (after loading a state). Without
        a partition every rank stepped the whole buffer and nothing moves.
        """
        if write:
            for part in self.partitions:
                part.write_params()
        if not self.traits.gathers_after_step:
            return
        if self._deferred is not None and not write:
            # zero.overlap_param_gather: a read of a parameter waits for its segment's gather
            self._deferred.launch(lambda key: self.partitions[key[0]].gather_segment(key[1], self.comm,
                                                                                  self.weight_quant))
            return
        handles = [h for part in self.partitions for h in part.gather_params(self.comm, self.weight_quant)]
        for h in handles:
            h.wait()

    def wait_for_weights(self) -> None:
        if self._deferred is not None:
            self._deferred.wait_all()

    # ---- reports ---------------------------------------------------------------------
    def memory_report(self) -> Dict[str, int]:
        """Bytes this rank holds, by kind.

        ``params``: every model parameter (flat buffers with their padding, and
        frozen parameters). ``grads``: the gradient store (full buffers in
        stages 0-1 and under ``zero.reduce_once``, this rank's partition in
        stage 2). ``grad_buckets``: stage 2 staging buckets. ``master``: master weights that are not the parameters
        themselves (0 when the parameters are already in the master dtype).
        ``optimizer_states``: Adam moments or SGD momentum. ``offload_staging``:
        host twins of device gradients/weights under offload on an accelerator
        (absent otherwise). ``total``: the sum. ``host_bytes``: the part of
        ``total`` in host memory because of ``offload_optimizer="cpu"`` (0
        without offload); ``device_bytes``: ``total - host_bytes``.
        """
        rep = {"params": sum(g.buffer.numel() * g.buffer.element_size() for g in self.groups)
               + sum(p.numel() * p.element_size() for p in self._frozen)}
        held = self.reducer.bytes_held()
        rep["grads"] = held.pop("grads")
        rep["master"] = sum(p.master_bytes() for p in self.partitions)
        rep["optimizer_states"] = self.inner.state_bytes()
        rep.update(held)
        for one_bit in (self.onebit, self.zero_one):
            if one_bit is not None:
                rep.update(one_bit.bytes_held())
        staging = sum(off.staging_bytes() for off in self._offload)
        if staging:
            rep["offload_staging"] = staging
        rep["total"] = sum(rep.values())
        # offload keeps master, optimizer state and the staging twins in host memory
        rep["host_bytes"] = (rep["master"] + rep["optimizer_states"] + staging) if self._offload else 0
        rep["device_bytes"] = rep["total"] - rep["host_bytes"]
        return rep

    # ---- state -------------------------------------------------------------------------
    def state_dict(self, lazy: bool = False) -> dict:
        """This rank's flat partitions, counters, loss scaler and the parameter index.

        Each group entry holds ``master`` (this rank's [partition_numel] fp32
        partition), the optimizer state of the same shape (``exp_avg`` and
        ``exp_avg_sq`` for Adam), and the layout. The index (JSON-ready) maps
        every parameter to its flat offset and to the partition pieces, so a
        checkpoint can be resharded to any layout. Like ``torch.optim``, the
        tensors are the live state (no copies, except the master of fp32
        parameters, which is assembled from the parameter buffer): save or
        clone them before the next step. ``lazy``: the master of fp32
        parameters and the 1-bit optimizers' buffers as
        :class:`~hybrid.zero.assembled.AssembledTensor` of the live chunks
        instead of copies.
        """
        self.wait_for_weights()
        inner = self.inner.state_dict()
        groups = []
        for g, part, state in zip(self.groups, self.partitions, inner["groups"]):
            groups.append({"dtype": dtype_name(g.dtype), "weight_decay": g.weight_decay, "numel": g.numel,
                           "partition_numel": g.partition_numel,
                           "segments": [[s.start, s.size, s.used] for s in g.segments],
                           "master": part.master_flat(lazy), **state,
                           **(self.onebit.state(g.index, lazy) if self.onebit is not None else {}),
                           **(self.zero_one.state(g.index, lazy) if self.zero_one is not None else {})})
        header = self._state_header(groups)
        if self.zero_one is not None:
            header["zero_one_schedule"] = self.zero_one.state_header()
        return header

    def load_state_dict(self, sd: dict) -> None:
        """Restore a state written by :meth:`state_dict` under the same layout, then refresh the model."""
        self._check_state(sd)
        self.fence_writes()
        inner = {"kind": sd["optimizer"]["type"], "step": sd["step"], "lr": sd["optimizer"]["lr"],
                 "groups": [{k: v for k, v in g.items() if k in self.inner.state_names} for g in sd["groups"]]}
        self.inner.load_state_dict(inner)
        for part, g in zip(self.partitions, sd["groups"]):
            part.load_master(g["master"])
        why = None
        if self.onebit is not None:
            why = self.onebit.load(sd["groups"])
        elif self.zero_one is not None:
            why = self.zero_one.load(sd.get("zero_one_schedule"), sd["groups"])
        if why is not None and self.topology.rank == 0:
            logger.warning("%s: %s", self.one_bit, why)
        self._load_counters(sd)
        self.weights_loaded(from_master=True)

    # ---- whole weights in and out (checkpoints) -----------------------------------------------
    def model_state_for_save(self) -> Optional[Dict[str, torch.Tensor]]:
        """``model.state_dict()``: every rank holds the whole TP shard."""
        self.wait_for_weights()
        return self.model.state_dict()

    def load_model_state(self, state: Dict[str, torch.Tensor]) -> None:
        """Load a ``model.state_dict()`` (this TP rank's shard, keys must match) and make the masters follow it."""
        self.fence_writes()
        self.model.load_state_dict(state, strict=True)
        self.weights_loaded()

    def weights_loaded(self, from_master: bool = False) -> None:
        self.fence_writes()
        if from_master:
            self._publish_params(write=True)
            return
        with torch.no_grad():
            for part in self.partitions:
                if not part.aliased:
                    torch._foreach_copy_(part.master_chunks, part.param_chunks)

    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()
        if self._deferred is not None:
            self._deferred.remove_hooks()
