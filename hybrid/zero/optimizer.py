"""ZeroOptimizer: ZeRO stages 0-2 over the DP group of a Topology.

One object owns the whole update path of a model replica (one TP shard):

* the flat buffers the parameters live in (:mod:`hybrid.zero.flat_buffer`);
* the gradient reducer that runs during backward (:mod:`hybrid.zero.buckets`);
* this rank's master partition (:mod:`hybrid.zero.partition`);
* the inner AdamW/Adam/SGD (:mod:`hybrid.zero.inner`);
* the global gradient norm, overflow decision and clipping (:mod:`hybrid.zero.grad_norm`);
* the loss scale (:class:`~hybrid.zero.loss_scaler.LossScaler`).

Usage per global batch (``gradient_accumulation_steps`` micro-batches)::

    for micro_batch in global_batch_slice_of_this_dp_rank:
        opt.backward(model(micro_batch))   # loss: mean over the micro-batch
    opt.step(lr)                           # False when skipped (non-finite grads)
    opt.zero_grad()

The update equals one process training on the whole global batch: gradients
are summed over micro-steps (each scaled by 1/accumulation) and over ``dp``,
then multiplied by ``1/(loss_scale * dp)`` and the clip coefficient -- one
factor, applied inside the optimizer kernel.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional

import torch

from hybrid.topology import Topology
from hybrid.zero.buckets import FullGradReducer, PartitionedGradReducer
from hybrid.zero.flat_buffer import (ParamRecord, ZeroConfigError, build_flat_groups, collect_trainable,
                                     dtype_name)
from hybrid.zero.grad_norm import GradNorm, clip_factor
from hybrid.zero.inner import InnerOptimizer
from hybrid.zero.loss_scaler import LossScaler
from hybrid.zero.offload import OFFLOAD_CHOICES, ChunkOffload, host_device
from hybrid.zero.partition import GroupPartition

STATE_FORMAT = "hybrid.zero/1"
SUPPORTED_STAGES = (0, 1, 2, 3)


def _check_args(stage, bucket_size, gradient_accumulation_steps, clip_grad, master_dtype, topology,
                loss_scaler, offload_optimizer="none") -> None:
    if stage not in SUPPORTED_STAGES:
        raise ZeroConfigError(f"unknown ZeRO stage {stage!r}; zero_optimization.stage must be 0, 1, 2 or 3")
    if offload_optimizer not in OFFLOAD_CHOICES:
        raise ZeroConfigError(f"offload_optimizer must be one of {', '.join(OFFLOAD_CHOICES)}, got "
                              f"{offload_optimizer!r} (config key zero.offload_optimizer)")
    if offload_optimizer != "none" and stage == 0:
        raise ZeroConfigError("offload_optimizer='cpu' needs ZeRO stage 1, 2 or 3 (stage 0 keeps no partitioned "
                              "optimizer state to offload); raise zero.stage or set zero.offload_optimizer to none")
    if not isinstance(bucket_size, int) or bucket_size < 1:
        raise ZeroConfigError(f"bucket_size must be a positive number of elements, got {bucket_size!r} "
                              f"(config key zero_optimization.reduce_bucket_size)")
    if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
        raise ZeroConfigError(f"gradient_accumulation_steps must be an integer >= 1, got "
                              f"{gradient_accumulation_steps!r}")
    if clip_grad < 0:
        raise ZeroConfigError(f"clip_grad must be >= 0 (0 disables clipping), got {clip_grad} "
                              f"(config key gradient_clipping)")
    if not (isinstance(master_dtype, torch.dtype) and master_dtype.is_floating_point):
        raise ZeroConfigError(f"master_dtype must be a floating-point torch.dtype, got {master_dtype!r}")
    if not isinstance(topology, Topology):
        raise ZeroConfigError(f"topology must be a hybrid.Topology, got {type(topology).__name__}")
    if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
        raise ZeroConfigError(f"loss_scaler must be a hybrid.zero.LossScaler or None, got "
                              f"{type(loss_scaler).__name__}")


class ZeroOptimizer:
    """ZeRO optimizer for ``model`` (already in its training dtype) over ``topology``'s DP group.

    ``stage``: 0 = plain data parallel (bucketed all-reduce); 1 = master
    weights and optimizer state partitioned over DP; 2 = gradients partitioned
    too; 3 = parameters partitioned too (built as :class:`~hybrid.zero.stage3.Stage3Optimizer`,
    which takes extra arguments). ``offload_optimizer="cpu"`` (stages 1-3)
    keeps master weights and optimizer state in host memory. See the module
    docstring and ``docs/zero.md``.
    """

    def __new__(cls, *args, stage: int = 0, **kwargs):
        if stage == 3 and cls is ZeroOptimizer:
            from hybrid.zero.stage3 import Stage3Optimizer

            return super().__new__(Stage3Optimizer)
        return super().__new__(cls)

    def __init__(self, model: torch.nn.Module, topology: Topology, *, stage: int = 0,
                 optimizer: str = "adamw", lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, momentum: float = 0.0,
                 no_weight_decay: Optional[Callable[[str, torch.nn.Parameter], bool]] = None,
                 bucket_size: int = 25_000_000, overlap_comm: bool = True,
                 master_dtype: torch.dtype = torch.float32, loss_scaler: Optional[LossScaler] = None,
                 clip_grad: float = 0.0, gradient_accumulation_steps: int = 1,
                 use_fused_kernels: bool = True, offload_optimizer: str = "none"):
        _check_args(stage, bucket_size, gradient_accumulation_steps, clip_grad, master_dtype, topology,
                    loss_scaler, offload_optimizer)
        self.inner = InnerOptimizer(optimizer, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                    momentum=momentum, use_kernels=use_fused_kernels)
        self.model = model
        self.topology = topology
        self.comm = topology.comm
        self.stage = stage
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.clip_grad = float(clip_grad)
        self.loss_scaler = loss_scaler
        self.use_fused_kernels = use_fused_kernels
        dp = topology.dp_size
        self.partition_count = 1 if stage == 0 else dp
        self.part = 0 if stage == 0 else topology.dp_rank

        self.groups = build_flat_groups(model, self.partition_count, dp, bucket_size,
                                        weight_decay > 0, no_weight_decay)
        self.param_index: List[ParamRecord] = sorted((r for g in self.groups for r in g.records),
                                                     key=lambda r: r.position)
        self._frozen = collect_trainable(model)[1]
        self._sync_replicas()
        self.offload_optimizer = offload_optimizer
        host = host_device(offload_optimizer, self.groups[0].device)
        self.partitions = [GroupPartition(g, self.part, master_dtype, master_device=host) for g in self.groups]
        if stage == 2:
            self.reducer = PartitionedGradReducer(self.groups, self.comm, topology.dp_rank, overlap_comm)
        else:
            self.reducer = FullGradReducer(self.groups, self.comm, topology.dp_rank, overlap_comm,
                                           scatter=stage == 1)
        self.reducer.attach_hooks()
        self._grad_chunks = [self.reducer.grad_chunks(g.index, self.part) for g in self.groups]
        # offload: host twins of the reduced gradients and rounded weights (the same tensors on a CPU model)
        self._offload = [ChunkOffload(gc, part.param_chunks, host) for gc, part in
                         zip(self._grad_chunks, self.partitions)] if host is not None else []
        if any(not off.same for off in self._offload):
            self.reducer.on_final = lambda g, s: self._offload[g].grad_to_host(s)
        for k, (g, part) in enumerate(zip(self.groups, self.partitions)):
            lowp = part.param_chunks if not self._offload else self._offload[k].lowp
            self.inner.add_group(part.master_chunks, decay=g.weight_decay, lowp=None if part.aliased else lowp,
                                 state_device=host)
        self.grad_norm = GradNorm(self.groups, self._grad_chunks, topology, self.part,
                                  counts_whole_gradient=stage != 0)

        self.global_steps = 0  # step() calls, skipped ones included
        self.skipped_steps = 0
        self._micro = 0  # backward() calls since the last step()
        self._last_grad_norm = math.nan
        self._last_comm: Dict[str, Dict[str, float]] = {}
        self.comm.reset_stats()

    # ---- set-up ----------------------------------------------------------------------
    def _sync_replicas(self) -> None:
        """Make every DP replica start from DP rank 0's weights (one broadcast per flat group)."""
        for g in self.groups:
            self.comm.broadcast(g.buffer, "dp", src=0)
        for p in self._frozen:
            self.comm.broadcast(p.data, "dp", src=0)

    # ---- the training step ---------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def lr(self) -> float:
        return self.inner.lr

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's mean loss, scaled by ``loss_scale / accumulation``.

        Gradient buckets are reduced over ``dp`` as they fill: on the last
        micro-step of the global batch for stages 0-1, on every micro-step for
        stage 2.
        """
        gas = self.gradient_accumulation_steps
        if self._micro >= gas:
            raise RuntimeError(f"backward() was called {self._micro + 1} times since the last step(), but "
                               f"gradient_accumulation_steps={gas}; call step() once every {gas} micro-batches")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("backward() expects the scalar (mean) loss of one micro-batch, got "
                             f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else list(loss.shape)}")
        factor = self.loss_scale / gas
        self.reducer.begin_backward(reduce_now=self._micro == gas - 1)
        (loss * factor if factor != 1.0 else loss).backward()
        self.reducer.end_backward()
        self._micro += 1

    def _begin_step(self, lr: Optional[float]) -> None:
        """Check the accumulation count, set the learning rate and wait for the gradient reductions."""
        gas = self.gradient_accumulation_steps
        if self._micro != gas:
            raise RuntimeError(f"step() after {self._micro} backward() calls, but gradient_accumulation_steps="
                               f"{gas}; call backward() once per micro-batch and step() every {gas}")
        if lr is not None:
            if lr < 0:
                raise ValueError(f"learning rate must be >= 0, got {lr}")
            self.inner.lr = float(lr)
        self.reducer.wait()

    def step(self, lr: Optional[float] = None) -> bool:
        """Apply the update of one global batch; returns False when it was skipped.

        A step is skipped when any gradient element anywhere in the world is
        inf or NaN (fp16 overflow, or a diverging bf16/fp32 run); the loss
        scaler then lowers the scale. ``lr`` sets the learning rate from now on.
        """
        self._begin_step(lr)
        denominator = self.loss_scale * self.topology.dp_size
        sq = self._global_sq()
        overflow = not math.isfinite(sq)
        self._last_grad_norm = math.sqrt(sq) / denominator if not overflow else sq
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        self.global_steps += 1
        self._micro = 0
        if overflow:
            self.skipped_steps += 1
        else:
            self._apply_update(clip_factor(self._last_grad_norm, self.clip_grad) / denominator)
        self._last_comm = self.comm.report()
        self.comm.reset_stats()
        return not overflow

    def _global_sq(self) -> float:
        """Squared L2 norm of the (scaled, DP-summed) gradient over the whole world."""
        return self.grad_norm.global_sq()

    def _apply_update(self, factor: float) -> None:
        """The inner optimizer step with gradients multiplied by ``factor``, then the new weights published."""
        if self._offload:
            for off in self._offload:
                off.grads_to_host()
            self.inner.step([off.grads for off in self._offload], factor)
            for off in self._offload:
                off.params_to_device()
        else:
            self.inner.step(self._grad_chunks, factor)
        self._publish_params()

    def _publish_params(self, write: bool = False) -> None:
        """Make every rank's model hold the updated weights.

        The inner step already rounded the masters into this rank's parameter
        chunks; ``write`` does it here instead (after loading a state).
        """
        if write:
            for part in self.partitions:
                part.write_params()
        if self.stage == 0:
            return
        handles = [h for part in self.partitions for h in part.gather_params(self.comm)]
        for h in handles:
            h.wait()

    def zero_grad(self) -> None:
        """Clear gradients (stages 0-1 keep each ``.grad`` as a zeroed view of the flat buffer)."""
        self.reducer.zero()

    def get_grad_norm(self) -> float:
        """L2 norm of the full, unscaled, DP-averaged gradient of the last step, BEFORE clipping.

        Equals the norm one process would compute on the whole global batch
        (TP-replicated parameters count once). inf or nan when that step
        overflowed; nan before the first step.
        """
        return self._last_grad_norm

    # ---- reports ---------------------------------------------------------------------
    def memory_report(self) -> Dict[str, int]:
        """Bytes this rank holds, by kind.

        ``params``: every model parameter (flat buffers with their padding, and
        frozen parameters). ``grads``: the gradient store (full buffers in
        stages 0-1, this rank's partition in stage 2). ``grad_buckets``: stage 2
        staging buckets. ``master``: master weights that are not the parameters
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
        staging = sum(off.staging_bytes() for off in self._offload)
        if staging:
            rep["offload_staging"] = staging
        rep["total"] = sum(rep.values())
        # offload keeps master, optimizer state and the staging twins in host memory
        rep["host_bytes"] = (rep["master"] + rep["optimizer_states"] + staging) if self._offload else 0
        rep["device_bytes"] = rep["total"] - rep["host_bytes"]
        return rep

    def comm_report(self) -> Dict[str, Dict[str, float]]:
        """Bytes moved by collectives during the last global batch (forward, backward and step).

        Keys are ``"op/axis"`` as in :meth:`hybrid.comm.Communicator.report`.
        """
        return self._last_comm

    def num_parameters(self) -> int:
        """Trainable elements of this rank's model shard (no padding)."""
        return sum(r.numel for r in self.param_index)

    # ---- state -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's flat partitions, counters, loss scaler and the parameter index.

        Each group entry holds ``master`` (this rank's [partition_numel] fp32
        partition), the optimizer state of the same shape (``exp_avg`` and
        ``exp_avg_sq`` for Adam), and the layout. The index (JSON-ready) maps
        every parameter to its flat offset and to the partition pieces, so a
        checkpoint can be resharded to any layout. Like ``torch.optim``, the
        tensors are the live state (no copies, except the master of fp32
        parameters, which is assembled from the parameter buffer): save or
        clone them before the next step.
        """
        inner = self.inner.state_dict()
        groups = []
        for g, part, state in zip(self.groups, self.partitions, inner["groups"]):
            groups.append({"dtype": dtype_name(g.dtype), "weight_decay": g.weight_decay, "numel": g.numel,
                           "partition_numel": g.partition_numel,
                           "segments": [[s.start, s.size, s.used] for s in g.segments],
                           "master": part.master_flat(), **state})
        return self._state_header(groups)

    def _state_header(self, groups: List[dict]) -> dict:
        """The layout, hyperparameters and counters around ``groups`` (the flat partitions)."""
        return {"format": STATE_FORMAT, "stage": self.stage, "partition_count": self.partition_count,
                "part": self.part, "dp_size": self.topology.dp_size, "dp_rank": self.topology.dp_rank,
                "tp_size": self.topology.tp_size, "tp_rank": self.topology.tp_rank,
                "optimizer": {"type": self.inner.kind, "lr": self.inner.lr, "betas": list(self.inner.betas),
                              "eps": self.inner.eps, "weight_decay": self.inner.weight_decay,
                              "momentum": self.inner.momentum},
                "step": self.inner.step_count, "global_steps": self.global_steps,
                "skipped_steps": self.skipped_steps,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
                "groups": groups, "param_index": [r.to_json() for r in self.param_index]}

    def load_state_dict(self, sd: dict) -> None:
        """Restore a state written by :meth:`state_dict` under the same layout, then refresh the model."""
        self._check_state(sd)
        inner = {"kind": sd["optimizer"]["type"], "step": sd["step"], "lr": sd["optimizer"]["lr"],
                 "groups": [{k: v for k, v in g.items() if k in self.inner.state_names} for g in sd["groups"]]}
        self.inner.load_state_dict(inner)
        for part, g in zip(self.partitions, sd["groups"]):
            part.load_master(g["master"])
        self._load_counters(sd)
        self._publish_params(write=True)

    def _check_state(self, sd: dict) -> None:
        """Refuse a state of another format, partition or parameter index, naming what differs."""
        if not isinstance(sd, dict) or sd.get("format") != STATE_FORMAT:
            found = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
            raise ValueError(f"not a ZeRO optimizer state (format {found!r}, expected {STATE_FORMAT!r})")
        if (sd["partition_count"], sd["part"]) != (self.partition_count, self.part) or \
                (sd["stage"] == 3) != (self.stage == 3):
            raise ValueError(f"state was saved as part {sd['part']} of {sd['partition_count']} (stage {sd['stage']}, "
                             f"dp={sd['dp_size']}) but this rank is part {self.part} of {self.partition_count} "
                             f"(stage {self.stage}, dp={self.topology.dp_size}); reshard the checkpoint first")
        mine = [r.to_json() for r in self.param_index]
        keys = ("name", "shape", "dtype", "offset", "numel", "group")
        for a, b in zip(sd["param_index"], mine):
            if any(a[k] != b[k] for k in keys):
                raise ValueError(f"parameter index mismatch: checkpoint has {a['name']} {a['shape']} at offset "
                                 f"{a['offset']} of group {a['group']}, this model has {b['name']} {b['shape']} "
                                 f"at offset {b['offset']} of group {b['group']}; the model or bucket_size differ")
        if len(sd["param_index"]) != len(mine):
            raise ValueError(f"checkpoint indexes {len(sd['param_index'])} parameters, this model has {len(mine)}")

    def _load_counters(self, sd: dict) -> None:
        self.global_steps = int(sd["global_steps"])
        self.skipped_steps = int(sd["skipped_steps"])
        if self.loss_scaler is not None and sd["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(sd["loss_scaler"])

    # ---- whole weights in and out (checkpoints) -----------------------------------------------
    def model_state_for_save(self) -> Optional[Dict[str, torch.Tensor]]:
        """What a checkpoint's model file holds: ``model.state_dict()`` (stage 3 gathers it; see there)."""
        return self.model.state_dict()

    def load_model_state(self, state: Dict[str, torch.Tensor]) -> None:
        """Load a ``model.state_dict()`` (this TP rank's shard, keys must match) and make the masters follow it."""
        self.model.load_state_dict(state, strict=True)
        self.weights_loaded()

    def weights_loaded(self) -> None:
        """Copy the current parameters into this rank's master partition (after loading weights only)."""
        with torch.no_grad():
            for part in self.partitions:
                if not part.aliased:
                    torch._foreach_copy_(part.master_chunks, part.param_chunks)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the model's parameters."""
        self.reducer.remove_hooks()
