"""The pretraining loop: ``python -m hybrid.train`` (console script ``hybrid-train``).

One iteration = one global batch: every DP rank runs its micro-batches
through the engine (forward, backward, and at the last one the optimizer
step), the loss is averaged over DP, and the monitor reports. Checkpoints are
saved every ``--save-interval`` iterations, on SIGTERM/SIGINT, and at
``--exit-interval`` / ``--exit-duration-in-mins``; ``--load`` resumes exactly.

Everything is read from one :class:`~hybrid.config.HybridConfig`: the engine
gets it whole (it ignores the trainer's sections), the trainer reads its own
sections (``model``, ``data``, ``checkpoint``, ``run``, ``eval``, ``logging``,
``distributed``).
"""

from __future__ import annotations

import os
import time
from typing import Optional, Sequence

import torch

import hybrid
from hybrid.checkpoint import has_checkpoint
from hybrid.checkpoint.layout import parse_iteration_dir_name
from hybrid.config import ConfigError, HybridConfig
from hybrid.config.parse import to_dotted
from hybrid.data import GlobalBatchSampler, iter_global_batches
from hybrid.distributed import destroy_distributed
from hybrid.engine.checkpoint import load_engine, save_engine
from hybrid.monitor import IterationMetrics, TrainingMonitor, resolve_peak_flops
from hybrid.topology import Topology
from hybrid.training.cli import parse_args, validate
from hybrid.training.data import build_data
from hybrid.training.exit import ExitConditions
from hybrid.training.model import model_config


