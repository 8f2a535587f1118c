"""The pretraining loop: ``python -m hybrid.train`` (console script ``hybrid-train``).

One iteration = one global batch: every DP rank runs its micro-batches
through the engine (forward, backward, and at the last one the optimizer
step), the loss is averaged over DP, and the monitor reports. Checkpoints are
saved every ``--save-interval`` iterations, on SIGTERM/SIGINT, and at
``--exit-interval`` / ``--exit-duration-in-mins``; ``--load`` resumes exactly.
The validation split is evaluated every ``--eval-interval`` iterations and
when training ends, the test split once, when training ends (not at an early
exit). ``--skip-train`` trains nothing: it evaluates the loaded weights.

Everything is read from one :class:`~hybrid.config.HybridConfig`: the engine
gets it whole (it ignores the trainer's sections), the trainer reads its own
sections (``model``, ``data``, ``checkpoint``, ``run``, ``eval``, ``logging``,
``distributed``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from typing import Optional, Sequence

import torch

import hybrid
from hybrid.checkpoint import (CheckpointError, CheckpointNotFoundError, checkpoint_bytes, find_resume_point,
                               lock_save_dir)
from hybrid.config import HybridConfig
from hybrid.config.parse import to_dotted, to_plain
from hybrid.data import GlobalBatchSampler, iter_global_batches, load_tokenizer
from hybrid.distributed import destroy_distributed
from hybrid.engine.builders import no_weight_decay_rule
from hybrid.monitor import IterationMetrics, TrainingMonitor, resolve_peak_flops
from hybrid.monitor.wandb_writer import wandb_dir
from hybrid.pipeline.split import split_from_config
from hybrid.topology import Topology
from hybrid.training.cli import parse_args, validate
from hybrid.training.data import build_data, packed_document_ids
from hybrid.training.exit import ExitConditions
from hybrid.training.failure import flag_context, quiet_unless, run_main
from hybrid.training.health import DivergenceGuard, TrainingDiverged, non_finite_weights_message
from hybrid.training.load_target import hf_model_message, is_hf_model_folder, same_folder
from hybrid.training.loss_spike import LossSpikeGuard
from hybrid.training.model import model_config
from hybrid.training.moe_report import MoEReporter
from hybrid.training.profile import StepProfile, profile_line, steady_state_start
from hybrid.training.seeding import seed_everything
from hybrid.training.torch_profiler import TorchProfiler, check_settings
from hybrid.training.summary import count_exempt, optimizer_line


def _log(topology: Topology, message: str) -> None:
    if topology.rank == 0:
        print(message, flush=True)


class Trainer:
    """Builds the topology, model, engine and data from a :class:`~hybrid.config.HybridConfig`, then trains.

    ``config`` comes from :func:`hybrid.training.parse_args` (or is built in
    code) and should have passed :func:`hybrid.training.validate`.
    """

    def __init__(self, config: HybridConfig):
        self.config = config
        self.save_lock = None
        # Signals are only noted from the very start: a SIGTERM while building or loading (torchrun stopping
        # the job because a peer failed) must not end this rank before it has said why the job failed.
        self.exit = ExitConditions(config.run.exit_interval, config.run.exit_duration_in_mins)
        try:
            self._build(config)
        except BaseException:
            self.exit.restore()
            if self.save_lock is not None:
                self.save_lock.release()
            self._abandon_collectives()
            raise

    def _abandon_collectives(self) -> None:
        """After a failure: close the topology now, ignoring its in-flight collectives' errors.

        They failed because this rank or a peer did; left to the exit hook they
        would print a second, misleading traceback after the real error.
        """
        topology = getattr(self, "topology", None)
        if topology is not None:
            with contextlib.suppress(Exception):
                topology.close()

    def _build(self, config: HybridConfig) -> None:
        timeout_s = config.distributed.timeout_minutes * 60
        with self.exit.signals_end_the_process():
            hybrid.init_distributed(timeout_s=timeout_s)
        # Unset tensor_parallel_size means 1 when hybrid builds the topology (as hybrid.initialize does).
        # The timeout reaches every TP/DP/PP group, not just the default one.
        self.topology = Topology(tp=config.tensor_parallel_size or 1, pp=config.pipeline.size or 1,
                                 timeout_s=timeout_s, allow_tp_across_nodes=config.distributed.allow_tp_across_nodes,
                                 ep=config.expert_parallel_size or 1, cp=config.context_parallel_size or 1)
        topo = self.topology
        check_settings(config, topo.world_size)  # --profile's window and ranks, the wandb package
        # Before the model is built, so that a refused start costs seconds: where --load resumes (an
        # unclear one is an error, never a silent fresh start), and the --save folder becomes this run's
        # until train() ends (a second job saving there is refused).
        with flag_context(f"--load {config.checkpoint.load}"):
            resume = find_resume_point(config.checkpoint.load) if config.checkpoint.load is not None else None
            if resume is None and config.checkpoint.load is not None:
                self._check_starting_from_scratch(config)
        self.save_lock = None
        if config.checkpoint.save is not None and not config.run.skip_train:
            self.save_lock = lock_save_dir(config.checkpoint.save, holder=topo.rank == 0,
                                           all_gather_object=topo.comm.all_gather_object)
        # None without tokenizer files (mock data, --vocab-size)
        self.tokenizer = load_tokenizer(config.data.tokenizer)
        vocab = config.model.vocab_size or (self.tokenizer.vocab_size if self.tokenizer else None)
        self.model_config = model_config(config, vocab or 0).validate(topo.tp_size, topo.ep_size, topo.cp_size)
        from model_zoo import GPTModel, flops_per_token

        seed_everything(config.seed)
        split = split_from_config(config.pipeline, self.model_config.num_layers, topo.pp_size)
        self.model = GPTModel(self.model_config, topo, device=topo.device, seed=config.seed, split=split)
        self.moe_report = MoEReporter.for_model(self.model, self.model_config, topo)  # None: a dense model
        # Counted on the whole parameters, before an optimizer may partition them.
        self._decay_exempt = count_exempt(self.model.named_parameters(), no_weight_decay_rule(config, None))
        self.compile_report = None  # --torch-compile: each block compiled (model_zoo.compile), reported once
        if config.model.compile:
            from model_zoo.compile import compile_blocks, default_cache_dir

            self.compile_report = compile_blocks(self.model, cache_dir=default_cache_dir(
                config.model.compile_cache_dir, config.checkpoint.save))
        self.engine = hybrid.initialize(self.model, config, topology=topo)
        self.engine.count_grad_zeros = config.logging.log_num_zeros_in_grad
        run = config.run
        # fp16's scaler skips non-finite steps on purpose; fp32 and bf16 have nothing to rescue them
        spike = (LossSpikeGuard(run.loss_spike_factor, run.loss_spike_window)
                 if run.loss_spike_factor is not None else None)
        self.guard = DivergenceGuard(run.max_consecutive_skipped_steps, self.engine.optimizer.loss_scaler,
                                     stop_at_non_finite=run.check_for_nan_in_loss_and_grad
                                     and config.precision != "fp16", spike=spike)
        self.batch = self.engine.batch
        run = config.run
        self.iteration = 0
        if resume is not None:
            self._load(str(resume))
        elif same_folder(config.checkpoint.load, config.checkpoint.save):
            _log(topo, f"--load {config.checkpoint.load}: no checkpoint there yet, starting from scratch")
        elif config.checkpoint.load is not None:
            # not the first launch of a job that resumes where it saves: likely the wrong folder
            _log(topo, f"hybrid-train: warning: --load {config.checkpoint.load}: no checkpoint there yet, starting "
                       f"from scratch with random weights although --save is {config.checkpoint.save or 'unset'}, "
                       f"another folder; check --load (--exit-on-missing-checkpoint makes this an error)")
        # the run's length in optimizer steps: given, or every whole global batch within run.train_samples;
        # an evaluation run ends where it starts
        if run.skip_train:
            self.train_iters = self.iteration
        else:
            self.train_iters = (run.train_iters if run.train_iters is not None
                                else self.batch.schedule.steps_within(run.train_samples))
        eod = self.tokenizer.eod_id if self.tokenizer else None
        train_samples = 0 if run.skip_train else self.batch.schedule.samples_after(self.train_iters)
        self.data = build_data(config, self.model_config.seq_length, self.model_config.vocab_size, train_samples,
                               self.batch.global_batch_size, eod, rank=topo.rank, barrier=topo.comm.barrier)
        peak = resolve_peak_flops(topo.device, config.precision, config.logging.peak_tflops)
        self.monitor = TrainingMonitor(
            train_iters=self.train_iters, log_interval=config.logging.log_interval,
            is_logging_rank=topo.rank == 0, seq_length=self.model_config.seq_length, world_size=topo.world_size,
            flops_per_token=flops_per_token(self.model_config), peak=peak,
            tensorboard_dir=config.logging.tensorboard_dir, device=topo.device,
            moe_per_layer=config.logging.moe_per_layer_logging, wandb_project=config.logging.wandb_project,
            wandb_exp_name=config.logging.wandb_exp_name,
            wandb_dir=wandb_dir(config.logging.wandb_save_dir, config.checkpoint.save))
        self.history = []  # (iteration, DP-averaged lm loss) of this run, for callers and tests
        self.evaluations = []  # (split, iteration, loss) of each evaluation, "valid" or "test"
        self.profile = StepProfile(self.topology.comm, steady_state_start(
            config.optimizer.type, config.optimizer.freeze_step, self.iteration))
        self.run_profile: Optional[dict] = None  # the closing "run profile" figures, once train() has finished
        log = config.logging  # --profile: a torch.profiler trace of iterations [start, end) on the chosen ranks
        self.torch_profiler = TorchProfiler(start=log.profile_step_start, end=log.profile_step_end,
                                            ranks=log.profile_ranks if log.profile else (), rank=topo.rank,
                                            trace_dir=log.tensorboard_dir, first_iteration=self.iteration)

    @staticmethod
    def _check_starting_from_scratch(config: HybridConfig) -> None:
        """``--load`` holds no checkpoint: refused where the run needs one, else the run starts from scratch."""
        load = config.checkpoint.load
        if is_hf_model_folder(load):
            raise CheckpointNotFoundError(hf_model_message(load))
        if config.run.skip_train:
            # evaluating fresh weights where a checkpoint's were meant would report a meaningless loss
            raise CheckpointNotFoundError(f"{load} holds no checkpoint for --skip-train to evaluate; give a "
                                          f"checkpoint's directory, or no --load to evaluate the initial weights")
        if config.checkpoint.finetune:
            raise CheckpointNotFoundError(f"{load} holds no checkpoint for --finetune to start from; give a "
                                          f"checkpoint's folder (DIR or DIR/iter_N), or leave out --finetune and "
                                          f"--load to train from scratch")
        if config.checkpoint.exit_on_missing_checkpoint:
            raise CheckpointNotFoundError(f"{load} holds no checkpoint (--exit-on-missing-checkpoint); give a "
                                          f"checkpoint's directory, or leave the flag out to start from scratch")

    @property
    def consumed_samples(self) -> int:
        """Samples the run has trained on, the resumed run's included: the engine's count."""
        return self.engine.consumed_samples

    # ---- checkpoints ------------------------------------------------------------------------------
    def _load(self, path: str) -> None:
        """Resume from ``path``; weights only with ``--finetune`` (from iteration 0) and ``--skip-train`` (at the
        checkpoint's iteration: evaluation needs no optimizer state); without the optimizer state
        (``--no-load-optim``: a fresh optimizer at the saved position) or the generators (``--no-load-rng``)."""
        ckpt, skip_train = self.config.checkpoint, self.config.run.skip_train
        weights_only = ckpt.finetune or skip_train
        with flag_context(f"--load {path}"):
            try:
                state = self.engine.load_checkpoint(path, load_optimizer=not (weights_only or ckpt.no_load_optim),
                                                    load_progress=not weights_only,
                                                    load_rng=not (weights_only or ckpt.no_load_rng),
                                                    schedule=ckpt.schedule_on_load)
            except ValueError as e:
                # The components refuse a state that does not fit this run (another optimizer, parameter
                # grouping, loss scaler) with a ValueError naming what differs: the checkpoint's problem.
                raise CheckpointError(str(e)) from e
        if not ckpt.finetune:
            self.iteration = state["iteration"]
        why = "--finetune" if ckpt.finetune else "--skip-train"
        left = [what for what, flag in (("the optimizer state", ckpt.no_load_optim), ("the RNG state", ckpt.no_load_rng))
                if flag]
        _log(self.topology, f"loaded {state['path']} (iteration {state['iteration']}, "
                            f"{state['consumed_samples']} samples consumed)"
                            + (f" weights only ({why})" if weights_only else
                               f" without {' and '.join(left)} (--no-load-optim/--no-load-rng)" if left else ""))

    def saved_settings(self) -> dict:
        """The settings stored with each checkpoint (``client_state["args"]``): the tree, batch resolved.

        The global batch is stored as run (micro x accumulation x DP when it was
        derived): offline tools re-count micro-steps from it when they reshard.
        """
        settings = to_plain(self.config)
        settings["global_batch_size"] = self.batch.global_batch_size
        return settings

    def save(self) -> None:
        """Save a checkpoint of this iteration (collective); refused when the weights are not finite.

        A save during a run of skipped steps is marked unhealthy, so that
        ``--keep-last`` keeps the newest healthy checkpoint to resume from.
        With ``--async-save`` it first waits for the save in flight (reporting
        it), then returns once this rank's state is copied to host memory; the
        save is reported when a later iteration collects it (:meth:`_collect_save`).
        """
        ckpt = self.config.checkpoint
        if not self.engine.optimizer.weights_finite():
            self.monitor.flush_interval()
            raise TrainingDiverged(non_finite_weights_message(self.iteration, ckpt.save))
        self._collect_save(wait=True)
        start = time.perf_counter()
        with flag_context(f"--save {ckpt.save}"):
            path = self.engine.save_checkpoint(ckpt.save, self.iteration,
                                               client_state={"args": self.saved_settings()},
                                               keep_last=ckpt.keep_last, healthy=self.guard.healthy)
        elapsed = time.perf_counter() - start
        note = "" if self.guard.healthy else (f" (marked unhealthy: {self.guard.consecutive} consecutive skipped "
                                              f"step(s) before it)")
        if ckpt.async_save:
            _log(self.topology, f"saving checkpoint {path} in the background{note} (the call blocked "
                                f"{elapsed:.2f} s; the next update waits for the host copy if unfinished)")
            return
        self.monitor.record_checkpoint(self.iteration, elapsed, elapsed, checkpoint_bytes(path))
        _log(self.topology, f"saved checkpoint {path}{note}")

    def _collect_save(self, wait: bool, verify: bool = False) -> None:
        """Report a background save that has finished (or, with ``wait``, the one in flight once it has).

        Collective while a save is in flight (:meth:`~hybrid.engine.Engine.poll_checkpoint`). A failed
        save raises its :class:`~hybrid.checkpoint.CheckpointError` (one line naming the file; ``latest``
        still names the previous checkpoint). ``verify``: re-read this rank's files and check their sha256
        against ``metadata.json`` first (at exit and at the end of training).
        """
        with flag_context(f"--save {self.config.checkpoint.save}"):
            report = self.engine.wait_checkpoint() if wait else self.engine.poll_checkpoint()
            if report is None:
                return
            if verify:
                report.verify()
        self.monitor.record_checkpoint(report.iteration, report.blocking_s, report.write_s, report.nbytes)
        _log(self.topology, f"saved checkpoint {report.path} in the background ({report.nbytes / 2**20:.1f} MiB "
                            f"in {report.write_s:.1f} s; training blocked {report.blocking_s:.2f} s"
                            f"{', verified' if verify else ''})")

    # ---- one iteration ----------------------------------------------------------------------------
    def _model_inputs(self, micro_batches) -> list:
        """Each micro-batch's keyword arguments of the model's ``forward_part``, on the device; with
        ``data.reset_attention_mask`` the ``document_ids`` ``[b, s]`` that keep attention inside each packed
        document (:func:`~hybrid.training.data.packed_document_ids`)."""
        device = self.topology.device
        documents = self.config.data.reset_attention_mask
        return [{"input_ids": mb["tokens"].to(device), "labels": mb["labels"].to(device),
                 "loss_mask": mb["loss_mask"].to(device), "position_ids": mb["position_ids"].to(device),
                 **({"document_ids": packed_document_ids(mb["tokens"], self.tokenizer.eod_id).to(device)}
                    if documents else {})}
                for mb in micro_batches]

    def _train_step(self, micro_batches) -> float:
        """One global batch through the pipeline schedule (plain accumulation at pp=1); the DP-mean loss."""
        _, loss = self.engine.train_batch(self._model_inputs(micro_batches), dp_mean=True)
        return loss

    @torch.no_grad()
    def evaluate(self, split: str = "valid") -> Optional[float]:
        """The loss of ``split``'s (``"valid"`` or ``"test"``) first ``--eval-iters`` global batches
        (:meth:`~hybrid.engine.Engine.eval_batches`: collective over ``"dp"``; their token losses over their
        unmasked tokens with ``--calculate-per-token-loss``); None where the run has no data for that split."""
        dataset = getattr(self.data, split)
        if dataset is None:
            return None
        engine = self.engine
        engine.eval()
        sampler = GlobalBatchSampler(len(dataset), 0, self.batch.micro_batch_size,
                                     self.batch.global_batch_size, self.topology.dp_rank, self.topology.dp_size)
        batches = itertools.islice(iter_global_batches(dataset, sampler), self.config.eval.iters)
        # (in eval mode the MoE layers do not count their routing: the report and the expert bias see training's)
        loss = engine.eval_batches(self._model_inputs(micro_batches) for micro_batches in batches)
        engine.train()
        return loss

    # ---- the loop -----------------------------------------------------------------------------------
    def train(self) -> int:
        """Train to ``--train-iters`` (or an exit condition), then evaluate; returns the last iteration.

        With ``--skip-train``: evaluate the model as built or loaded, at its iteration, and save nothing.
        """
        config, topo = self.config, self.topology
        self.monitor.announce()
        self.monitor.log_hparams(to_dotted(config))
        where = (f"{self.model_config.num_layers}-layer GPT on {topo.describe().split(' rank=')[0]}, device "
                 f"{topo.device.type}, ZeRO stage {config.zero.stage}, {config.precision}")
        if config.run.skip_train:
            _log(topo, f"evaluating {where}, at iteration {self.iteration} (--skip-train: no training step, "
                       f"nothing saved)")
        else:
            _log(topo, optimizer_line(config, *self._decay_exempt))
            _log(topo, f"training {where}, from iteration {self.iteration}")
            _log(topo, f"{self.batch.schedule.describe()}; {self.train_iters} iterations, "
                       f"{self.batch.schedule.samples_after(self.train_iters)} samples")
        if self.data.test_skipped is not None:
            _log(topo, f"no test evaluation: {self.data.test_skipped}")
        try:
            if config.run.skip_train or self._train_loop():
                self._final_evaluations()
            self._collect_save(wait=True, verify=True)
            self._report_inter_node_traffic()
            self._report_profile()
        except BaseException:
            self.engine.abandon_checkpoint()  # no commit on a failing path: latest stays on the previous one
            self._abandon_collectives()
            raise
        finally:
            self.exit.restore()
            self.torch_profiler.close()
            self.monitor.close()
            self.engine.close()
            if self.save_lock is not None:
                self.save_lock.release()
        return self.iteration

    def _train_loop(self) -> bool:
        """The iterations up to ``--train-iters``; False when an exit condition (a signal, ``--exit-interval``,
        ``--exit-duration-in-mins``) ended them early, after saving."""
        config, topo = self.config, self.topology
        train_iters, save_dir = self.train_iters, config.checkpoint.save
        eval_interval, save_interval = config.eval.interval, config.checkpoint.save_interval
        sampler = GlobalBatchSampler(len(self.data.train), self.consumed_samples, self.batch.micro_batch_size,
                                     self.batch.schedule, topo.dp_rank, topo.dp_size)
        batches = iter_global_batches(self.data.train, sampler)
        while self.iteration < train_iters:
            self._collect_save(wait=False)
            start = time.perf_counter()
            skipped_before = self.engine.skipped_steps
            batch_size = self.engine.global_batch_size
            self.guard.before_step()
            self.torch_profiler.step(self.iteration + 1)
            self.profile.begin()
            loss = self._train_step(next(batches))
            self.profile.end()
            self.iteration += 1
            self.history.append((self.iteration, loss))
            if self.compile_report is not None and len(self.history) == 1:  # the first step compiled the blocks
                _log(topo, self.compile_report.line())
            self.monitor.record(IterationMetrics(
                iteration=self.iteration, consumed_samples=self.consumed_samples, lm_loss=loss,
                learning_rate=self.engine.last_lr if self.engine.last_lr is not None else self.engine.lr,
                batch_size=batch_size, iteration_time_s=time.perf_counter() - start,
                grad_norm=self.engine.get_grad_norm(),
                loss_scale=self.engine.loss_scale if config.precision == "fp16" else None,
                skipped=self.engine.skipped_steps > skipped_before,
                params_norm=self.engine.get_params_norm() if config.logging.log_params_norm else None,
                num_zeros=self.engine.get_num_zeros_in_grad(),
                # collective: every rank gathers the MoE routing where the monitor reports
                moe=self.moe_report.gather() if self.moe_report and self.monitor.ends_interval(self.iteration)
                else None))
            diverged = self.guard.check(self.iteration, self.engine.skipped_steps > skipped_before, loss, topo,
                                        grad_norm=self.engine.get_grad_norm(),
                                        own_losses=self.engine.last_pipeline_stats.losses)
            if diverged is not None:
                self.monitor.flush_interval()
                raise TrainingDiverged(self._keep_save_in_flight(diverged))
            if eval_interval and self.iteration % eval_interval == 0:
                self._report_evaluation("valid")
            reason = self.exit.check(self.iteration, topo)
            saving = save_dir is not None and (
                reason is not None
                or (save_interval and self.iteration % save_interval == 0)
                or self.iteration == train_iters)
            if saving:
                if reason is not None:
                    self._collect_save(wait=True, verify=True)  # the save in flight, before the final one
                self.save()
            if reason is not None:
                self.monitor.flush_interval()
                _log(topo, f"exiting at iteration {self.iteration}: {reason}")
                return False
        return True

    def _keep_save_in_flight(self, diverged: str) -> str:
        """Before a divergence stop: commit the background save in flight, of an earlier iteration whose weights
        were finite (its checks ran when it was submitted), rather than abandon it; its failure joins the
        message. Collective while a save is in flight: every rank stops at the same iteration."""
        try:
            self._collect_save(wait=True)
        except CheckpointError as e:
            return f"{diverged} (besides, {e})"
        return diverged

    def _final_evaluations(self) -> None:
        """At the end of training (or of ``--skip-train``): the validation split, unless this iteration's
        periodic evaluation has just read it, then the test split."""
        interval = self.config.eval.interval
        if interval and (self.config.run.skip_train or self.iteration % interval != 0):
            self._report_evaluation("valid")
        self._report_evaluation("test")

    def _report_inter_node_traffic(self) -> None:
        """On more than one node, one line from rank 0: the bytes each node sent to the others (the
        communicator's count, :meth:`hybrid.comm.Communicator.report`). Collective over the world."""
        topo = self.topology
        nodes = topo.nodes
        if topo.world_size <= nodes.ranks_per_node:
            return
        sent = topo.comm.all_gather_object(topo.comm.inter_node_total())
        per_node = [0.0] * (topo.world_size // nodes.ranks_per_node)
        for rank, count in enumerate(sent):
            per_node[nodes.node_of(rank)] += count
        _log(topo, "inter-node traffic (bytes sent off each node): "
                   + ", ".join(f"node {k} {int(b)}" for k, b in enumerate(per_node)))

    def _report_profile(self) -> None:
        """One line from rank 0: iteration time, exposed communication and peak RSS per rank
        (:mod:`hybrid.training.profile`). Collective over the world."""
        summary = self.run_profile = self.profile.summary()
        if summary is not None:
            _log(self.topology, profile_line(summary))

    def _report_evaluation(self, split: str) -> None:
        """Evaluate ``split`` (collective) and report its loss; nothing where the run has no such data."""
        loss = self.evaluate(split)
        if loss is not None:
            self.evaluations.append((split, self.iteration, loss))
            self.monitor.record_evaluation(split, self.iteration, loss)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``hybrid-train``: 0 when training finished; a user error exits non-zero with one line from rank 0.

    Settings, checkpoint and data errors exit 1, a diverged run 3 (see
    :mod:`hybrid.training.failure`); a bug keeps its traceback.
    """
    return run_main(lambda: _train(argv))


def _train(argv: Optional[Sequence[str]]) -> int:
    # Every rank parses the same flags; argparse's usage errors are printed by rank 0 alone.
    with quiet_unless(os.environ.get("RANK", "0") == "0"):
        config = parse_args(argv)
    validate(config, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    trainer = Trainer(config)
    trainer.train()
    # No rank may tear down its connections while a peer still talks to it; then in-flight work and
    # the per-axis groups go before the default group.
    trainer.topology.comm.barrier()
    trainer.topology.close()
    destroy_distributed()
    return 0
