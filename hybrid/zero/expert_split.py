"""ZeRO for a Mixture-of-Experts model under expert parallelism: dense parameters over ``dp``, experts over ``edp``.

With expert parallelism (``ep > 1``) the ``ep`` consecutive ranks of a ``dp``
group share out the experts of every MoE layer, so an expert parameter
(:func:`hybrid.param_meta.is_expert`) has copies only on the ``dp / ep`` ranks
of its ``edp`` group. Its gradient is reduced, and its master weights and
moments partitioned, over ``edp``; everything else over ``dp``.

:class:`ExpertSplitOptimizer` does that with two optimizers of the same
stage over the same model, each limited to its parameters by a filter
(``params``, :class:`~hybrid.zero.base.ZeroOptimizer`): the *dense* one over
the topology, the *expert* one over :meth:`hybrid.topology.Topology.expert_data_view`,
a topology whose ``dp`` axis is ``edp`` (its collectives share the one
communicator and are counted under ``edp``). Everything a ZeRO stage does
(buckets, partitions, offload, stage 3's gathers) is then the stage's own
code, once per half. The split adds only what spans both halves:

* **one step.** The shared step of :class:`~hybrid.zero.base.ZeroOptimizer`
  runs once, here: the overflow check and the clip coefficient come from ONE
  global norm (each half adds its share of the squares, counting each element
  once: dense ones once per ``dp`` group, expert ones once per ``edp`` group,
  and different ``ep`` ranks hold different experts; one all-reduce over
  ``world`` sums both), and both halves step with the same factor.
* **one denominator.** Gradients are divided by ``loss_scale * dp`` with the
  *full* ``dp`` for both halves: an expert's gradient summed over ``edp``
  already holds the contributions of every ``dp`` rank's tokens, since the
  dispatch all-to-all over ``ep`` brought each rank's tokens to the expert's
  owner.
* **one state.** :meth:`state_dict` holds both halves' states (format
  :data:`STATE_FORMAT`); see there.

At ``ep = 1`` every rank holds every expert and ``edp`` is ``dp``: the factory
builds a plain optimizer (:func:`hybrid.zero.build_zero_optimizer`).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from hybrid.compression import ONE_BIT_OPTIMIZERS
from hybrid.layout import STAGE_TRAITS
from hybrid.param_meta import is_expert
from hybrid.zero.base import BackwardPass, ZeroOptimizer
from hybrid.zero.flat import FlatZeroOptimizer
from hybrid.zero.flat_buffer import ZeroConfigError
from hybrid.zero.grad_norm import world_sum
from hybrid.zero.stage3 import Stage3Optimizer

STATE_FORMAT = "hybrid.zero.experts/1"
# The key marking an expert entry of metadata.json's parameter index: the ep rank whose files hold its state.
EP_RANK_KEY = "ep_rank"
_STAGE3_ONLY = ("verify_order", "partition_init")


def has_expert_parameters(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is an expert parameter (:func:`hybrid.param_meta.is_expert`), trainable
    or frozen: a frozen one must not be synchronised over ``dp`` either."""
    return any(is_expert(p) for p in model.parameters())


def _dense(name: str, p: torch.nn.Parameter) -> bool:
    return not is_expert(p)


def _expert(name: str, p: torch.nn.Parameter) -> bool:
    return is_expert(p)


def expert_split_problem(zero, optimizer) -> Optional[str]:
    """Why the ZeRO and optimizer sections cannot split expert parameters over ``edp`` (expert parallelism),
    as one line naming the key; None when they can."""
    if zero.two_level_reduce:
        return ("zero.two_level_reduce: the two-level reduction splits the dp group by node; the expert "
                "parameters' edp group has no such split yet; leave it off with expert parallelism")
    if zero.hpz_partition_size != 1:
        return (f"zero.hpz_partition_size = {zero.hpz_partition_size}: the secondary partition is laid out over the "
                f"node's dp ranks, which the expert parameters' edp group does not follow yet; set it to 1 with "
                f"expert parallelism")
    if optimizer.type in ONE_BIT_OPTIMIZERS:
        return (f"optimizer.type = {optimizer.type!r}: the 1-bit optimizers' compressed exchange and error "
                f"feedback run over one dp group, not dp and edp together yet; use adamw with expert parallelism")
    return None


def mixed_modules(model: torch.nn.Module) -> List[str]:
    """Modules whose own parameters (``module._parameters``) include both expert and dense trainable ones."""
    out = []
    for name, module in model.named_modules():
        kinds = {is_expert(p) for p in module._parameters.values() if p is not None and p.requires_grad}
        if len(kinds) > 1:
            out.append(name or "<root>")
    return out


