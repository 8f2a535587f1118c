"""A few steps of a plain PyTorch model through ``hybrid.initialize``, run by torchrun in the fault tests.

It calls no teardown of its own: a script written in the few-lines style must
still exit 0 (the library tears its process groups down at exit).

    torchrun --nproc-per-node 2 tests/faults/engine_script.py STAGE STEPS
"""

import sys

import torch

import hybrid


def main() -> None:
    stage, steps = int(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    engine = hybrid.initialize(model, {"zero": {"stage": stage}, "micro_batch_size": 4,
                                       "gradient_accumulation_steps": 2, "optimizer": {"lr": 1e-2}})
    g = torch.Generator().manual_seed(engine.topology.rank)
    for _ in range(steps * 2):
        x = torch.randn(4, 16, generator=g)
        engine.backward((engine(x) - x.sum(1, keepdim=True)).pow(2).mean())
        engine.step()
    print(f"rank {engine.topology.rank} done at step {engine.global_step}", flush=True)


if __name__ == "__main__":
    main()
