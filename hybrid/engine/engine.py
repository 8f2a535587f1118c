"""The training engine: a model plus the ZeRO optimizer, precision, clipping, accumulation and schedule.

A plain PyTorch loop changes in a few lines (docs/engine.md)::

    engine = hybrid.initialize(model, config)
    for batch in loader:
        loss = loss_fn(engine(batch.x), batch.y)
        engine.backward(loss)
        engine.step()

Call :meth:`Engine.backward` then :meth:`Engine.step` once per micro-batch.
``step`` counts micro-steps; on every ``gradient_accumulation_steps``-th call
(the accumulation boundary) it clips, steps the optimizer at the scheduled
learning rate, advances the schedule (only when the step was not skipped for
non-finite gradients) and zeroes the gradients.

The engine counts the samples its global batches consumed. With a batch
ramp-up (``rampup_batch_size``) the next global batch, and so the accumulation
count, follow from that count (:class:`~hybrid.config.batch.GlobalBatchSchedule`);
a schedule in samples advances by each step's global batch.
"""

from __future__ import annotations

import logging
import dataclasses
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from hybrid.checkpoint import SaveReport
from hybrid.config.errors import ConfigError
from hybrid.config.load import ConfigSource, check_deepspeed_dtypes, load_config
from hybrid.config.parse import apply_overrides
from hybrid.config.schema import SCHEDULE_ON_LOAD, HybridConfig
from hybrid.engine.builders import (NoDecayFn, build_loss_scaler, build_lr_schedule, build_wd_schedule,
                                    check_recompute, no_weight_decay_rule)
from hybrid.engine.checkpoint import EngineCheckpoints
from hybrid.engine.parts import TrainingParts
from hybrid.engine.precision import prepare_precision
from hybrid.engine.rng import RandomState
from hybrid.engine.stage import EngineStage, autocast, loss_tokens, scale_side_losses
from hybrid.engine.step_logger import StepLogger
from hybrid.layout import ParallelLayout, pipeline_problem
from hybrid.optim.lr_schedule import LRSchedule, check_same_settings
from hybrid.optim.wd_schedule import WeightDecaySchedule
from hybrid.pipeline.chunks import chunk_parameters
from hybrid.topology import Topology
from hybrid.zero import build_zero_optimizer


