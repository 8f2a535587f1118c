"""A toy layer stack for the pipeline tests, and the functions their ranks run.

The model: ``x [b, h] -> embed (a Linear) -> L x (Linear, tanh) -> head (a Linear to 1) -> mean square error``.
Every weight is defined by ``(seed, layer index)``, so a pipeline part builds exactly the layers of the full
model that it holds.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import nn

from hybrid.pipeline import AutogradStage, PipelineExecutor, split_layers

HIDDEN = 8
BATCH = 3


def _linear(seed: int, index: int, n_in: int, n_out: int) -> nn.Linear:
    g = torch.Generator().manual_seed(seed * 1000 + index)
    lin = nn.Linear(n_in, n_out)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in, generator=g) / n_in ** 0.5)
        lin.bias.copy_(torch.randn(n_out, generator=g) * 0.1)
    return lin


class Part(nn.Module):
    """Layers ``layers`` of the stack, with the embedding when ``first`` and the head and loss when ``last``."""

    def __init__(self, layers: Sequence[int], first: bool, last: bool, seed: int = 7):
        super().__init__()
        self.embed = _linear(seed, 10_000, HIDDEN, HIDDEN) if first else None
        self.layers = nn.ModuleDict({str(i): _linear(seed, i, HIDDEN, HIDDEN) for i in layers})
        self.head = _linear(seed, 20_000, HIDDEN, 1) if last else None

    def forward(self, x: Optional[torch.Tensor], batch) -> torch.Tensor:
        inputs, target = batch
        if self.embed is not None:
            x = self.embed(inputs)
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        if self.head is None:
            return x
        return ((self.head(x).squeeze(-1) - target) ** 2).mean()


def microbatches(count: int, seed: int = 3) -> List:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, HIDDEN, generator=g), torch.randn(BATCH, generator=g)) for _ in range(count)]


def grads_of(module: nn.Module) -> dict:
    return {n: p.grad.numpy().copy() for n, p in module.named_parameters() if p.grad is not None}


def reference(num_layers: int, count: int, reverse_backward: bool = False):
    """One process: the whole stack, every micro-batch's loss backpropagated (in micro-batch order, or reversed
    like GPipe). Returns the losses and every gradient."""
    model = Part(range(num_layers), first=True, last=True)
    batches = microbatches(count)
    losses = [model(None, b) for b in batches]
    for loss in (reversed(losses) if reverse_backward else losses):
        loss.backward()
    return [float(x.detach()) for x in losses], grads_of(model)


def run_pipeline(num_layers: int, count: int, schedule: str, chunks: int = 1, train: bool = True,
                 counts_by_rank: Optional[dict] = None, linger_s: float = 0.0,
                 timeout_s: Optional[float] = None, pp: Optional[int] = None):
    """One pipeline rank: build this rank's chunks, run one step, return (losses, grads, stats) as plain data.

    ``counts_by_rank`` gives some ranks another micro-batch count (a mismatched schedule); the transfer error
    that must follow is returned as a string. Those ranks then stay ``linger_s`` seconds (alive and silent, like
    a rank gone on to other work) before returning.
    """
    import time

    import hybrid
    from hybrid.comm import CollectiveError

    topo = hybrid.Topology(pp=pp or torch.distributed.get_world_size(), timeout_s=timeout_s)
    split = split_layers(num_layers, topo.pp_size, chunks)
    parts = [split.part(topo.pp_rank, c) for c in range(chunks)]
    modules = [Part(split.layers_of(topo.pp_rank, c), first=k == 0, last=k == split.num_parts - 1)
               for c, k in enumerate(parts)]
    executor = PipelineExecutor(topo, modules, schedule, activation_shape=lambda b: torch.Size((BATCH, HIDDEN)),
                                activation_dtype=torch.float32)
    count = (counts_by_rank or {}).get(topo.pp_rank, count)
    try:
        stats = executor.step(microbatches(count), AutogradStage(lambda m, k, x, b: m(x, b)), train=train)
    except CollectiveError as e:
        return {"error": str(e)}
    if topo.pp_rank in (counts_by_rank or {}):
        time.sleep(linger_s)
    grads = {}
    for m in modules:
        for name, p in m.named_parameters():
            if p.grad is not None:
                grads[name] = p.grad.numpy().copy()
    out = {"losses": stats.losses, "grads": grads, "max_in_flight": stats.max_in_flight,
           "action_s": stats.action_s, "wait_s": stats.wait_s, "step_s": stats.step_s,
           "layers": split.layers_of_rank(topo.pp_rank), "pp_rank": topo.pp_rank,
           "dp_rank": topo.dp_rank}
    topo.close()
    return out


def run_cases(cases) -> list:
    """Several ``run_pipeline`` keyword sets in one set of processes (each with its own pipeline size)."""
    return [run_pipeline(**case) for case in cases]