def expert_index_entries(records: Sequence[dict], ep_rank: int) -> List[dict]:
    """The ``metadata.json`` entries of one ep rank's expert records (``ParamRecord.to_json``).

    Each is the record as the expert half of ep rank ``ep_rank`` keeps it (TP-local ``shape``, ``dtype``,
    ``tp_meta``, ``weight_decay``; ``group``, ``segment``, ``offset``, ``parts`` and ``position`` in that half's
    flat groups) plus :data:`EP_RANK_KEY`: its partition ``part`` lives in the optimizer file of DP rank
    ``part * ep + ep_rank`` (:func:`expert_file_dp_rank`), under the state's ``"expert"`` sub-state."""
    return [dict(r, **{EP_RANK_KEY: ep_rank}) for r in records]


def is_expert_entry(entry: dict) -> bool:
    """Whether a ``metadata.json`` index entry describes an expert of an expert-parallel checkpoint (its
    optimizer state in the ``"expert"`` sub-states); dense entries and every entry of an ``ep = 1``
    checkpoint are read as before."""
    return EP_RANK_KEY in entry


def expert_file_dp_rank(part: int, ep_rank: int, ep_size: int) -> int:
    """The DP rank whose optimizer file holds partition ``part`` (an ``edp`` rank) of ep rank ``ep_rank``'s
    experts: the ``ep`` consecutive DP ranks of an ``edp`` position share out the experts (:mod:`hybrid.grid`)."""
    return part * ep_size + ep_rank


