"""The pretraining loop: ``python -m hybrid.train`` (console script ``hybrid-train``).

One iteration = one global batch: every DP rank runs its micro-batches
through the engine (forward, backward, and at the last one the optimizer
step), the loss is averaged over DP, and the monitor reports. Checkpoints are
saved every ``--save-interval`` iterations, on SIGTERM/SIGINT, and at
``--exit-interval`` / ``--exit-duration-in-mins``; ``--load`` resumes exactly.
"""

from __future__ import annotations

import os
import time
from typing import Optional, Sequence

import torch

import hybrid
from hybrid.checkpoint import has_checkpoint
from hybrid.checkpoint.layout import parse_iteration_dir_name
from hybrid.data import GlobalBatchSampler, iter_global_batches
from hybrid.distributed import destroy_distributed
from hybrid.engine.checkpoint import load_engine, save_engine
from hybrid.monitor import IterationMetrics, TrainingMonitor, resolve_peak_flops
from hybrid.topology import Topology
from hybrid.training.arguments import (ArgumentError, TrainingArguments, engine_config, model_config,
                                       parse_args, to_dict, validate)
from hybrid.training.data import build_data
from hybrid.training.exit import ExitConditions


def _is_iteration_dir(path: str) -> bool:
    return parse_iteration_dir_name(os.path.basename(os.path.normpath(path))) is not None


def _log(topology: Topology, message: str) -> None:
    if topology.rank == 0:
        print(message, flush=True)


class Trainer:
    """Builds the topology, model, engine and data from :class:`TrainingArguments`, then trains."""

    def __init__(self, args: TrainingArguments):
        self.args = args
        hybrid.init_distributed(timeout_s=args.distributed_timeout_minutes * 60)
        self.topology = Topology(tp=args.tensor_model_parallel_size)
        topo = self.topology
        self.tokenizer = None
        if args.tokenizer_model is not None:
            from hybrid.data import SentencePieceTokenizer

            self.tokenizer = SentencePieceTokenizer(args.tokenizer_model)
        vocab = args.vocab_size or (self.tokenizer.vocab_size if self.tokenizer else None)
        self.model_config = model_config(args, vocab or 0).validate(topo.tp_size)
        from model_zoo import GPTModel, flops_per_token

        torch.manual_seed(args.seed)
        self.model = GPTModel(self.model_config, topo, device=topo.device, seed=args.seed)
        self.engine = hybrid.initialize(self.model, engine_config(args, topo.dp_size), topology=topo)
        self.batch = self.engine.batch
        self.iteration, self.consumed_samples = 0, 0
        if args.load is not None and (has_checkpoint(args.load) or _is_iteration_dir(args.load)):
            self._load(args.load)
        elif args.load is not None:
            _log(topo, f"--load {args.load}: no checkpoint there yet, starting from scratch")
        eod = self.tokenizer.eod_id if self.tokenizer else None
        self.data = build_data(args, self.model_config.seq_length, self.model_config.vocab_size,
                               self.batch.global_batch_size, eod, rank=topo.rank, barrier=topo.comm.barrier)
        peak = resolve_peak_flops(topo.device, args.precision, args.peak_tflops)
        self.monitor = TrainingMonitor(
            train_iters=args.train_iters, log_interval=args.log_interval, is_logging_rank=topo.rank == 0,
            seq_length=self.model_config.seq_length, world_size=topo.world_size,
            flops_per_token=flops_per_token(self.model_config), peak=peak,
            tensorboard_dir=args.tensorboard_dir, device=topo.device)
        self.exit = ExitConditions(args.exit_interval, args.exit_duration_in_mins)
        self.history = []  # (iteration, DP-averaged lm loss) of this run, for callers and tests

    # ---- checkpoints ------------------------------------------------------------------------------
    def _load(self, path: str) -> None:
        state = load_engine(self.engine, path, load_optimizer=not self.args.finetune,
                            keep_configured_schedule=self.args.override_opt_param_scheduler)
        if not self.args.finetune:
            self.iteration = state["iteration"]
            self.consumed_samples = state["consumed_samples"]
        _log(self.topology, f"loaded {state['path']} (iteration {state['iteration']}, "
                            f"{state['consumed_samples']} samples consumed)"
                            + (" weights only (--finetune)" if self.args.finetune else ""))

    def save(self) -> None:
        path = save_engine(self.engine, self.args.save, self.iteration, consumed_samples=self.consumed_samples,
                           client_state={"args": to_dict(self.args)}, keep_last=self.args.keep_last)
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
            if k >= self.args.eval_iters:
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
        args, topo = self.args, self.topology
        self.monitor.announce()
        self.monitor.log_hparams(to_dict(args))
        _log(topo, f"training {self.model_config.num_layers}-layer GPT on {topo.describe().split(' rank=')[0]}, "
                   f"ZeRO stage {args.zero_stage}, {args.precision}, from iteration {self.iteration}")
        sampler = GlobalBatchSampler(len(self.data.train), self.consumed_samples, self.batch.micro_batch_size,
                                     self.batch.global_batch_size, topo.dp_rank, topo.dp_size)
        batches = iter_global_batches(self.data.train, sampler)
        try:
            while self.iteration < args.train_iters:
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
                    loss_scale=self.engine.loss_scale if args.fp16 else None,
                    skipped=self.engine.skipped_steps > skipped_before))
                if args.eval_interval and self.iteration % args.eval_interval == 0:
                    self._report_validation()
                reason = self.exit.check(self.iteration, topo)
                saving = args.save is not None and (
                    reason is not None
                    or (args.save_interval and self.iteration % args.save_interval == 0)
                    or self.iteration == args.train_iters)
                if saving:
                    self.save()
                if reason is not None:
                    self.monitor.flush_interval()
                    _log(topo, f"exiting at iteration {self.iteration}: {reason}")
                    break
            else:
                if args.eval_interval and self.iteration % args.eval_interval != 0:
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
        args = parse_args(argv)
        validate(args, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ArgumentError as e:
        raise SystemExit(f"hybrid-train: error: {e}") from None
    trainer = Trainer(args)
    trainer.train()
    # No rank may tear down its connections while a peer still talks to it.
    trainer.topology.comm.barrier()
    destroy_distributed()
    return 0
