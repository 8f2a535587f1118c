"""ZeRO stage 3: the parameters themselves are partitioned over the DP group.

Each DP rank keeps only its partition of every unit (see
:mod:`hybrid.zero.stage3_layout`): the low-precision weights, the gradients,
the fp32 master weights and the optimizer state, 16Ψ/N_d bytes per rank in
mixed precision with Adam. Whole parameters exist only while a module runs
(:mod:`hybrid.zero.param_gather`); gradients are reduce-scattered into the
partition during backward (:mod:`hybrid.zero.stage3_grads`). The update is
the same inner optimizer as stages 1-2, on the flat partition, optionally in
host memory (``offload_optimizer="cpu"``).

Communication per step over ``dp``: an all-gather of the weights in forward,
another in backward and a reduce-scatter of the gradients, 1.5x the all-reduce
of stage 0 (less for persistent units, which are all-gathered once per step
after the update instead, and for units forward keeps gathered for
backward, those within the prefetch window or ``zero.max_reuse_distance``:
1x when the window covers the model). With hpZ (``zero.hpz_partition_size = l`` > 1,
:mod:`hybrid.zero.secondary_partition`) the backward gather runs over
``dp_node`` instead, inside the node, from a secondary copy of the weights
sharded over the node's ``l`` ranks (``1/l`` of the gathered units per rank).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from hybrid import param_meta
from hybrid.compile_marks import eager
from hybrid.zero.assembled import AssembledTensor, assembled_or_copy
from hybrid.zero.base import BackwardPass, ZeroOptimizer
from hybrid.zero.flat_buffer import ZeroConfigError, dtype_name, is_embedding_or_output
from hybrid.zero.grad_norm import local_sq, local_zeros, world_sum
from hybrid.zero.offload import HostCopy, host_device
from hybrid.zero.order_check import OrderCheck
from hybrid.topology import TopologyError
from hybrid.zero.param_gather import ParamGatherer
from hybrid.zero.secondary_partition import SecondaryPartition, hpz_size_problem
from hybrid.zero.stage3_grads import Stage3GradReducer
from hybrid.zero.stage3_layout import Unit, build_units, param_index, partition_numel


# A ZeRO-3 unit's forward hooks (Stage3._register_module_hooks). Module-level and marked @eager, as the gatherer's
# methods are: inside a compiled block each call is one graph break; a closure per unit would be compiled by dynamo
# as a frame of its own, specialised on its unit, until its recompile limit (a warning on every rank).
@eager
def _gather_unit(gatherer: ParamGatherer, unit: int, module, args) -> None:
    gatherer.module_pre(unit)


@eager
def _release_unit(gatherer: ParamGatherer, module, args, output) -> None:
    gatherer.module_post()


def _partition_runs(units: List[Unit], dp_rank: int, tp_size: int, tp_rank: int):
    """Per unit, this rank's chunk cut into ``(start, end, decay, counts_for_norm)`` runs (partition coordinates).

    ``decay``: the elements are weight-decayed. ``counts_for_norm``: the
    gradient norm counts them on this rank (:func:`hybrid.param_meta.norm_ranges`:
    TP-replicated parameters are counted by TP rank 0 only; padding counts
    nowhere but is zero anyway).
    """
    runs = []
    for u in units:
        lo, hi = u.chunk_range(dp_rank)
        base = u.partition_offset - lo
        cut = min(max(u.decay_end, lo), hi)
        for a, b, decay in ((lo, cut, True), (cut, hi, False)):
            if a < b:
                runs.append((base + a, base + b, decay))
    norm_runs = []
    for u in units:
        lo, hi = u.chunk_range(dp_rank)
        base = u.partition_offset - lo
        for rec in u.records:
            for p_lo, p_hi in param_meta.norm_ranges(rec.tp_meta, rec.shape, tp_size, tp_rank):
                a, b = max(lo, rec.offset + p_lo), min(hi, rec.offset + p_hi)
                if a < b:
                    norm_runs.append((base + a, base + b))
    return runs, norm_runs


def _decoupled_runs(units: List[Unit], dp_rank: int) -> List[Tuple[int, int]]:
    """This rank's elements of the embedding and output weights (:func:`is_embedding_or_output`), as sorted
    ``(start, end)`` runs in partition coordinates: ``optimizer.decoupled_lr``'s groups."""
    out = []
    for u in units:
        lo, hi = u.chunk_range(dp_rank)
        base = u.partition_offset - lo
        for rec in u.records:
            a, b = max(lo, rec.offset), min(hi, rec.offset + rec.numel)
            if a < b and is_embedding_or_output(rec.name, None):
                out.append((base + a, base + b))
    return sorted(out)