def _is_iteration_dir(path: str) -> bool:
    return parse_iteration_dir_name(os.path.basename(os.path.normpath(path))) is not None


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
        timeout_s = config.distributed.timeout_minutes * 60
        hybrid.init_distributed(timeout_s=timeout_s)
        # Unset tensor_parallel_size means 1 when hybrid builds the topology (as hybrid.initialize does).
        # The timeout reaches every TP/DP/PP group, not just the default one.
        self.topology = Topology(tp=config.tensor_parallel_size or 1, timeout_s=timeout_s)
        topo = self.topology
        self.tokenizer = None
        if config.data.tokenizer_model is not None:
            from hybrid.data import SentencePieceTokenizer

            self.tokenizer = SentencePieceTokenizer(config.data.tokenizer_model)
        vocab = config.model.vocab_size or (self.tokenizer.vocab_size if self.tokenizer else None)
        self.model_config = model_config(config, vocab or 0).validate(topo.tp_size)
        from model_zoo import GPTModel, flops_per_token

        torch.manual_seed(config.seed)
        self.model = GPTModel(self.model_config, topo, device=topo.device, seed=config.seed)
        self.engine = hybrid.initialize(self.model, config, topology=topo)
        self.batch = self.engine.batch
        self.iteration, self.consumed_samples = 0, 0
        load = config.checkpoint.load
        if load is not None and (has_checkpoint(load) or _is_iteration_dir(load)):
            self._load(load)
        elif load is not None:
            _log(topo, f"--load {load}: no checkpoint there yet, starting from scratch")
        eod = self.tokenizer.eod_id if self.tokenizer else None
        self.data = build_data(config, self.model_config.seq_length, self.model_config.vocab_size,
                               self.batch.global_batch_size, eod, rank=topo.rank, barrier=topo.comm.barrier)
        peak = resolve_peak_flops(topo.device, config.precision, config.logging.peak_tflops)
        self.monitor = TrainingMonitor(
            train_iters=config.run.train_iters, log_interval=config.logging.log_interval,
            is_logging_rank=topo.rank == 0, seq_length=self.model_config.seq_length, world_size=topo.world_size,
            flops_per_token=flops_per_token(self.model_config), peak=peak,
            tensorboard_dir=config.logging.tensorboard_dir, device=topo.device)
        self.exit = ExitConditions(config.run.exit_interval, config.run.exit_duration_in_mins)
        self.history = []  # (iteration, DP-averaged lm loss) of this run, for callers and tests

    # ---- checkpoints ------------------------------------------------------------------------------
    def _load(self, path: str) -> None:
        ckpt = self.config.checkpoint
        state = load_engine(self.engine, path, load_optimizer=not ckpt.finetune,
                            keep_configured_schedule=ckpt.override_opt_param_scheduler)
        if not ckpt.finetune:
            self.iteration = state["iteration"]
            self.consumed_samples = state["consumed_samples"]
        _log(self.topology, f"loaded {state['path']} (iteration {state['iteration']}, "
                            f"{state['consumed_samples']} samples consumed)"
                            + (" weights only (--finetune)" if ckpt.finetune else ""))

    def saved_settings(self) -> dict:
        """The settings stored with each checkpoint (``client_state["args"]``): the tree, batch resolved.

        The global batch is stored as run (micro x accumulation x DP when it was
        derived): offline tools re-count micro-steps from it when they reshard.
        """
        settings = self.config.to_dict()
        settings["global_batch_size"] = self.batch.global_batch_size
        return settings

    def save(self) -> None:
        ckpt = self.config.checkpoint
        path = save_engine(self.engine, ckpt.save, self.iteration, consumed_samples=self.consumed_samples,
                           client_state={"args": self.saved_settings()}, keep_last=ckpt.keep_last)
        _log(self.topology, f"saved checkpoint {path}")

    # ---- one iteration ----------------------------------------------------------------------------
    def _train_step(self, micro_batches) -> float:
        engine, device = self.engine, self.topology.device
        losses = []
        for mb in micro_batches:
            loss = engine(mb["tokens"].to(device), labels=mb["labels"].to(device),
                          loss_mask=mb["loss_mask"].to(device), position_ids=mb["position_ids"].to(device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().float())
        mean = torch.stack(losses).mean()
        self.topology.comm.all_reduce(mean, "dp", op="avg")
        return float(mean)

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        if self.data.valid is None:
            return None
        engine, device = self.engine, self.topology.device
        engine.eval()
        sampler = GlobalBatchSampler(len(self.data.valid), 0, self.batch.micro_batch_size,
                                     self.batch.global_batch_size, self.topology.dp_rank, self.topology.dp_size)
        losses = []
        for k, micro_batches in enumerate(iter_global_batches(self.data.valid, sampler)):
            if k >= self.config.eval.iters:
                break
            for mb in micro_batches:
                losses.append(engine(mb["tokens"].to(device), labels=mb["labels"].to(device),
                                     loss_mask=mb["loss_mask"].to(device),
                                     position_ids=mb["position_ids"].to(device)).float())
        engine.train()
        mean = torch.stack(losses).mean()
        self.topology.comm.all_reduce(mean, "dp", op="avg")
        return float(mean)

    # ---- the loop -----------------------------------------------------------------------------------
    def train(self) -> int:
        """Train to ``--train-iters`` (or an exit condition); returns the last iteration."""
        config, topo = self.config, self.topology
        train_iters, eval_interval, save_dir = config.run.train_iters, config.eval.interval, config.checkpoint.save
        save_interval = config.checkpoint.save_interval
        self.monitor.announce()
        self.monitor.log_hparams(to_dotted(config))
        _log(topo, f"training {self.model_config.num_layers}-layer GPT on {topo.describe().split(' rank=')[0]}, "
                   f"ZeRO stage {config.zero.stage}, {config.precision}, from iteration {self.iteration}")
        sampler = GlobalBatchSampler(len(self.data.train), self.consumed_samples, self.batch.micro_batch_size,
                                     self.batch.global_batch_size, topo.dp_rank, topo.dp_size)
        batches = iter_global_batches(self.data.train, sampler)
        try:
            while self.iteration < train_iters:
                start = time.perf_counter()
                skipped_before = self.engine.skipped_steps
                loss = self._train_step(next(batches))
                self.iteration += 1
                self.consumed_samples += self.batch.global_batch_size
                self.history.append((self.iteration, loss))
                self.monitor.record(IterationMetrics(
                    iteration=self.iteration, consumed_samples=self.consumed_samples, lm_loss=loss,
                    learning_rate=self.engine.last_lr if self.engine.last_lr is not None else self.engine.lr,
                    batch_size=self.batch.global_batch_size, iteration_time_s=time.perf_counter() - start,
                    grad_norm=self.engine.get_grad_norm(),
                    loss_scale=self.engine.loss_scale if config.precision == "fp16" else None,
                    skipped=self.engine.skipped_steps > skipped_before))
                if eval_interval and self.iteration % eval_interval == 0:
                    self._report_validation()
                reason = self.exit.check(self.iteration, topo)
                saving = save_dir is not None and (
                    reason is not None
                    or (save_interval and self.iteration % save_interval == 0)
                    or self.iteration == train_iters)
                if saving:
                    self.save()
                if reason is not None:
                    self.monitor.flush_interval()
                    _log(topo, f"exiting at iteration {self.iteration}: {reason}")
                    break
            else:
                if eval_interval and self.iteration % eval_interval != 0:
                    self._report_validation()
        finally:
            self.exit.restore()
            self.monitor.close()
            self.engine.close()
        return self.iteration

    def _report_validation(self) -> None:
        loss = self.evaluate()
        if loss is not None:
            self.monitor.record_validation(self.iteration, loss)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        config = parse_args(argv)
        validate(config, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        raise SystemExit(f"hybrid-train: error: {e}") from None
    trainer = Trainer(config)
    trainer.train()
    # No rank may tear down its connections while a peer still talks to it.
    trainer.topology.comm.barrier()
    destroy_distributed()
    return 0