class ExpertSplitOptimizer(ZeroOptimizer):
    """The ZeRO optimizer of an MoE model under expert parallelism (see the module docstring).

    Same arguments as the stage's optimizer (:class:`~hybrid.zero.base.ZeroOptimizer`); ``dense`` and
    ``expert`` are the two halves (a :class:`~hybrid.zero.flat.FlatZeroOptimizer` or
    :class:`~hybrid.zero.stage3.Stage3Optimizer` each), over ``dp`` and over ``edp``.
    """

    def __init__(self, model: torch.nn.Module, topology, zero, optimizer, **runtime):
        problem = expert_split_problem(zero, optimizer)
        if problem is not None:
            raise ZeroConfigError(problem)
        if runtime.get("params") is not None:
            raise ZeroConfigError("params: the expert split chooses each half's parameters itself")
        if not any(p.requires_grad and is_expert(p) for p in model.parameters()):
            raise ZeroConfigError("expert parallelism with every expert parameter frozen (requires_grad=False) is "
                                  "not supported yet: train at least one expert weight, or run at ep = 1")
        # stage 3's own arguments go to the halves only
        super().__init__(model, topology, zero, optimizer,
                         **{k: v for k, v in runtime.items() if k not in _STAGE3_ONLY})
        stage3 = STAGE_TRAITS[self.stage].parameters
        if not stage3 and any(k in runtime for k in _STAGE3_ONLY):
            raise ZeroConfigError(f"{sorted(k for k in runtime if k in _STAGE3_ONLY)}: arguments of ZeRO stage 3, "
                                  f"not of stage {int(self.stage)}")
        if stage3 or zero.overlap_param_gather:
            # Stage 3 gathers a module's own parameters together, and both it and overlap_param_gather watch
            # the reads of a module's parameters with one watcher per module: a module must belong to one half.
            mixed = mixed_modules(model)
            if mixed:
                key = "zero.stage = 3" if stage3 else "zero.overlap_param_gather"
                raise ZeroConfigError(f"{key} with expert parallelism needs each module's own parameters to be all "
                                      f"expert or all dense, but {', '.join(mixed[:3])} hold both; keep expert "
                                      f"weights in modules of their own (as model_zoo's experts.{{e}}.in_proj)")
        # the halves run no step of their own: the loss scale and clipping are applied here, once
        sub = dict(runtime, loss_scaler=None, clip_grad=0.0)
        cls = Stage3Optimizer if stage3 else FlatZeroOptimizer
        self.dense: ZeroOptimizer = cls(model, topology, zero, optimizer, params=_dense, **sub)
        extra = {"nested_in": self.dense} if stage3 else {}
        self.expert: ZeroOptimizer = cls(model, topology.expert_data_view(), zero, optimizer, params=_expert,
                                         **sub, **extra)
        self.halves: Tuple[ZeroOptimizer, ZeroOptimizer] = (self.dense, self.expert)
        self.partition_count, self.part = self.dense.partition_count, self.dense.part
        # The records this optimizer steps (the engine's reshard and load checks walk them): the dense half's
        # on every rank of the stage, then this ep rank's experts'.
        self.param_index = list(self.dense.param_index) + list(self.expert.param_index)
        self.model_state_is_copy = self.dense.model_state_is_copy
        self._expert_keys = {key for key, t in model.state_dict(keep_vars=True).items()
                             if isinstance(t, torch.nn.Parameter) and is_expert(t)}
        # What metadata.json records (one index per pipeline stage, the same on every rank of the stage): the
        # dense half's records, then every ep rank's expert records (expert_index_entries), gathered once here
        # with the expert names the other ep ranks hold (a model file holds them all).
        mine = {"keys": sorted(self._expert_keys), "ep_rank": self.topology.ep_rank,
                "index": [r.to_json() for r in self.expert.param_index]}
        shared = sorted(self.comm.all_gather_object(mine, "ep"), key=lambda m: m["ep_rank"])
        self._other_expert_keys = set().union(*(m["keys"] for m in shared)) - self._expert_keys
        self.saved_index: List[dict] = [r.to_json() for r in self.dense.param_index] + [
            e for m in shared for e in expert_index_entries(m["index"], m["ep_rank"])]
        self._finish_setup()

    # ---- the training step ----------------------------------------------------------------------------
    def set_chunks(self, chunks: int, chunk_params: Optional[Sequence[Sequence[torch.nn.Parameter]]] = None) -> None:
        super().set_chunks(chunks, chunk_params)
        for half in getattr(self, "halves", ()):
            half.set_chunks(chunks, chunk_params)

    @contextlib.contextmanager
    def _backward_phase(self, backward_pass: BackwardPass) -> Iterator[None]:
        """Both halves' reducers armed for the pass: dense gradients reduce over ``dp``, expert ones over
        ``edp``, each as its stage does."""
        with self.dense._backward_phase(backward_pass), self.expert._backward_phase(backward_pass):
            yield

    def _wait_for_gradients(self) -> None:
        for half in self.halves:
            half._wait_for_gradients()

    def _sum_tied_gradients(self) -> None:
        for half in self.halves:
            half._sum_tied_gradients()

    def _world_sum(self, dense: torch.Tensor, expert: torch.Tensor) -> float:
        """Both halves' shares added on this rank, then ONE all-reduce over ``world``."""
        device = self.topology.device
        return world_sum(dense.to(device) + expert.to(device), self.topology)

    def _global_sq(self) -> float:
        return self._world_sum(self.dense.local_grad_sq(), self.expert.local_grad_sq())

    def _grad_zeros(self) -> Optional[int]:
        return int(self._world_sum(self.dense.local_grad_zeros(), self.expert.local_grad_zeros()))

    def _params_sq(self) -> float:
        return self._world_sum(self.dense.local_params_sq(), self.expert.local_params_sq())

    def _apply_update(self, factor: float) -> None:
        """Both halves step with the same factor (the clip coefficient over ``loss_scale * dp``, full ``dp``)
        at the learning rate and weight decay the shared step set here."""
        for half in self.halves:
            half.inner.lr, half.inner.weight_decay = self.inner.lr, self.inner.weight_decay
            half.inner.decoupled_lr = self.inner.decoupled_lr
            half._apply_update(factor)

    def zero_grad(self) -> None:
        for half in self.halves:
            half.zero_grad()

    def wait_for_weights(self) -> None:
        for half in getattr(self, "halves", ()):
            half.wait_for_weights()

    def weights_finite(self) -> bool:
        """As :meth:`ZeroOptimizer.weights_finite`, over both halves' partitions (one all-reduce over ``world``)."""
        self.wait_for_weights()
        with torch.no_grad():
            local = all(bool(torch.isfinite(t).all())
                        for half in self.halves for group in half.inner.groups
                        for t in list(group.masters) + list(group.lowp or ()))
        flag = torch.tensor([0.0 if local else 1.0], device=self.topology.device)
        self.comm.all_reduce(flag, "world", op="max")
        return flag.item() == 0.0

    # ---- reports ---------------------------------------------------------------------------------------
    def memory_report(self) -> Dict[str, int]:
        """Both halves' bytes added by kind (``peak_live_parameters`` of stage 3: the sum of both halves' peaks,
        an upper bound of the peak of both together)."""
        dense, expert = self.dense.memory_report(), self.expert.memory_report()
        return {k: dense.get(k, 0) + expert.get(k, 0) for k in {**dense, **expert}}

    def num_parameters(self) -> int:
        return self.dense.num_parameters() + self.expert.num_parameters()

    @contextlib.contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        with self.dense.gathered_parameters(), self.expert.gathered_parameters():
            yield

    # ---- state -----------------------------------------------------------------------------------------
    def state_dict(self, lazy: bool = False) -> dict:
        """Both halves' states and where this rank sits.

        ``{"format": STATE_FORMAT, "dense": ..., "expert": ..., "param_index": ...}``: ``dense`` and
        ``expert`` are the halves' own states (:meth:`FlatZeroOptimizer.state_dict
        <hybrid.zero.flat.FlatZeroOptimizer.state_dict>` or stage 3's), ``dense`` less its ``param_index``.
        The top-level ``param_index`` (the engine keeps it in ``metadata.json``, one per pipeline stage, the
        same on every rank of the stage) is the dense half's records followed by every ep rank's expert
        records (:func:`expert_index_entries`: where each expert's partitions lie). The expert half's own
        index (this ep rank's experts) also stays in its state. ``ep_size``, ``ep_rank``,
        ``edp_size``, ``edp_rank`` say which experts (``ep_rank``) and which partition of them (``edp_rank``)
        the state holds. The counters and the loss scaler are the top-level ones (the halves run no step of
        their own). Collective-free (the other ep ranks' records were gathered at construction).
        """
        dense = self.dense.state_dict(lazy)
        dense.pop("param_index")
        index = [dict(e) for e in self.saved_index]
        topo = self.topology
        view = self.expert.topology
        return {"format": STATE_FORMAT, "stage": int(self.stage), "dense": dense,
                "expert": self.expert.state_dict(lazy), "param_index": index,
                "dp_size": topo.dp_size, "dp_rank": topo.dp_rank, "tp_size": topo.tp_size, "tp_rank": topo.tp_rank,
                "ep_size": topo.ep_size, "ep_rank": topo.ep_rank, "edp_size": view.dp_size, "edp_rank": view.dp_rank,
                "global_steps": self.global_steps, "skipped_steps": self.skipped_steps,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None}

    def load_state_dict(self, sd: dict) -> None:
        """Restore what :meth:`state_dict` wrote under the same layout (same ``ep`` and ``edp`` position)."""
        if not isinstance(sd, dict) or sd.get("format") != STATE_FORMAT:
            found = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
            raise ValueError(f"not an expert-parallel ZeRO optimizer state (format {found!r}, expected "
                             f"{STATE_FORMAT!r}); a state saved without expert parallelism needs resharding")
        topo, view = self.topology, self.expert.topology
        saved = (sd["ep_size"], sd["ep_rank"], sd["edp_size"], sd["edp_rank"])
        mine = (topo.ep_size, topo.ep_rank, view.dp_size, view.dp_rank)
        if saved != mine:
            raise ValueError(f"state was saved by ep rank {saved[1]} of {saved[0]}, edp rank {saved[3]} of "
                             f"{saved[2]}, but this rank is ep rank {mine[1]} of {mine[0]}, edp rank {mine[3]} of "
                             f"{mine[2]}; reshard the checkpoint first")
        self.fence_writes()
        # metadata.json's index holds the dense records and every ep rank's experts' (checkpoints saved before
        # the experts were indexed there: the dense ones alone); the dense half checks its own
        dense_index = [e for e in sd["param_index"] if not is_expert_entry(e)]
        self.dense.load_state_dict({**sd["dense"], "param_index": dense_index})
        self.expert.load_state_dict(sd["expert"])
        self._load_counters(sd)

    def index_mismatch(self, saved: Sequence[dict]) -> Optional[str]:
        """A ``metadata.json`` index (:meth:`state_dict`'s ``param_index``) against both halves: its dense
        entries against the dense half's index, this ep rank's expert entries against the expert half's. An
        index without expert entries (saved before they were recorded there) is checked for its dense part;
        the expert half's own index is checked when its state loads."""
        dense = [e for e in saved if not is_expert_entry(e)]
        problem = self.dense.index_mismatch(dense)
        experts = [e for e in saved if is_expert_entry(e)]
        if problem is None and experts:
            # (called where the saved layout is this one: the same ep size)
            mine = [{k: v for k, v in e.items() if k != EP_RANK_KEY} for e in experts
                    if e[EP_RANK_KEY] == self.topology.ep_rank]
            if not mine:
                return f"the checkpoint holds no expert state for ep rank {self.topology.ep_rank}"
            problem = self.expert.index_mismatch(mine)
        return problem

    @property
    def other_expert_keys(self) -> frozenset:
        """The names of the expert weights the other ep ranks of this rank's group hold (not in this module)."""
        return frozenset(self._other_expert_keys)

    # ---- whole weights in and out ----------------------------------------------------------------------
    def model_state_for_save(self) -> Optional[Dict[str, torch.Tensor]]:
        """``model.state_dict()`` with the experts of EVERY ep rank, as one process holding the whole model (this
        TP and pipeline shard) would write it; on DP rank 0, the one that writes the model file.

        Every rank must call it: under stage 3 both halves gather their units (over ``dp`` and ``edp``), and
        the other ranks of DP rank 0's ``ep`` group (``edp`` rank 0) send it their experts
        (:meth:`_experts_to_dp_rank_0`). So a model file is the same at every ``ep`` size, and a weights-only
        load finds each rank's experts in it (:meth:`load_model_state`). Other ranks get their own shard
        (stages 0-2: what the file does not need) or None (stage 3).
        """
        dense = self.dense.model_state_for_save()
        expert = self.expert.model_state_for_save()
        if self.expert.topology.dp_rank != 0:
            return dense  # not in DP rank 0's ep group: no file takes these experts from here
        if expert is None:
            raise AssertionError("edp rank 0 must hold its experts' whole weights")
        others = self._experts_to_dp_rank_0({k: expert[k] for k in sorted(self._expert_keys)})
        if others is None or dense is None:
            return dense
        merged = {k: v for k, v in dense.items() if k not in self._expert_keys}
        merged.update({k: expert[k].detach().to("cpu", copy=True) for k in self._expert_keys})
        merged.update(others)
        return merged

    def _experts_to_dp_rank_0(self, mine: Dict[str, torch.Tensor]) -> Optional[Dict[str, torch.Tensor]]:
        """Ep rank 0 of this ``ep`` group (DP rank 0) receives every other ep rank's expert weights ``mine``
        (name -> whole tensor) as host copies and returns them; the others send theirs and return None.

        Their names, shapes and dtypes go first (an object all-gather over ``"ep"``: metadata only), then each
        tensor as one message to ep rank 0 (send/recv over ``"ep"``, in name order). Only the writer holds the
        other ranks' experts, and one tensor at a time is in flight on the device."""
        meta = [(k, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in mine.items()]
        shared = self.comm.all_gather_object(meta, "ep")
        device = self.topology.device
        if self.topology.ep_rank != 0:
            for key in mine:
                self.comm.send(mine[key].detach().to(device).contiguous(), "ep", dst=0)
            return None
        received = {}
        for src, entries in enumerate(shared):
            if src == 0:
                continue
            for key, shape, dtype in entries:
                buf = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                self.comm.recv(buf, "ep", src=src)
                received[key] = buf.cpu()  # the buffer itself on a CPU run
        return received

    def load_model_state(self, state: Dict[str, torch.Tensor]) -> None:
        """Load a whole-model ``state_dict`` of this TP and pipeline shard (:meth:`model_state_for_save`: every
        ep rank's experts): this rank takes its own experts and the dense weights; both halves' masters follow.
        A state without the other ep ranks' experts (one rank's ``model.state_dict()``) loads as well."""
        self.fence_writes()
        state = {k: v for k, v in state.items() if k not in self._other_expert_keys}
        if STAGE_TRAITS[self.stage].parameters:
            for half in self.halves:
                half.load_model_state(state)  # each writes its own parameters, both the buffers
        else:
            self.dense.load_model_state(state)  # the whole module
            self.expert.weights_loaded()

    def weights_loaded(self, from_master: bool = False) -> None:
        self.fence_writes()
        for half in self.halves:
            half.weights_loaded(from_master)

    def _half_holding(self, name: str) -> ZeroOptimizer:
        for half in self.halves:
            if name in getattr(half, "_record_of", ()):
                return half
        raise KeyError(f"{name!r}: this optimizer holds no parameters outside the module")

    def parameter_name(self, tensor: torch.Tensor) -> Optional[str]:
        return self.dense.parameter_name(tensor) or self.expert.parameter_name(tensor)

    def parameter_shape(self, name: str) -> Tuple[int, ...]:
        return self._half_holding(name).parameter_shape(name)

    def write_parameter(self, name: str, value: torch.Tensor) -> None:
        self.fence_writes()
        self._half_holding(name).write_parameter(name, value)

    def remove_hooks(self) -> None:
        for half in (self.expert, self.dense):
            half.remove_hooks()