def _cut_runs(runs, marked: List[Tuple[int, int]]):
    """``runs`` ``(start, end, decay)`` cut at the sorted, disjoint runs ``marked``: ``(start, end, decay, inside)``."""
    out = []
    for a, b, decay in runs:
        pos = a
        for m_a, m_b in marked:
            lo, hi = max(m_a, pos), min(m_b, b)
            if lo < hi:
                if pos < lo:
                    out.append((pos, lo, decay, False))
                out.append((lo, hi, decay, True))
                pos = hi
        if pos < b:
            out.append((pos, b, decay, False))
    return out


class Stage3Optimizer(ZeroOptimizer):
    """ZeRO stage 3: each DP rank keeps only its partition of the parameters.

    Besides the common arguments (:class:`~hybrid.zero.base.ZeroOptimizer`)
    it reads from the ``zero`` section ``persistence_threshold`` (parameters
    with at most this many elements stay whole on every rank),
    ``max_live_parameters`` (elements of gathered weights allowed at once) and
    ``prefetch_bucket_size`` (elements gathered ahead), ``max_reuse_distance``
    (forward keeps a unit used again within this many elements) and
    ``hpz_partition_size`` (hpZ: a secondary copy of the weights sharded over
    the node's ``l`` dp ranks, which backward re-gathers from; it must be
    ``l``, or 1 for off). ``verify_order``
    checks that every DP rank gathers units in the same order;
    ``partition_init(units, partition, topology)`` fills this rank's partition
    directly (sharded deferred initialisation of a model built on the meta
    device) instead of copying it out of the model.
    """

    def __init__(self, model: torch.nn.Module, topology, zero, optimizer, *, verify_order: bool = True,
                 partition_init=None, nested_in: Optional["Stage3Optimizer"] = None, **runtime):
        super().__init__(model, topology, zero, optimizer, **runtime)
        dp, self.part = topology.dp_size, topology.dp_rank
        self.partition_count = dp
        # nested_in: another Stage3Optimizer over the rest of the same model (the expert split's dense half);
        # this one's forward hooks run inside that one's (see _register_module_hooks)
        self._nested_in = nested_in

        self.units, self._frozen = build_units(model, dp, zero.persistence_threshold, self.decays,
                                               self.no_weight_decay, self.param_filter)
        biggest = max((u for u in self.units if not u.persistent), key=lambda u: u.numel, default=None)
        if biggest is not None and zero.max_live_parameters < biggest.numel:
            raise ZeroConfigError(f"max_live_parameters={zero.max_live_parameters} elements cannot hold module "
                                  f"{biggest.module_name!r} ({biggest.numel} elements when gathered); raise "
                                  f"zero.max_live_parameters (DeepSpeed: stage3_max_live_parameters) to at "
                                  f"least {biggest.numel}")
        self.dtype = self.units[0].params[0].dtype
        device = topology.device if partition_init is not None else next(
            p.device for u in self.units for p in u.params)
        self.device = device
        self.partition = torch.empty(partition_numel(self.units), dtype=self.dtype, device=device)
        if partition_init is not None:
            partition_init(self.units, self.partition, topology)  # sharded deferred init: only this rank's slice
        else:
            self._partition_from_model()
        chunks = [self.partition[u.partition_offset: u.partition_offset + u.chunk_numel] for u in self.units]
        self.order = OrderCheck(self.comm, enabled=verify_order)
        self.secondary = self._secondary_partition(zero.hpz_partition_size)
        self.gatherer = ParamGatherer(self.units, chunks, self.comm, self.order, zero.max_live_parameters,
                                      zero.prefetch_bucket_size, quant=self.weight_quant, secondary=self.secondary,
                                      reuse_numel=zero.max_reuse_distance,
                                      outer=None if nested_in is None else nested_in.gatherer)
        self._hooks = self._register_module_hooks()
        self._record_of = {rec.name: (u.index, r) for u in self.units for r, rec in enumerate(u.records)}
        self._name_of_param = {id(p): rec.name for u in self.units for rec, p in zip(u.records, u.params)}
        self.param_index = param_index(self.units, dp)

        host = host_device(self.offload_optimizer, device)
        self.reducer = Stage3GradReducer(self.units, self.comm, self.order, self.part, zero.bucket_size, self.dtype,
                                         device, host if host is not None else device, self.gatherer.release,
                                         self.gatherer.shape_for_grad, self.gatherer.unshape, quant=self.grad_quant,
                                         two_level=self.two_level)
        self.reducer.attach_hooks()
        self._decoupled = optimizer.decoupled_lr is not None  # the embedding and output weights' own rate
        self._setup_master(self.master_dtype, host)
        self._finish_setup()

    # ---- set-up ---------------------------------------------------------------------------------------
    def _partition_from_model(self) -> None:
        """Copy this rank's chunk of every unit out of the (whole, DP-rank-0-synchronised) parameters."""
        for u in self.units:
            full = torch.zeros(u.numel, dtype=self.dtype, device=self.partition.device)
            for rec, p in zip(u.records, u.params):
                full[rec.offset: rec.offset + rec.numel].copy_(p.detach().reshape(-1))
            self.comm.broadcast(full, "dp", src=0)
            lo, hi = u.chunk_range(self.part)
            self.partition[u.partition_offset: u.partition_offset + u.chunk_numel].copy_(full[lo:hi])
        for p in self._frozen:
            self.comm.broadcast(p.data, "dp", src=0)

    def _secondary_partition(self, size: int) -> Optional[SecondaryPartition]:
        """hpZ's secondary partition over ``dp_node`` (None when ``size`` is 1: off). Creating the node axes is
        collective: every rank builds the optimizer."""
        if size == 1:
            return None
        try:
            self.topology.enable_node_axes()
        except TopologyError as e:
            raise ZeroConfigError(f"zero.hpz_partition_size: {e}") from None
        problem = hpz_size_problem(size, self.topology.size("dp_node"))
        if problem:
            raise ZeroConfigError(problem)
        return SecondaryPartition(self.units, self.comm, self.dtype, self.device, size,
                                  self.topology.rank_in("dp_node"))

    def _setup_master(self, master_dtype: torch.dtype, host: Optional[torch.device]) -> None:
        runs, norm_runs = _partition_runs(self.units, self.part, self.topology.tp_size, self.topology.tp_rank)
        marked = _decoupled_runs(self.units, self.part) if self._decoupled else []
        master_device = host if host is not None else self.device
        self.aliased = master_dtype == self.dtype and master_device == self.device
        if self.aliased:
            self.master = self.partition
        else:
            pin = master_device.type == "cpu" and self.device.type == "cuda"
            self.master = torch.empty(self.partition.numel(), dtype=master_dtype, device=master_device,
                                      pin_memory=pin)
            self.master.copy_(self.partition)
        # the step writes the rounded weights here; a host staging copy when the partition is on an accelerator
        self.lowp = None if self.aliased else HostCopy(self.partition, master_device)
        grads = self.reducer.grads
        self._group_grads = []
        self._group_runs = []  # per inner group: its (start, end) runs of the partition, and whether it decays
        for decay, own_lr in ((True, False), (False, False), (True, True), (False, True)):
            sel = [(a, b) for a, b, d, o in _cut_runs(runs, marked) if d == decay and o == own_lr]
            if not sel:
                continue
            self._group_runs.append((sel, decay))
            self.inner.add_group([self.master[a:b] for a, b in sel], decay=decay,
                                 lowp=None if self.lowp is None else [self.lowp.host[a:b] for a, b in sel],
                                 state_device=master_device, decoupled_lr=own_lr)
            self._group_grads.append([grads[a:b] for a, b in sel])
        self._norm_views = [grads[a:b] for a, b in norm_runs]
        self._master_norm_views = [self.master[a:b] for a, b in norm_runs]  # the masters share the layout

    def _register_module_hooks(self) -> list:
        """Forward hooks gathering each unit around its module, and the root module's around the whole forward.

        A nested optimizer (``nested_in``) enters its forward after the other's and leaves it before (its root
        post-hook runs first), so that the saved-tensor hooks and the checkpoint early-stop switch each one
        enters are left in the reverse order."""
        unit_of_module = {u.module_name: u.index for u in self.units if not u.persistent}
        g = self.gatherer
        hooks = [g.watch_reads(self.model)]  # parameters read outside their module (tied, shared)
        for name, module in self.model.named_modules():
            unit = unit_of_module.get(name)
            if name == "":
                def root_pre(m, args, unit=unit):
                    g.enter_forward()
                    g.module_pre(unit)

                hooks.append(module.register_forward_pre_hook(root_pre))
                hooks.append(module.register_forward_hook(lambda m, a, o: g.exit_forward(),
                                                          prepend=self._nested_in is not None))
            elif unit is not None:
                hooks.append(module.register_forward_pre_hook(functools.partial(_gather_unit, g, unit)))
                hooks.append(module.register_forward_hook(functools.partial(_release_unit, g)))
        return hooks

    # ---- the training step ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _backward_phase(self, backward_pass: BackwardPass) -> Iterator[None]:
        """Every unit is re-gathered and reduce-scattered over ``dp`` on every micro-step (the partition
        holds no whole gradient to accumulate into)."""
        self.gatherer.exit_forward()  # in case the model's forward post-hook did not run
        self.gatherer.begin_phase("backward")
        self.reducer.begin_backward()
        try:
            yield
        finally:
            self.reducer.end_backward()
            self.gatherer.release_all()
            self.gatherer.end_phase()

    def _apply_update(self, factor: float) -> None:
        self.gatherer.reset()
        self.inner.step(self._group_grads, factor)
        if self.lowp is not None:
            self.lowp.to_device()
        # the next forward's first units start to travel while the persistent pool's gathers do
        self.gatherer.refresh_persistent(while_waiting=self.gatherer.prefetch_next_forward)

    def _global_sq(self) -> float:
        return world_sum(self.local_grad_sq(), self.topology)

    def local_grad_sq(self) -> torch.Tensor:
        """This rank's share of the squared gradient norm (a float64 scalar; no communication)."""
        return local_sq(self._norm_views, self.reducer.grads.device)

    def _grad_zeros(self) -> int:
        return int(world_sum(self.local_grad_zeros(), self.topology))

    def local_grad_zeros(self) -> torch.Tensor:
        """This rank's share of the whole gradient's exact zeros (a float64 scalar; no communication)."""
        return local_zeros(self._norm_views, self.reducer.grads.device)

    def _params_sq(self) -> float:
        return world_sum(self.local_params_sq(), self.topology)

    def local_params_sq(self) -> torch.Tensor:
        """This rank's share of the squared master-weight norm (a float64 scalar; no communication)."""
        return local_sq(self._master_norm_views, self.master.device)

    # ---- whole parameters on demand -------------------------------------------------------------------
    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Every parameter whole for the duration of the block (reading or exporting weights; not for training).

        All units are gathered at once, whatever ``max_live_parameters`` says
        (and without counting towards ``peak_live_parameters``); writes to
        the parameters inside the block are lost.
        """
        g = self.gatherer
        saved, g.max_live_numel = g.max_live_numel, float("inf")
        peak = g.peak_live_numel
        try:
            for u in self.units:
                g.ensure(u.index)
            yield
        finally:
            g.release_all()
            g.max_live_numel = saved
            g.peak_live_numel = peak

    # ---- reports ---------------------------------------------------------------------------------------
    def memory_report(self) -> Dict[str, int]:
        """Bytes this rank holds, by kind (as for stages 0-2, :class:`~hybrid.zero.flat.FlatZeroOptimizer`), plus
        stage-3 extras.

        ``params``: the parameter partition, whole persistent units and frozen
        parameters. ``gathered``: whole-unit buffers gathered (or in flight)
        right now; between steps, the next forward's first units, at most
        ``prefetch_bucket_size`` elements. ``master`` / ``optimizer_states``: fp32 masters (0
        when they are the parameters) and Adam moments, in host memory when
        offloaded. ``host_bytes``: what of ``total`` lives in host memory
        because of offload; ``device_bytes``: the rest. ``peak_live_parameters``
        (elements, not bytes, not in ``total``): the most gathered at once.
        ``secondary_params``: hpZ's secondary partition, ``1/l`` of the
        gathered units (0 when off).
        """
        el = self.partition.element_size()
        persistent = sum(self.gatherer.live[u.index].numel() for u in self.units if u.persistent) * el
        rep = {"params": self.partition.numel() * el + persistent
               + sum(p.numel() * p.element_size() for p in self._frozen)}
        rep["secondary_params"] = 0 if self.secondary is None else self.secondary.nbytes()
        held = self.reducer.bytes_held()
        rep["grads"] = held.pop("grads")
        rep["master"] = 0 if self.aliased else self.master.numel() * self.master.element_size()
        rep["optimizer_states"] = self.inner.state_bytes()
        rep["gathered"] = self.gatherer.live_numel * el
        rep.update(held)
        if self.lowp is not None:
            rep["lowp_staging"] = self.lowp.staging_bytes()
        rep["total"] = sum(rep.values())
        host = 0
        if self.offload_optimizer == "cpu":
            host = rep["master"] + rep["optimizer_states"] + rep.get("lowp_staging", 0)
            if self.reducer.grads.device != self.device:
                host += rep["grads"]
        rep["host_bytes"] = host
        rep["device_bytes"] = rep["total"] - host
        rep["peak_live_parameters"] = int(self.gatherer.peak_live_numel)
        return rep

    # ---- state ----------------------------------------------------------------------------------------
    def state_dict(self, lazy: bool = False) -> dict:
        """This rank's partition of the master weights and optimizer state, counters, and the parameter index.

        One flat group (index 0) in the partition layout of
        :mod:`hybrid.zero.stage3_layout`: ``master`` ([partition_numel] fp32,
        the live tensor) and each optimizer moment of the same shape (copies:
        the optimizer keeps decayed and undecayed elements apart; with
        ``lazy``, :class:`~hybrid.zero.assembled.AssembledTensor` of the live
        pieces instead). Every
        ``param_index`` entry has the ``parts`` of stages 1-2, so the
        checkpoint tools read and reshard it like any other. Collective-free.
        """
        moments = {}
        for name in self.inner.state_names:
            pieces = tuple((a, view) for (runs, _), group in zip(self._group_runs, self.inner.groups)
                           for (a, _b), view in zip(runs, group.views[name]))
            flat = AssembledTensor(self.master.numel(), self.master.dtype, self.master.device, pieces)
            moments[name] = assembled_or_copy(flat, lazy)
        group = {"dtype": dtype_name(self.dtype), "numel": sum(u.numel for u in self.units),
                 "partition_numel": self.partition.numel(),
                 "units": [[u.module_name, u.numel, u.used, u.decay_end] for u in self.units],
                 "master": self.master, **moments}
        return self._state_header([group])

    def load_state_dict(self, sd: dict) -> None:
        """Restore a state written by :meth:`state_dict` under the same layout (collective over ``dp``)."""
        self._check_state(sd)
        self.fence_writes()
        saved = sd["groups"][0]
        if saved["master"].numel() != self.master.numel():
            raise ValueError(f"the saved partition holds {saved['master'].numel()} elements, this rank's "
                             f"{self.master.numel()}; the model, persistence_threshold or DP size differ")
        groups = []
        for runs, _ in self._group_runs:
            groups.append({name: torch.cat([saved[name][a:b] for a, b in runs]) for name in self.inner.state_names
                           if name in saved})
        self.inner.load_state_dict({"kind": sd["optimizer"]["type"], "step": sd["step"],
                                    "lr": sd["optimizer"]["lr"], "groups": groups})
        with torch.no_grad():
            self.master.copy_(saved["master"])
        self._load_counters(sd)
        self.weights_loaded(from_master=True)

    # ---- whole weights in and out (checkpoints) ---------------------------------------------------------
    def parameter_name(self, tensor: torch.Tensor) -> Optional[str]:
        """The name a trainable parameter is recorded under (its first name when tied); None for other tensors."""
        return self._name_of_param.get(id(tensor))

    def parameter_shape(self, name: str) -> Tuple[int, ...]:
        """The whole (TP-local) shape of trainable parameter ``name``; its ``.data`` is empty between uses."""
        i, r = self._record_of[name]
        return self.units[i].records[r].shape

    def write_parameter(self, name: str, value: torch.Tensor) -> None:
        """Set trainable parameter ``name`` (its whole TP-local tensor) in this rank's partition.

        Call :meth:`weights_loaded` after the last one. Collective-free.
        """
        if name not in self._record_of:
            raise KeyError(f"{name!r} is not a trainable parameter of this ZeRO-3 model")
        self.fence_writes()
        i, r = self._record_of[name]
        u = self.units[i]
        rec = u.records[r]
        if tuple(value.shape) != rec.shape:
            raise ValueError(f"{name}: got shape {list(value.shape)}, the parameter has {list(rec.shape)}")
        flat = value.reshape(-1)
        with torch.no_grad():
            for k, start, end, at in u.pieces(self.part):
                if k == r:
                    dst = u.partition_offset + at
                    self.partition[dst: dst + end - start].copy_(flat[start:end])

    def weights_loaded(self, from_master: bool = False) -> None:
        """Make masters and parameters agree after a load and re-gather the persistent units (collective over ``dp``).

        ``from_master``: the masters were loaded (the weights are their
        rounded copies); otherwise the parameters were, and the masters
        follow them.
        """
        self.fence_writes()
        self.gatherer.reset()
        with torch.no_grad():
            if not self.aliased:
                if from_master:
                    self.partition.copy_(self.master)
                else:
                    self.master.copy_(self.partition)
        self.gatherer.refresh_persistent()

    def load_model_state(self, state: Dict[str, torch.Tensor]) -> None:
        """Load a whole-tensor ``model.state_dict()`` (this TP rank's shard) into the partitions and the model.

        Trainable parameters go to this rank's partition; buffers and frozen
        parameters into the module. Keys must match exactly. Collective over ``dp``.
        """
        self.fence_writes()
        own = dict(self.model.state_dict(keep_vars=True))
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise KeyError(f"model state does not match the model: missing {missing[:5]}, unexpected "
                           f"{unexpected[:5]}")
        rest = {}
        for key, tensor in own.items():
            if id(tensor) in self._foreign:
                continue  # another optimizer's parameter (the expert split's other half) loads it
            name = self._name_of_param.get(id(tensor))
            if name is None:
                rest[key] = state[key]
            elif key == name:
                self.write_parameter(name, state[key])
        self.model.load_state_dict(rest, strict=False)
        self.weights_loaded()

    model_state_is_copy = True  # gathered unit by unit into host copies

    def model_state_for_save(self, dst_dp_rank: int = 0) -> Optional[Dict[str, torch.Tensor]]:
        """``model.state_dict()`` with whole tensors, as CPU copies on DP rank ``dst_dp_rank``; None elsewhere.

        Units are gathered one at a time over ``dp`` (every DP rank must
        call this); the destination keeps a host copy of this TP rank's
        model shard, so its host memory must hold the shard once.
        """
        keep = self.part == dst_dp_rank
        whole: Dict[int, torch.Tensor] = {}
        g = self.gatherer
        g.reset()
        for u in self.units:
            if not u.persistent:
                g.ensure(u.index)
            if keep:
                for p in u.params:
                    whole[id(p)] = p.detach().to("cpu", copy=True)
            if not u.persistent:
                g.release(u.index)
        if not keep:
            return None
        return {key: whole[id(t)] if id(t) in whole else t.detach().to("cpu", copy=True)
                for key, t in self.model.state_dict(keep_vars=True).items()}

    def remove_hooks(self) -> None:
        self.gatherer.detach()  # the next forward's gathers, started at the end of the last step
        self.reducer.remove_hooks()
        for h in self._hooks:
            h.remove()
        self._hooks = []
