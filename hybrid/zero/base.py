"""The interface every ZeRO optimizer implements, and the training step they share.

Two siblings implement it, built by :func:`hybrid.zero.build_zero_optimizer`
from the stage's traits (:data:`hybrid.layout.STAGE_TRAITS`):

* :class:`~hybrid.zero.flat.FlatZeroOptimizer` for stages 0-2, where every
  rank keeps the whole low-precision model in flat buffers;
* :class:`~hybrid.zero.stage3.Stage3Optimizer` for stage 3, where each rank
  keeps only its partition of the parameters and gathers whole ones per module.

Under expert parallelism a third, :class:`~hybrid.zero.expert_split.ExpertSplitOptimizer`,
runs one of those over the dense parameters and ``dp`` and another over the
expert parameters and ``edp`` (each limited by the ``params`` filter), and the
step below once over both.

Usage per global batch (``gradient_accumulation_steps`` micro-batches)::

    for micro_batch in global_batch_slice_of_this_dp_rank:
        opt.backward(model(micro_batch))   # loss: mean over the micro-batch
    opt.step(lr)                           # False when skipped (non-finite grads)
    opt.zero_grad()

The update equals one process training on the whole global batch: gradients
are summed over micro-steps (each scaled by 1/accumulation) and over ``dp``,
then multiplied by ``1/(loss_scale * dp)`` and the clip coefficient -- one
factor, applied inside the optimizer kernel. What differs between the siblings
is where the state lives, how backward reduces gradients, how the global
gradient norm is summed and how the new weights are published; the step
itself (overflow check, loss scale, clipping, counters) is written here once.

The write fence
---------------
Between steps nothing changes the weights, the master partition or the
optimizer moments: forward and backward read the weights (stage 3 gathers
copies of them into the modules) and write only gradients. They change in
the update of :meth:`ZeroOptimizer.step` and in the loads (``load_state_dict``,
``load_model_state``, ``weights_loaded``, ``write_parameter``). Each of those
first calls :meth:`ZeroOptimizer.fence_writes`, which runs ``write_fence``
when one is set: the engine sets it to wait until a background checkpoint
writer has copied the live state it was handed (:mod:`hybrid.checkpoint.background`).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import math
from typing import Callable, ContextManager, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

from hybrid.config.schema import OptimizerConfig, ZeroConfig, decoupled_lr_problem, lamb_problem
from hybrid.compression import (ONE_BIT_OPTIMIZERS, compression_problem, gradient_quantization, hpz_problem,
                                onebit_problem, weight_quantization)
from hybrid.layout import (STAGE_TRAITS, StageTraits, ZeroStage, offload_problem, overlap_param_gather_problem,
                           reduce_once_problem, zero_stage)
from hybrid.topology import Topology, TopologyError
from hybrid.zero.flat_buffer import ParamFilter, ParamRecord, ZeroConfigError
from hybrid.zero.grad_norm import clip_factor
from hybrid.zero.inner import InnerOptimizer
from hybrid.zero.loss_scaler import LossScaler

STATE_FORMAT = "hybrid.zero/1"

NoDecayFn = Callable[[str, torch.nn.Parameter], bool]


def check_zero_config(zero: ZeroConfig) -> ZeroStage:
    """The rules a ZeRO section must meet before an optimizer is built from it; returns its stage."""
    stage = zero_stage(zero.stage, "zero.stage")
    problem = offload_problem(stage, zero.offload_optimizer)
    if problem is not None:
        raise ZeroConfigError(f"zero.offload_optimizer: {problem}")
    problem = reduce_once_problem(stage, zero.reduce_once)
    if problem is not None:
        raise ZeroConfigError(problem)
    problem = overlap_param_gather_problem(stage, zero.overlap_param_gather)
    if problem is not None:
        raise ZeroConfigError(problem)
    problem = compression_problem(stage, zero.quantized_gradients, zero.quantized_weights, zero.quantization_block)
    if problem is not None:
        key, why = problem
        raise ZeroConfigError(f"{key} = {getattr(zero, key.split('.')[1])!r} at ZeRO stage {int(stage)}: {why}")
    problem = hpz_problem(stage, zero.hpz_partition_size)
    if problem is not None:
        raise ZeroConfigError(f"zero.hpz_partition_size = {zero.hpz_partition_size!r}: {problem}")
    if not isinstance(zero.bucket_size, int) or zero.bucket_size < 1:
        raise ZeroConfigError(f"zero.bucket_size must be a positive number of elements, got {zero.bucket_size!r}")
    return stage


def _check_runtime(topology, loss_scaler, clip_grad, gradient_accumulation_steps, master_dtype) -> None:
    if not isinstance(topology, Topology):
        raise ZeroConfigError(f"topology must be a hybrid.Topology, got {type(topology).__name__}")
    if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
        raise ZeroConfigError(f"loss_scaler must be a hybrid.zero.LossScaler or None, got "
                              f"{type(loss_scaler).__name__}")
    if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
        raise ZeroConfigError(f"gradient_accumulation_steps must be an integer >= 1, got "
                              f"{gradient_accumulation_steps!r}")
    if clip_grad < 0:
        raise ZeroConfigError(f"clip_grad must be >= 0 (0 disables clipping), got {clip_grad}")
    if not (isinstance(master_dtype, torch.dtype) and master_dtype.is_floating_point):
        raise ZeroConfigError(f"master_dtype must be a floating-point torch.dtype, got {master_dtype!r}")


@dataclasses.dataclass(frozen=True)
class BackwardPass:
    """One backward pass of a global batch on this rank, as :meth:`ZeroOptimizer._backward_phase` sees it."""

    last: bool                                   # the batch's last pass on this rank
    chunk: Optional[int] = None                  # the model chunk it runs through (interleaved pipeline stages)
    chunks_done: FrozenSet[int] = frozenset()    # chunks whose last pass of the batch this is, or was


class ZeroOptimizer(abc.ABC):
    """The ZeRO optimizer of one model replica's shard over ``topology``'s DP group.

    Build one with :func:`hybrid.zero.build_zero_optimizer`. ``zero`` and
    ``optimizer`` are the config sections; the keyword arguments are what the
    engine decides at run time (the loss scaler of fp16, the clip norm, the
    accumulation count of this layout, the weight-decay exemption rule, and on
    an interleaved pipeline stage its ``chunks`` and the parameters each one's
    backward reaches, ``chunk_params``: see :meth:`set_chunks`). ``params``
    (``(name, parameter) -> bool``) limits the optimizer to the parameters it
    accepts; the others are left to another optimizer over the same model (the
    expert parameters of an MoE model: :mod:`hybrid.zero.expert_split`).
    """

    def __init__(self, model: torch.nn.Module, topology: Topology, zero: ZeroConfig, optimizer: OptimizerConfig,
                 *, no_weight_decay: Optional[NoDecayFn] = None, loss_scaler: Optional[LossScaler] = None,
                 clip_grad: float = 0.0, gradient_accumulation_steps: int = 1, use_fused_kernels: bool = True,
                 master_dtype: torch.dtype = torch.float32, chunks: int = 1,
                 chunk_params: Optional[Sequence[Sequence[torch.nn.Parameter]]] = None,
                 params: Optional[ParamFilter] = None):
        self.stage: ZeroStage = check_zero_config(zero)
        _check_runtime(topology, loss_scaler, clip_grad, gradient_accumulation_steps, master_dtype)
        self.traits: StageTraits = STAGE_TRAITS[self.stage]
        # onebit_adam / zero_one_adam: the 1-bit optimizers (hybrid.zero.onebit, hybrid.zero.zero_one_adam)
        self.one_bit = optimizer.type if optimizer.type in ONE_BIT_OPTIMIZERS else None
        if self.one_bit:
            problem = onebit_problem(self.stage, zero.offload_optimizer, zero.two_level_reduce, self.one_bit)
            if problem is not None:
                key, why = problem
                raise ZeroConfigError(f"optimizer.type = {self.one_bit!r} with {key} = "
                                      f"{getattr(zero, key.split('.')[1])!r}: {why}")
        if decoupled_lr_problem(optimizer):
            raise ZeroConfigError(f"optimizer.decoupled_lr {decoupled_lr_problem(optimizer)}")
        if optimizer.type == "lamb" and lamb_problem(self.stage, zero.offload_optimizer):
            raise ZeroConfigError(f"optimizer.type = 'lamb': {lamb_problem(self.stage, zero.offload_optimizer)}")
        # their moments are AdamW's, and 1-bit Adam's warm-up is AdamW
        self.inner = InnerOptimizer("adamw" if self.one_bit else optimizer.type, lr=optimizer.lr,
                                    betas=tuple(optimizer.betas), eps=optimizer.eps,
                                    weight_decay=optimizer.weight_decay_range[0], momentum=optimizer.momentum,
                                    use_kernels=use_fused_kernels, bias_correction=optimizer.bias_correction,
                                    max_coeff=optimizer.max_coeff, min_coeff=optimizer.min_coeff)
        self.model = model
        self.param_filter = params
        # parameters another optimizer owns (rejected by the filter): a whole-model load or save skips them
        self._foreign = frozenset() if params is None else frozenset(
            id(p) for name, p in model.named_parameters() if not params(name, p))
        self.topology = topology
        self.comm = topology.comm
        self.offload_optimizer = zero.offload_optimizer
        # None unless zero.quantized_gradients / zero.quantized_weights ask for compressed collectives
        self.grad_quant = gradient_quantization(zero.quantized_gradients, zero.quantization_block)
        self.weight_quant = weight_quantization(zero.quantized_weights, zero.quantization_block)
        self.two_level = zero.two_level_reduce
        if self.two_level:
            try:
                topology.enable_node_axes()  # collective: every rank builds the optimizer
            except TopologyError as e:
                raise ZeroConfigError(f"zero.two_level_reduce: {e}") from None
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.clip_grad = float(clip_grad)
        self.loss_scaler = loss_scaler
        self.use_fused_kernels = use_fused_kernels
        self.master_dtype = master_dtype
        self.no_weight_decay = no_weight_decay
        self.decays = optimizer.decays  # at any step: a growing weight decay may start at 0
        self.global_steps = 0  # step() calls, skipped ones included
        self.skipped_steps = 0
        self._micro = 0  # backward() calls since the last step()
        self._chunks = 1  # backward passes per micro-batch (model chunks of an interleaved pipeline stage)
        self._chunk_passes = [0]  # backward passes through each chunk since the last step()
        # what set_chunks is given at the end of set-up; the flat siblings also lay their segments out by it
        self.chunk_params = chunk_params
        self._setup_chunks = int(chunks)
        self._last_grad_norm = math.nan
        # Counting the exact zeros of each step's gradient costs a pass over it: only while this is set
        # (the trainer's --log-num-zeros-in-grad). None: not counted.
        self.count_grad_zeros = False
        self._last_grad_zeros: Optional[int] = None
        self._last_comm: Dict[str, Dict[str, float]] = {}
        self.param_index: List[ParamRecord] = []
        self.partition_count = 1
        self.part = 0
        # called before weights, masters or moments change (see "The write fence" above); None: nothing to wait for
        self.write_fence: Optional[Callable[[], None]] = None

    def _finish_setup(self) -> None:
        """Called by each sibling at the end of its constructor: set-up traffic is not the first step's."""
        self.set_chunks(self._setup_chunks, self.chunk_params)
        self.comm.reset_stats()

    # ---- the training step (shared) -----------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    @property
    def lr(self) -> float:
        return self.inner.lr

    def backward(self, loss: torch.Tensor, chunk: Optional[int] = None) -> None:
        """Backward of one micro-batch's mean loss, scaled by ``loss_scale / accumulation``.

        Gradients are reduced over ``dp`` during backward, as the sibling's
        reducer decides (see :meth:`_backward_phase`). ``chunk``: the model chunk the pass runs through, on an
        interleaved pipeline stage (:meth:`set_chunks`).
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("backward() expects the scalar (mean) loss of one micro-batch, got "
                             f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else list(loss.shape)}")
        factor = self.loss_scale / self.gradient_accumulation_steps
        self._run_backward(lambda: (loss * factor if factor != 1.0 else loss).backward(), chunk)

    def backward_from(self, output: torch.Tensor, grad: torch.Tensor, chunk: Optional[int] = None) -> None:
        """Backward of a pipeline part from the gradient ``grad`` of its ``output`` (same shape), received from
        the next part: it already carries the loss scale and the accumulation factor."""
        self._run_backward(lambda: torch.autograd.backward(output, grad), chunk)

    @property
    def backward_calls_per_step(self) -> int:
        """Backward passes per optimizer step on this rank: one per micro-batch, times the model chunks a
        rank of an interleaved pipeline holds (:meth:`set_chunks`)."""
        return self.gradient_accumulation_steps * self._chunks

    def set_gradient_accumulation_steps(self, steps: int) -> None:
        """Micro-batches per DP rank from the next global batch on (a batch ramp-up changes it between steps):
        the divisor of each micro-batch's loss and the count :meth:`step` expects."""
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be an integer >= 1, got {steps!r}")
        if self._micro:
            raise RuntimeError(f"the accumulation count can change only between global batches, but "
                               f"{self._micro} backward pass(es) of this one have run")
        self.gradient_accumulation_steps = steps

    def set_chunks(self, chunks: int, chunk_params: Optional[Sequence[Sequence[torch.nn.Parameter]]] = None) -> None:
        """This rank runs ``chunks`` backward passes per micro-batch (interleaved pipeline stages).

        ``chunk_params[c]``: the parameters a backward pass through chunk ``c`` can give gradients to; a sibling
        may then reduce only those in such a pass (passes name their chunk: :meth:`backward`)."""
        self._chunks = int(chunks)
        self._chunk_passes = [0] * self._chunks

    def _run_backward(self, run: Callable[[], None], chunk: Optional[int] = None) -> None:
        calls, gas = self.backward_calls_per_step, self.gradient_accumulation_steps
        if self._micro >= calls:
            raise RuntimeError(f"backward() was called {self._micro + 1} times since the last step(), but "
                               f"gradient_accumulation_steps={gas}; call step() once every {gas} micro-batches")
        done: FrozenSet[int] = frozenset()
        if chunk is not None:
            if not 0 <= chunk < self._chunks or self._chunk_passes[chunk] >= gas:
                raise RuntimeError(f"a backward pass through model chunk {chunk!r}, which this rank does not hold "
                                   f"or has already run {gas} (gradient_accumulation_steps) times since step()")
            self._chunk_passes[chunk] += 1
            done = frozenset(c for c, n in enumerate(self._chunk_passes) if n == gas)
        with self._backward_phase(BackwardPass(self._micro == calls - 1, chunk, done)):
            run()
        self._micro += 1

    def step(self, lr: Optional[float] = None, weight_decay: Optional[float] = None,
             decoupled_lr: Optional[float] = None) -> bool:
        """Apply the update of one global batch; returns False when it was skipped.

        A step is skipped when any gradient element anywhere in the world is
        inf or NaN (fp16 overflow, or a diverging bf16/fp32 run); the loss
        scaler then lowers the scale. ``lr`` sets the learning rate from now on,
        ``weight_decay`` the decaying groups' weight decay (a growing weight decay), ``decoupled_lr`` the
        embedding and output weights' rate under ``optimizer.decoupled_lr``.
        """
        gas = self.gradient_accumulation_steps
        if self._micro != self.backward_calls_per_step:
            raise RuntimeError(f"step() after {self._micro} backward() calls, but gradient_accumulation_steps="
                               f"{gas}; call backward() once per micro-batch and step() every {gas}")
        if lr is not None:
            if lr < 0:
                raise ValueError(f"learning rate must be >= 0, got {lr}")
            self.inner.lr = float(lr)
        if decoupled_lr is not None:
            if decoupled_lr < 0:
                raise ValueError(f"decoupled learning rate must be >= 0, got {decoupled_lr}")
            self.inner.decoupled_lr = float(decoupled_lr)
        if weight_decay is not None:
            if weight_decay < 0:
                raise ValueError(f"weight decay must be >= 0, got {weight_decay}")
            if weight_decay > 0 and not self.decays:
                raise ValueError(f"weight decay {weight_decay} for an optimizer whose config has none "
                                 f"(optimizer.weight_decay, start_weight_decay and end_weight_decay all 0): no "
                                 f"parameter group was set up to decay")
            self.inner.weight_decay = float(weight_decay)
        self._wait_for_gradients()
        self._sum_tied_gradients()
        denominator = self.loss_scale * self.topology.dp_size
        sq = self._global_sq()
        overflow = not math.isfinite(sq)
        self._last_grad_norm = math.sqrt(sq) / denominator if not overflow else sq
        self._last_grad_zeros = self._grad_zeros() if self.count_grad_zeros else None
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        self.global_steps += 1
        self._micro = 0
        self._chunk_passes = [0] * self._chunks
        if overflow:
            self.skipped_steps += 1
        else:
            self.fence_writes()
            self._apply_update(clip_factor(self._last_grad_norm, self.clip_grad) / denominator)
        self._last_comm = self.comm.report()
        self.comm.reset_stats()
        return not overflow

    def fence_writes(self) -> None:
        """Called before anything changes the weights, the masters or the optimizer moments: waits for the
        weights' gathers still in flight (:meth:`wait_for_weights`), then runs ``write_fence``."""
        self.wait_for_weights()
        if self.write_fence is not None:
            self.write_fence()

    def wait_for_weights(self) -> None:
        """Wait until the model holds the last update's weights everywhere.

        Under ``zero.overlap_param_gather`` (stages 1-2) the step returns with
        the all-gathers of the new weights over ``dp`` in flight, and a read
        of a parameter as a module attribute (``module.weight``) waits for its
        own (:mod:`hybrid.zero.deferred_gather`). Call this before reading the
        weights any other way (``model.parameters()``, ``state_dict()``)
        between a step and the next forward; the optimizer's own saves, norms
        and loads do. A no-op otherwise.
        """

    def get_grad_norm(self) -> float:
        """L2 norm of the full, unscaled, DP-averaged gradient of the last step, BEFORE clipping.

        Equals the norm one process would compute on the whole global batch
        (TP-replicated parameters count once). inf or nan when that step
        overflowed; nan before the first step.
        """
        return self._last_grad_norm

    def get_num_zeros_in_grad(self) -> Optional[int]:
        """Elements of the last step's whole gradient (as one process holds it) that were exactly zero; None
        unless :attr:`count_grad_zeros` was set for that step, or when the step had no whole gradient (1-bit
        Adam's local steps)."""
        return self._last_grad_zeros

    def params_norm(self) -> float:
        """L2 norm of the whole model's fp32 master weights, as one process holding every parameter computes it
        (TP-replicated and pipeline-tied weights counted once). Collective over ``world``."""
        with torch.no_grad():
            return math.sqrt(self._params_sq())

    def weights_finite(self) -> bool:
        """Whether every weight a checkpoint would hold is finite, on every rank (collective over ``world``).

        Reads what each rank steps: its fp32 master partition and, where the
        model's low-precision weights are separate tensors, this rank's rounded
        copy of them (a finite fp32 value can still overflow fp16). Between
        them the partitions of all ranks cover the whole model. One pass over
        this rank's partition and one tiny all-reduce: cheap next to a save.
        """
        self.wait_for_weights()  # the low-precision copies are this rank's chunks of the gathered buffers
        with torch.no_grad():
            local = all(bool(torch.isfinite(t).all())
                        for group in self.inner.groups
                        for t in list(group.masters) + list(group.lowp or ()))
        flag = torch.tensor([0.0 if local else 1.0], device=self.topology.device)
        self.comm.all_reduce(flag, "world", op="max")
        return flag.item() == 0.0

    def comm_report(self) -> Dict[str, Dict[str, float]]:
        """Bytes moved by collectives during the last global batch (forward, backward and step).

        Keys are ``"op/axis"`` as in :meth:`hybrid.comm.Communicator.report`.
        """
        return self._last_comm

    # ---- what each sibling provides -------------------------------------------------------------------
    @abc.abstractmethod
    def _backward_phase(self, backward_pass: BackwardPass) -> ContextManager[None]:
        """Context around one backward pass: arm and drain the gradient reducer."""

    def _wait_for_gradients(self) -> None:
        """Wait for the reductions launched during the last backward (before the norm reads them)."""
        self.reducer.wait()

    def _sum_tied_gradients(self) -> None:
        """Add the gradients of the two copies of a weight tied across the first and last pipeline stage
        (all-reduce over ``"embed"``): both then step with the gradient one process would have. A sibling
        that keeps tied weights in flat groups of their own provides it; without pipeline ties it is a no-op."""

    @abc.abstractmethod
    def _global_sq(self) -> float:
        """Squared L2 norm of the (scaled, DP-summed) gradient over the whole world (collective over ``world``)."""

    @abc.abstractmethod
    def _grad_zeros(self) -> Optional[int]:
        """Exact zeros of the DP-summed gradient over the whole world, each element counted once (collective over
        ``world``); None where no whole gradient exists."""

    @abc.abstractmethod
    def _params_sq(self) -> float:
        """Squared L2 norm of the master weights over the whole world, each element counted once (collective
        over ``world``)."""

    @abc.abstractmethod
    def _apply_update(self, factor: float) -> None:
        """The inner step with gradients multiplied by ``factor``, then the new weights made visible to the model."""

    def zero_grad(self) -> None:
        """Clear the gradients of the last global batch."""
        self.reducer.zero()

    @abc.abstractmethod
    def memory_report(self) -> Dict[str, int]:
        """Bytes this rank holds, by kind (``params``, ``grads``, ``master``, ``optimizer_states``, ...,
        ``total``, ``host_bytes``, ``device_bytes``)."""

    def num_parameters(self) -> int:
        """Trainable elements of this rank's model shard (no padding)."""
        return sum(r.numel for r in self.param_index)

    def gathered_parameters(self) -> ContextManager[None]:
        """Every parameter of the model whole inside the block (reading or exporting weights).

        Stages 0-2 hold whole parameters: it waits for the last update's gathers still in flight
        (:meth:`wait_for_weights`), if any; stage 3 gathers them over ``dp``.
        """
        self.wait_for_weights()
        return contextlib.nullcontext()

    # ---- state ----------------------------------------------------------------------------------------
    @abc.abstractmethod
    def state_dict(self, lazy: bool = False) -> dict:
        """This rank's partition: master weights, optimizer state, counters, loss scaler, parameter index.

        Tensors are live where the optimizer holds them whole and fresh copies where it assembles them;
        ``lazy`` returns those as :class:`~hybrid.zero.assembled.AssembledTensor` of the live pieces instead.
        """

    @abc.abstractmethod
    def load_state_dict(self, sd: dict) -> None:
        """Restore what :meth:`state_dict` wrote under the same layout, then refresh the model's weights."""

    def _state_header(self, groups: List[dict]) -> dict:
        """The layout, hyperparameters and counters around ``groups`` (the flat partitions)."""
        return {"format": STATE_FORMAT, "stage": int(self.stage), "partition_count": self.partition_count,
                "part": self.part, "dp_size": self.topology.dp_size, "dp_rank": self.topology.dp_rank,
                "tp_size": self.topology.tp_size, "tp_rank": self.topology.tp_rank,
                "optimizer": {"type": self.inner.kind, "lr": self.inner.lr, "betas": list(self.inner.betas),
                              "eps": self.inner.eps, "weight_decay": self.inner.weight_decay,
                              "momentum": self.inner.momentum},
                "step": self.inner.step_count, "global_steps": self.global_steps,
                "skipped_steps": self.skipped_steps,
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
                "groups": groups, "param_index": [r.to_json() for r in self.param_index]}

    def _check_state(self, sd: dict) -> None:
        """Refuse a state of another format, partition or parameter index, naming what differs."""
        if not isinstance(sd, dict) or sd.get("format") != STATE_FORMAT:
            found = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
            raise ValueError(f"not a ZeRO optimizer state (format {found!r}, expected {STATE_FORMAT!r})")
        saved_traits = STAGE_TRAITS[zero_stage(sd["stage"], "the saved state's stage")]
        if (sd["partition_count"], sd["part"]) != (self.partition_count, self.part) or \
                saved_traits.parameters != self.traits.parameters:
            raise ValueError(f"state was saved as part {sd['part']} of {sd['partition_count']} (stage {sd['stage']}, "
                             f"dp={sd['dp_size']}) but this rank is part {self.part} of {self.partition_count} "
                             f"(stage {int(self.stage)}, dp={self.topology.dp_size}); reshard the checkpoint first")
        problem = self.index_mismatch(sd["param_index"])
        if problem is not None:
            raise ValueError(problem)

    def index_mismatch(self, saved: Sequence[dict]) -> Optional[str]:
        """What differs between a saved parameter index (``ParamRecord.to_json`` entries, in position order) and
        this optimizer's, or None: where each parameter sits in the flat partitions, not only what it is."""
        mine = [r.to_json() for r in self.param_index]
        if saved and any("offset" not in a for a in saved):
            # A weights-only checkpoint (an import, a save for inference) indexes what each tensor is, not
            # where it sits in an optimizer's partitions: no position can match (the loader then says that
            # it holds no optimizer state).
            return "the checkpoint's parameter index records no partition positions (it holds weights only)"
        # segment and parts too: a state written for other buckets holds other elements in each partition
        # (a key this optimizer's records lack, as ZeRO-3's lack the flat groups', is compared as None)
        keys = ("name", "shape", "dtype", "offset", "numel", "group", "segment", "parts")
        for a, b in zip(saved, mine):
            if any(a.get(k) != b.get(k) for k in keys):
                return (f"parameter index mismatch: checkpoint has {a['name']} {a['shape']} at offset "
                        f"{a['offset']} of group {a.get('group')} (segment {a.get('segment')}), this model has "
                        f"{b['name']} {b['shape']} at offset {b['offset']} of group {b.get('group')} (segment "
                        f"{b.get('segment')}); the model or zero.bucket_size differ")
        if len(saved) != len(mine):
            return f"checkpoint indexes {len(saved)} parameters, this model has {len(mine)}"
        return None

    def _load_counters(self, sd: dict) -> None:
        self.global_steps = int(sd["global_steps"])
        self.skipped_steps = int(sd["skipped_steps"])
        if self.loss_scaler is not None and sd["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(sd["loss_scaler"])

    # ---- whole weights in and out (checkpoints, resharding) ---------------------------------------------
    # Whether model_state_for_save returns fresh host copies (True) or the module's live tensors (False).
    model_state_is_copy = False

    @abc.abstractmethod
    def model_state_for_save(self) -> Optional[Dict[str, torch.Tensor]]:
        """What a checkpoint's model file holds (this TP rank's shard, whole tensors); None on ranks that
        do not write it."""

    @abc.abstractmethod
    def load_model_state(self, state: Dict[str, torch.Tensor]) -> None:
        """Load a whole-tensor ``model.state_dict()`` of this TP rank's shard; the masters follow it."""

    @abc.abstractmethod
    def weights_loaded(self, from_master: bool = False) -> None:
        """Make masters and model weights agree after a load.

        ``from_master``: the masters were loaded and the weights become their
        rounded copies; otherwise the weights were, and the masters follow.
        """

    def parameter_name(self, tensor: torch.Tensor) -> Optional[str]:
        """The name under which this optimizer, not the module tensor, holds ``tensor``'s weights.

        None when the module tensor holds them itself (every stage that does
        not partition parameters); stage 3 answers for its trainable parameters,
        which are then set with :meth:`write_parameter`.
        """
        return None

    def parameter_shape(self, name: str) -> Tuple[int, ...]:
        """The whole (TP-local) shape of a parameter named by :meth:`parameter_name`."""
        raise KeyError(f"{name!r}: this optimizer holds no parameters outside the module")

    def write_parameter(self, name: str, value: torch.Tensor) -> None:
        """Set a parameter named by :meth:`parameter_name` (call :meth:`weights_loaded` after the last one)."""
        raise KeyError(f"{name!r}: this optimizer holds no parameters outside the module")

    @abc.abstractmethod
    def remove_hooks(self) -> None:
        """Detach every hook this optimizer put on the model (they keep its buffers alive)."""