class Engine:
    """Drives one model replica's shard; build it with :func:`initialize`.

    Attributes: ``module`` (the wrapped model, in training precision),
    ``optimizer`` (the :class:`~hybrid.zero.ZeroOptimizer` of the configured
    stage), ``lr_schedule``, ``rng`` (every random generator of this rank),
    ``config`` (the validated :class:`HybridConfig`), ``topology``, ``batch``
    (resolved :class:`~hybrid.config.BatchSizes`), ``checkpoints`` (the
    :class:`~hybrid.engine.checkpoint.EngineCheckpoints` behind :meth:`save_checkpoint` and
    :meth:`load_checkpoint`), ``pipeline`` (the :class:`~hybrid.pipeline.PipelineExecutor` of
    :meth:`train_batch`; None for a model that is not pipeline-aware) and ``pipeline_stage`` (the
    :class:`~hybrid.engine.stage.EngineStage` it calls). Each component saves and loads its own state;
    :meth:`state_dict` is built from theirs.
    """

    def __init__(self, model: torch.nn.Module, config: HybridConfig, topology: Topology, *,
                 no_weight_decay: Optional[NoDecayFn] = None):
        if isinstance(model, Engine):
            raise TypeError("the model is already wrapped in an Engine; pass engine.module to re-wrap it")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"hybrid.initialize needs a torch.nn.Module, got {type(model).__name__}")
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(f"{type(model).__name__} has no parameters with requires_grad=True; nothing to train")
        model_topology = getattr(model, "topology", None)
        if isinstance(model_topology, Topology) and model_topology.tp_size != topology.tp_size:
            raise ConfigError(f"the model was built for tp={model_topology.tp_size} but the engine's topology has "
                              f"tp={topology.tp_size}; pass the model's topology to hybrid.initialize")
        self.config = config
        self.topology = topology
        self.batch = config.resolve_batch(topology.dp_size)
        if self.batch.schedule is None and config.scheduler.in_samples:
            raise ConfigError("a learning-rate schedule in samples ('scheduler.warmup_samples', "
                              "'scheduler.decay_samples') needs the global batch: set micro_batch_size or "
                              "global_batch_size")
        self.consumed_samples = 0  # by the global batches of this run and the one it resumed
        problem = pipeline_problem(config.zero.stage, topology.pp_size)
        if problem:
            raise ConfigError(f"zero.stage {config.zero.stage} with pp={topology.pp_size}: {problem}")
        check_recompute(model, config.recompute)
        self.module = model
        model.train()
        self._autocast_dtype = prepare_precision(model, config.precision, config.autocast)
        # Autocast where the weights are, not where the topology's tensors go: a model built on the CPU of a GPU
        # machine computes on the CPU, and CUDA autocast would leave its matmuls in fp32.
        self._autocast_device = next(model.parameters()).device.type
        self.lr_schedule = build_lr_schedule(config)
        self.wd_schedule = build_wd_schedule(config)  # follows the learning-rate schedule's position
        # The first step's learning rate is the schedule's, not the configured peak.
        optimizer_config = dataclasses.replace(config.optimizer, lr=self.lr_schedule.lr)
        # an interleaved pipeline stage's chunks: the optimizer lays its segments out by them
        chunks, chunk_params = chunk_parameters(model, topology.pp_rank)
        # Under context parallelism the parameters' data-parallel group is dp x cp (Topology.data_view)
        self.optimizer = build_zero_optimizer(
            model, topology.data_view(), config.zero, optimizer_config,
            no_weight_decay=no_weight_decay_rule(config, no_weight_decay), loss_scaler=build_loss_scaler(config),
            clip_grad=config.clip_grad, gradient_accumulation_steps=self.gradient_accumulation_steps,
            use_fused_kernels=config.use_fused_kernels, chunks=chunks, chunk_params=chunk_params)
        self.rng = RandomState(model)
        self.micro_steps = 0
        self._micro_in_batch = 0  # micro-steps of the global batch under way
        self.global_step = 0
        self.last_lr: Optional[float] = None
        self._awaiting_step = False
        self._losses = []
        self._logger = StepLogger(config, is_rank0=topology.rank == 0)
        self.pipeline = self._build_pipeline(model)
        # what the executor calls for each part's forward and backward (the step's path: hybrid.engine.stage)
        self.pipeline_stage = None if self.pipeline is None else EngineStage(
            model, self.optimizer, whole_model=self.pipeline.num_parts == 1,
            autocast_device=self._autocast_device, autocast_dtype=self._autocast_dtype)
        self.last_pipeline_stats = None
        self.checkpoints = EngineCheckpoints(TrainingParts(model, self.optimizer, self.rng, topology), self,
                                             config.checkpoint, self.layout, self.checkpoint_timeout_s)

    # ---- forward ----------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped model (under torch.autocast when ``autocast`` is configured)."""
        with self._autocast():
            return self.module(*args, **kwargs)

    def _autocast(self):
        return autocast(self._autocast_device, self._autocast_dtype)

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    # ---- backward and step ---------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss (a scalar, the mean over that micro-batch).

        The optimizer applies the loss scale and averages gradients over the
        data-parallel ranks and the accumulation steps. Call :meth:`step` next.
        """
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward needs a scalar loss tensor, got "
                             f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        if not loss.requires_grad:
            raise ValueError("the loss does not require grad; was the forward run under torch.no_grad(), or "
                             "are all parameters frozen?")
        if self._awaiting_step:
            raise RuntimeError("engine.backward() was called twice without engine.step(); call engine.step() "
                               "after every backward (it counts the accumulation micro-steps)")
        scale_side_losses(self.module, self.optimizer)
        self.optimizer.backward(loss)
        self._awaiting_step = True
        if self._logger.wants_loss:
            self._losses.append(loss.detach().float())

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per DP rank of the global batch under way (a ramp-up changes it between batches)."""
        return self.batch.accumulation_at(self.consumed_samples)

    @property
    def global_batch_size(self) -> Optional[int]:
        """Samples of the global batch under way, over all DP ranks; None when the batch sizes are unknown."""
        schedule = self.batch.schedule
        return schedule.size_at(self.consumed_samples) if schedule is not None else None

    @property
    def is_accumulation_boundary(self) -> bool:
        """Whether the next :meth:`step` call ends a global batch (and steps the optimizer)."""
        return self._micro_in_batch + 1 == self.gradient_accumulation_steps

    def step(self) -> bool:
        """End one micro-step; at the accumulation boundary clip, step, schedule and zero the gradients.

        Returns True when this call updated the parameters, False between
        boundaries and when the step was skipped for non-finite gradients.
        """
        if not self._awaiting_step:
            raise RuntimeError("engine.step() was called without engine.backward(loss) for this micro-batch")
        self._awaiting_step = False
        boundary = self.is_accumulation_boundary
        self.micro_steps += 1
        self._micro_in_batch += 1
        if not boundary:
            return False
        return self._end_global_batch()

    def train_batch(self, microbatches: Sequence[Mapping[str, Any]], dp_mean: bool = False) -> Tuple[bool, float]:
        """One global batch through the pipeline (:mod:`hybrid.pipeline`), then the optimizer step.

        The executor runs this rank's schedule and calls :attr:`pipeline_stage` (an
        :class:`~hybrid.engine.stage.EngineStage`) for each part's forward and backward; at pp=1 too.

        ``microbatches``: this DP rank's :attr:`gradient_accumulation_steps` micro-batches, each the keyword
        arguments of the model's ``forward_part`` (``input_ids`` ``[b, s]``, ``labels``, optionally ``loss_mask``
        and ``position_ids``), the same on every stage. The model is a pipeline-aware model such as
        :class:`model_zoo.GPTModel`. Returns (whether the parameters were updated, the mean loss over the
        micro-batches), the loss computed on the last stage and broadcast over ``"pp"`` so that every rank
        reports the same value. ``dp_mean``: the loss is also averaged over ``"dp"`` (the global batch's loss),
        before the step: an all-reduce after it would queue on the ``dp`` group behind the weights' all-gathers
        that ``zero.overlap_param_gather`` leaves in flight, and wait for all of them.
        """
        if self.pipeline is None:
            raise TypeError(f"train_batch needs a pipeline-aware model (one with a stage split and forward_part, "
                            f"such as model_zoo.GPTModel); for {type(self.module).__name__} call engine(...), "
                            f"engine.backward(loss) and engine.step() per micro-batch")
        gas = self.gradient_accumulation_steps
        if len(microbatches) != gas:
            raise ValueError(f"train_batch needs gradient_accumulation_steps={gas} micro-batches, got "
                             f"{len(microbatches)}")
        if self._awaiting_step or self._micro_in_batch:
            raise RuntimeError("train_batch was called in the middle of a global batch of backward()/step() calls")
        stats = self.pipeline.step(microbatches, self._loss_stage(microbatches))
        self.last_pipeline_stats = stats
        loss = self._pipeline_loss(stats.losses)
        if dp_mean:
            self.topology.comm.all_reduce(loss, "dp", op="avg")
        loss = loss[0]
        self.micro_steps += gas
        self._losses.append(loss)
        return self._end_global_batch(), float(loss)

    def _loss_stage(self, microbatches: Sequence[Mapping[str, Any]], tokens: Optional[float] = None) -> EngineStage:
        """The pipeline stage computing the loss as the run defines it on this global batch: with
        ``calculate_per_token_loss``, the last part weighs each micro-batch's mean loss by its token count times
        ``accumulation * dp / N`` (:class:`EngineStage`), ``N`` the global batch's unmasked tokens
        (``tokens``, or :meth:`loss_token_count`), so that the mean over the micro-batches and ``"dp"`` is the
        summed token losses over ``N``."""
        stage = self.pipeline_stage
        if not self.config.calculate_per_token_loss:
            return stage
        total = self.loss_token_count(microbatches) if tokens is None else tokens
        # a global batch with no unmasked token has no loss to average (its losses are NaN): scaled by 1 token
        return dataclasses.replace(stage, token_scale=len(microbatches) * self.topology.dp_size / max(total, 1.0))

    def loss_token_count(self, microbatches: Sequence[Mapping[str, Any]]) -> float:
        """``N``: the unmasked tokens of the global batch whose micro-batches on this data-parallel rank are
        ``microbatches`` (each one's loss-mask sum, :func:`loss_tokens`; all-reduce over ``"dp"``; every pipeline
        stage holds the same micro-batches)."""
        topo = self.topology
        total = torch.stack([loss_tokens(mb) for mb in microbatches]).sum().to(topo.device).reshape(1)
        topo.comm.all_reduce(total, "dp")
        return float(total[0])

    def eval_batch(self, microbatches: Sequence[Mapping[str, Any]], tokens: Optional[float] = None) -> float:
        """The loss of ``microbatches`` through the pipeline, forward only (validation): the mean over the
        micro-batches, or with ``calculate_per_token_loss`` their token losses over the global batch's unmasked
        tokens (``tokens`` when the caller counted them, :meth:`loss_token_count`), this rank's share of the
        average over ``"dp"``, as :meth:`train_batch` reports it."""
        if self.pipeline is None:
            raise TypeError(f"eval_batch needs a pipeline-aware model (such as model_zoo.GPTModel); for "
                            f"{type(self.module).__name__} call engine(...) under torch.no_grad()")
        with torch.no_grad():
            stats = self.pipeline.step(microbatches, self._loss_stage(microbatches, tokens), train=False)
        return float(self._pipeline_loss(stats.losses))

    def eval_batches(self, batches: Iterable[Sequence[Mapping[str, Any]]]) -> float:
        """The loss of several global batches (each given as this rank's micro-batches), forward only, averaged
        over ``"dp"`` (collective): the mean of :meth:`eval_batch`'s, or with ``calculate_per_token_loss`` all
        their token losses over all their unmasked tokens (each batch weighed by its count, Megatron-LM's
        validation loss)."""
        per_token = self.config.calculate_per_token_loss
        total = weight = 0.0
        for microbatches in batches:
            tokens = self.loss_token_count(microbatches) if per_token else None
            if tokens == 0:  # nothing to predict in this batch (the same count on every rank): it weighs nothing
                continue
            w = tokens if per_token else 1.0
            total += w * self.eval_batch(microbatches, tokens)
            weight += w
        # no batch, or none with an unmasked token: no loss to report
        mean = torch.tensor([total / weight if weight else float("nan")], dtype=torch.float64,
                            device=self.topology.device)
        self.topology.comm.all_reduce(mean, "dp", op="avg")
        return float(mean[0])

    def _pipeline_loss(self, losses: List[float]) -> torch.Tensor:
        """The mean of the last stage's micro-batch losses, on every stage (broadcast over ``"pp"``): float64 [1]."""
        topo = self.topology
        value = torch.tensor([sum(losses) / len(losses) if losses else 0.0], dtype=torch.float64,
                             device=topo.device)
        topo.comm.broadcast(value, "pp", src=topo.pp_size - 1)
        return value

    def _build_pipeline(self, model: torch.nn.Module):
        """The executor of this rank's pipeline stage; None for a model that is not pipeline-aware at pp=1."""
        from hybrid.pipeline import PipelineExecutor

        split = getattr(model, "split", None)
        if split is None or not hasattr(model, "forward_part"):
            if self.topology.pp_size > 1:
                raise ConfigError(f"pipeline_model_parallel_size={self.topology.pp_size} needs a pipeline-aware "
                                  f"model (one with a stage split and forward_part, such as model_zoo.GPTModel); "
                                  f"{type(model).__name__} is not")
            return None
        executor = PipelineExecutor(self.topology, list(range(split.chunks)), self.config.pipeline.schedule,
                                    activation_shape=lambda mb: model.activation_shape(*mb["input_ids"].shape),
                                    activation_dtype=model.activation_dtype)
        if self.batch.varies:
            key = "rampup_batch_size" if self.batch.rampup is not None else "step_batch_size_schedule"
            for size, microbatches in zip(self.batch.schedule.sizes(), self.batch.accumulations()):
                try:
                    executor.check_microbatches(microbatches)
                except ConfigError as e:
                    raise ConfigError(f"{key}: its global batch {size} is {microbatches} "
                                      f"micro-batches per data-parallel rank, and {e}", keys=(key,)) from None
        return executor

    def _end_global_batch(self) -> bool:
        lr = self.lr_schedule.lr
        samples = self.global_batch_size
        weight_decay = self.wd_schedule.value_at(self.lr_schedule.iteration)
        updated = bool(self.optimizer.step(lr=lr, weight_decay=weight_decay,
                                           decoupled_lr=self.lr_schedule.decoupled_lr))
        after_step = getattr(self.module, "after_optimizer_step", None)
        if after_step is not None:  # e.g. the MoE layers' expert-bias update (collective over dp and tp)
            after_step()
        if updated:
            self.last_lr = lr
            self.lr_schedule.step(samples or 1)
        self.optimizer.zero_grad()
        self.global_step += 1
        self._micro_in_batch = 0
        self.consumed_samples += samples or 0
        self.optimizer.set_gradient_accumulation_steps(self.gradient_accumulation_steps)
        loss = None
        if self._losses and self._logger.needs_loss(self.global_step):
            loss = float(torch.stack(self._losses).mean())
        self._losses.clear()
        self._logger.log(self.global_step, loss, lr, self.loss_scale, self.skipped_steps)
        return updated

    def zero_grad(self) -> None:
        """Drop accumulated gradients (``step`` already does this at each boundary)."""
        self.optimizer.zero_grad()

    # ---- state ---------------------------------------------------------------------------------------------
    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        return self.lr_schedule.lr

    @property
    def loss_scale(self) -> float:
        return float(self.optimizer.loss_scale)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped because the gradients were not finite (fp16 overflow, bf16 NaN/inf)."""
        return int(self.optimizer.skipped_steps)

    def get_grad_norm(self) -> float:
        """L2 norm of the full unscaled gradient of the last global batch, before clipping (see the optimizer)."""
        return self.optimizer.get_grad_norm()

    def get_params_norm(self) -> float:
        """L2 norm of the whole model's fp32 master weights, as one process would compute it. Collective over
        ``world``: every rank calls it."""
        return self.optimizer.params_norm()

    @property
    def count_grad_zeros(self) -> bool:
        """Whether each step counts its gradient's exact zeros (:meth:`get_num_zeros_in_grad`); off by default,
        since counting reads the whole gradient partition once more."""
        return self.optimizer.count_grad_zeros

    @count_grad_zeros.setter
    def count_grad_zeros(self, on: bool) -> None:
        self.optimizer.count_grad_zeros = bool(on)

    def get_num_zeros_in_grad(self) -> Optional[int]:
        """Exact zeros in the last global batch's whole gradient (each element counted once, as one process holds
        it); None unless :attr:`count_grad_zeros` was on for that step."""
        return self.optimizer.get_num_zeros_in_grad()

    def memory_report(self) -> dict:
        """Per-rank bytes held for params, grads, master weights and optimizer states."""
        return self.optimizer.memory_report()

    def comm_report(self) -> dict:
        """Bytes each collective moved in the last global batch."""
        return self.optimizer.comm_report()

    @property
    def layout(self) -> ParallelLayout:
        """The parallel layout of this engine: the topology's sizes, the ZeRO stage and the precision."""
        return self.topology.layout(self.config.zero.stage, self.config.precision)

    def state_dict(self, lazy: bool = False) -> Dict[str, Any]:
        """This rank's complete training state, from each component's own ``state_dict``.

        ``model``: the weights a checkpoint's model file holds (whole tensors
        of this TP shard; None on the DP ranks that do not write it under
        ZeRO-3, which gathers them: collective over ``dp`` there);
        ``optimizer``: the ZeRO partition, counters and loss scaler;
        ``rng``: every generator of this rank; ``progress``: the engine's
        step counters and the LR schedule. ``lazy``: the optimizer's assembled
        tensors as :class:`~hybrid.zero.assembled.AssembledTensor` (see
        :meth:`~hybrid.zero.ZeroOptimizer.state_dict`).
        """
        return {"model": self.optimizer.model_state_for_save(), "optimizer": self.optimizer.state_dict(lazy),
                "rng": self.rng.state_dict(), "progress": self._progress_state()}

    def load_state_dict(self, state: Dict[str, Any], *, schedule: str = "check") -> None:
        """Restore the parts of a :meth:`state_dict` that ``state`` holds (absent or None parts are left alone).

        ``schedule`` (one of :data:`~hybrid.config.schema.SCHEDULE_ON_LOAD`): saved learning-rate and
        weight-decay schedule settings that differ from the configured ones are refused (``"check"``), or
        the configured (``"configured"``) or the saved (``"saved"``) ones continue from the saved position.
        The model loads before the optimizer, whose master weights then win.
        """
        if state.get("model") is not None:
            self.optimizer.load_model_state(state["model"])
        if state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if state.get("rng") is not None:
            self.rng.load_state_dict(state["rng"])
        if state.get("progress") is not None:
            self._load_progress(state["progress"], schedule)

    def _progress_state(self) -> Dict[str, Any]:
        return {"global_step": self.global_step, "micro_steps": self.micro_steps,
                "consumed_samples": self.consumed_samples, "lr_schedule": self.lr_schedule.state_dict(),
                "wd_schedule": self.wd_schedule.settings()}

    def _load_progress(self, progress: Dict[str, Any], schedule: str) -> None:
        if schedule not in SCHEDULE_ON_LOAD:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULE_ON_LOAD)}, got {schedule!r}")
        if schedule == "saved":
            self._take_saved_schedules(progress)
        self.lr_schedule.load_state_dict(progress["lr_schedule"], strict=schedule == "check")
        if schedule == "check":  # its position is the learning-rate schedule's; checkpoints before it record none
            check_same_settings("weight-decay schedule", progress.get("wd_schedule", {}), self.wd_schedule.settings())
        self.global_step = int(progress["global_step"])
        self.consumed_samples = int(progress.get("consumed_samples", 0))
        # Counted in this layout's micro-batches: a checkpoint is always taken at a boundary.
        batch = self.batch
        if batch.schedule is not None:
            self.micro_steps = self.consumed_samples // (batch.micro_batch_size * batch.dp_size)
        else:
            self.micro_steps = self.global_step * batch.gradient_accumulation_steps
        self._micro_in_batch = 0
        self.optimizer.set_gradient_accumulation_steps(self.gradient_accumulation_steps)

    def _take_saved_schedules(self, progress: Dict[str, Any]) -> None:
        """Rebuild the learning-rate and weight-decay schedules from the settings a checkpoint recorded."""
        lr_settings = progress["lr_schedule"].get("settings")
        if not lr_settings:
            raise ValueError("the checkpoint records no learning-rate schedule settings (it predates them): give "
                             "its schedule's settings instead")
        self.lr_schedule = LRSchedule(**lr_settings)
        if progress.get("wd_schedule"):  # checkpoints before the weight-decay schedule decayed by a constant
            self.wd_schedule = WeightDecaySchedule(**progress["wd_schedule"])

    def save_checkpoint(self, directory, iteration: Optional[int] = None, *, consumed_samples: Optional[int] = None,
                        client_state: Optional[dict] = None, keep_last: Optional[int] = None,
                        healthy: bool = True):
        """Save the complete training state to ``directory/iter_{iteration:07d}`` (default: ``global_step``).

        Collective: every rank calls it. See :mod:`hybrid.engine.checkpoint`. ``consumed_samples`` defaults
        to the engine's own count.
        With ``checkpoint.async_save`` it returns once the state is copied to
        host memory (after waiting for the previous save, whose failure it
        raises); collect the result with :meth:`poll_checkpoint` (each step) or
        :meth:`wait_checkpoint`, and :meth:`close` waits for it.
        """
        step = self.global_step if iteration is None else iteration
        return self.checkpoints.save(directory, step, consumed_samples=consumed_samples, client_state=client_state,
                                     keep_last=keep_last, healthy=healthy)

    @property
    def checkpoint_timeout_s(self) -> float:
        """The bound of a save's waits, a collective's: the topology's timeout, else (a Topology built without
        one) the config's ``distributed.timeout_minutes``, so that a hung disk ends in an error, never a hang."""
        timeout = self.topology.comm.timeout
        return timeout.total_seconds() if timeout else self.config.distributed.timeout_minutes * 60

    def poll_checkpoint(self) -> Optional[SaveReport]:
        """Commit and report the background save in flight once every rank has written it (once; None while
        it is being written, or when none is in flight). Collective over the world while a save is in flight:
        call it on every rank at the same points (the trainer does at each iteration). Raises
        :class:`~hybrid.checkpoint.CheckpointError` naming the file when it failed; ``latest`` then still
        names the previous checkpoint."""
        return self.checkpoints.poll()

    def wait_checkpoint(self) -> Optional[SaveReport]:
        """Wait (at most the job's collective timeout) for this rank's background writer, then commit and
        report as :meth:`poll_checkpoint` (collective)."""
        return self.checkpoints.wait()

    def abandon_checkpoint(self) -> None:
        """Drop a background save in flight without committing it (no communication), for failing paths."""
        self.checkpoints.abandon()

    def load_checkpoint(self, directory, *, load_optimizer: bool = True, schedule: str = "check",
                        load_progress: Optional[bool] = None, load_rng: Optional[bool] = None) -> dict:
        """Load a checkpoint saved in any layout (TP, DP, ZeRO stage, precision) into this engine.

        ``directory`` is a save directory (its ``latest``) or one ``iter_N`` directory. ``schedule``: what
        to do with saved schedule settings that differ from the configured ones (:meth:`load_state_dict`).
        ``load_optimizer=False`` loads the weights alone; ``load_progress`` (step counters, consumed samples,
        the schedules' position) and ``load_rng`` default to it (Megatron-LM's ``--no-load-optim``:
        ``load_optimizer=False, load_progress=True``; ``--no-load-rng``: ``load_rng=False``).
        Returns ``iteration``, ``consumed_samples``, ``client_state`` and ``path``.
        """
        return self.checkpoints.load(directory, load_optimizer=load_optimizer, schedule=schedule,
                                     load_progress=load_progress, load_rng=load_rng)

    def gathered_parameters(self):
        """Context manager: every parameter of ``module`` whole inside the block (a stage that partitions
        parameters gathers them over ``dp``; a no-op otherwise). For reading or exporting weights; writes
        inside it are lost."""
        return self.optimizer.gathered_parameters()

    def close(self) -> None:
        """Commit a background save in flight (collective then), wait for the last update's weight gathers
        (``zero.overlap_param_gather``), flush and close the TensorBoard writer and detach the optimizer's hooks.

        The hooks hold the optimizer's buffers alive through a reference cycle, so an engine that is
        dropped without ``close()`` keeps its memory until the cycle collector runs. A background save
        that fails here is logged, not raised (close runs in ``finally`` blocks); on a path that is
        failing, call :meth:`abandon_checkpoint` first.
        """
        self.checkpoints.close()
        try:
            self.optimizer.wait_for_weights()  # zero.overlap_param_gather: the model keeps the last update
        except Exception as e:  # noqa: BLE001 - logged, as above
            logging.getLogger(__name__).error("%s", e)
        self._logger.close()
        self.optimizer.remove_hooks()

    def __repr__(self) -> str:
        return (f"Engine({type(self.module).__name__}, zero stage {int(self.config.zero.stage)}, "
                f"{self.config.precision}, {self.topology.describe()}, global_step={self.global_step})")


