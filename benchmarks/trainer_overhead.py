"""Trainer overhead: tokens/s of ``hybrid.train`` against a minimal hand-written loop, in one run.

    python benchmarks/trainer_overhead.py [--iters 40] [--rounds 3]

Both train the same model (the ``tiny`` preset) on the same random-token
batches in one process (world 1). The hand loop is what a user would write:
the model, ``torch.optim.AdamW``, forward, backward, step, zero_grad. The
trainer runs its full machinery: engine (ZeRO stage 1 at DP=1, clipping, LR
schedule), data sampler, monitor (console line per log interval) and the
per-iteration exit check. Rounds alternate between the contenders and the
median per-iteration time of each is compared; the target is >= 0.95x.

A third contender is the trainer with ``--log-params-norm --log-num-zeros-in-grad``: each step then reads the
master weights and the gradient once more. Its cost is the paired ratio of its step time to the plain
trainer's, per round (median and min-max over rounds).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.paired import paired_ratio  # noqa: E402
from hybrid.argument_parser import ArgumentParser  # noqa: E402

ARGS = ["--model", "tiny", "--mock-data", "--micro-batch-size", "8", "--lr", "1e-3", "--eval-interval", "0",
        "--weight-decay", "0.0", "--clip-grad", "1.0", "--zero-stage", "1", "--peak-tflops", "1"]


NORMS = ["--log-params-norm", "--log-num-zeros-in-grad"]


def trainer_times(iters: int, extra=()) -> list:
    from hybrid.training import Trainer, parse_args, validate

    args = parse_args(ARGS + ["--train-iters", str(iters), "--log-interval", str(iters),
                              "--lr-decay-style", "cosine", *extra])
    validate(args, world_size=1)
    trainer = Trainer(args)
    # Stamp the start of every iteration: the differences cover the whole loop body
    # (data, engine step, monitor, exit check), not just the step.
    stamps = []
    step = trainer._train_step
    trainer._train_step = lambda batch: (stamps.append(time.perf_counter()), step(batch))[1]
    trainer.train()
    return [b - a for a, b in zip(stamps[1:-1], stamps[2:])]


def hand_loop_times(iters: int) -> list:
    from hybrid.topology import Topology
    from hybrid.training.data import MockDataset
    from model_zoo import GPTModel, get_preset

    config = get_preset("tiny")
    torch.manual_seed(1234)
    model = GPTModel(config, Topology.local(), seed=1234)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    data = MockDataset(iters * 8, config.seq_length, config.vocab_size, 1234)
    times = []
    for it in range(iters):
        start = time.perf_counter()
        batch = torch.utils.data.default_collate([data[it * 8 + j] for j in range(8)])
        loss = model(batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"],
                     position_ids=batch["position_ids"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - start)
    return times[1:]


def main() -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    os.environ.pop("WORLD_SIZE", None)
    results = {"hand loop": [], "hybrid.train": [], "+ norms, zeros": []}
    per_round = {"hybrid.train": {}, "+ norms, zeros": {}}
    for r in range(opts.rounds):
        results["hand loop"] += hand_loop_times(opts.iters)
        for name, extra in (("hybrid.train", ()), ("+ norms, zeros", NORMS)):
            times = trainer_times(opts.iters, extra)
            results[name] += times
            per_round[name][r] = statistics.median(times)
    tokens = 8 * 128
    base = statistics.median(results["hand loop"])
    print(f"\ntiny GPT, micro batch 8 x seq 128, world 1, {torch.get_num_threads()} threads, "
          f"{opts.rounds} rounds x {opts.iters} iterations")
    print(f"{'contender':<14} | {'median ms/iter':>14} | {'tokens/s':>9} | {'ratio':>5}")
    for name, times in results.items():
        med = statistics.median(times)
        print(f"{name:<14} | {med * 1e3:>14.1f} | {tokens / med:>9.0f} | {base / med:>5.2f}")
    cost = paired_ratio(per_round["+ norms, zeros"], per_round["hybrid.train"])
    print(f"{' '.join(NORMS)}: step time / plain trainer's, paired per round: {cost.format()}")


if __name__ == "__main__":
    main()
