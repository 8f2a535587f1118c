"""A tiny trainer run inside a :func:`tests.multiproc.run_distributed` process, for the W&B and profiler tests."""

import os

# --peak-tflops: no matmul probe at start-up (seconds of a short test)
SMALL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "256", "--mock-data", "--micro-batch-size", "1", "--lr", "1e-3", "--peak-tflops", "1"]


def train(argv):
    """Parse, validate and train as ``hybrid-train`` would; this rank's global rank."""
    from hybrid.training import Trainer, parse_args, validate

    args = parse_args(argv)
    validate(args, world_size=int(os.environ["WORLD_SIZE"]))
    trainer = Trainer(args)
    trainer.train()
    return trainer.topology.rank