def initialize(model: torch.nn.Module, config: ConfigSource = None, topology: Optional[Topology] = None, *,
               no_weight_decay: Optional[NoDecayFn] = None, **overrides: Any) -> Engine:
    """Wrap ``model`` in an :class:`Engine`.

    ``config``: a :class:`HybridConfig`, a native or DeepSpeed-style dict, or a
    JSON/YAML path (see :func:`hybrid.config.load_config`). ``overrides`` set
    keys on top of it: top-level keys (``precision="bf16"``), section
    mappings merged key by key (``zero={"stage": 2}``) or dotted paths
    (``**{"optimizer.lr": 1e-4}``).

    ``topology``: the parallel layout. Without one, the process group is
    started from torchrun's environment (single process otherwise) with the
    ``distributed`` section's collective timeout, and a topology with
    ``tensor_parallel_size``, ``pipeline.size``, ``expert_parallel_size``, ``context_parallel_size`` and
    ``distributed.allow_tp_across_nodes`` is built. A TP model must be
    built on the same topology that is passed here.

    ``no_weight_decay(name, param) -> bool`` picks parameters exempt from
    weight decay; by default every parameter with at most one dimension
    (biases, norm weights), unless ``optimizer.decay_1d_params`` is true.
    """
    cfg = load_config(config)
    if overrides:
        cfg = apply_overrides(cfg, overrides)
        check_deepspeed_dtypes(config, cfg.precision, given_by="the keyword overrides")
    if topology is None:
        from hybrid.distributed import init_distributed

        timeout_s = cfg.distributed.timeout_minutes * 60
        init_distributed(timeout_s=timeout_s)
        # the timeout reaches every TP/DP/PP group too, not only the default one
        topology = Topology(tp=cfg.tensor_parallel_size or 1, pp=cfg.pipeline.size or 1,
                            ep=cfg.expert_parallel_size or 1, cp=cfg.context_parallel_size or 1, timeout_s=timeout_s,
                            allow_tp_across_nodes=cfg.distributed.allow_tp_across_nodes)
    else:
        for key, wanted, axis, built in (("pipeline.size", cfg.pipeline.size, "pp", topology.pp_size),
                                         ("tensor_parallel_size", cfg.tensor_parallel_size, "tp", topology.tp_size),
                                         ("expert_parallel_size", cfg.expert_parallel_size, "ep", topology.ep_size),
                                         ("context_parallel_size", cfg.context_parallel_size, "cp", topology.cp_size)):
            if wanted is not None and wanted != built:
                raise ConfigError(f"config key {key!r} is {wanted} but the topology has {axis}={built}; leave the "
                                  f"key unset to use the topology's, or build the Topology with {axis}={wanted}")
    return Engine(model, cfg, topology, no_weight_decay=no_weight_decay)
