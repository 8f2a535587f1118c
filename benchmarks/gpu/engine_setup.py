"""Shared by parts 3-5 of the GPU verification run: the world-1 process group, the models, the engine
configurations and the batches they train on.

On a GPU the process joins a one-rank NCCL process group (``hybrid.init_distributed(backend="nccl")``),
so the engine takes its NCCL/CUDA set-up path; ``hybrid.comm`` skips collectives on one-rank groups, so
no NCCL collective moves data here. The dry run joins a one-rank gloo group on the CPU instead.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

# The ZeRO runs of parts 3 and 4: stages 1, 2, 3 and stage 2 with the optimizer offloaded to the CPU.
ZERO_RUNS: Dict[str, Dict] = {
    "zero1": dict(stage=1),
    "zero2": dict(stage=2),
    "zero3": dict(stage=3),
    "zero2_offload": dict(stage=2, offload="cpu"),
}
# AdamW hyper-parameters of every run and of part 3's torch.optim.AdamW reference.
LR, WEIGHT_DECAY, BETAS, EPS = 3e-4, 0.1, (0.9, 0.95), 1e-8


def world_one(dry_run: bool):
    """Join a one-rank process group (NCCL on a GPU, gloo in the dry run) and return its Topology."""
    import hybrid
    from hybrid import Topology

    if "RANK" not in os.environ:  # not under a launcher: be rank 0 of 1 (a rendezvous address set already stays)
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    info = hybrid.init_distributed(timeout_s=300, backend="gloo" if dry_run else "nccl")
    return Topology(tp=1), info


def model_config(dry_run: bool, preset: str, **overrides):
    """The preset on a GPU (no dropout unless ``overrides`` say so); a two-layer tiny GPT in the dry run."""
    from model_zoo import get_preset

    if dry_run:
        tiny = dict(num_layers=2, hidden_size=64, num_heads=4, seq_length=32, vocab_size=512)
        tiny.update(overrides)
        return get_preset("tiny", **tiny)
    return get_preset(preset, **{"hidden_dropout": 0.0, "attention_dropout": 0.0, **overrides})


def engine_config(run: Dict, micro: int, fused: bool = True) -> Dict:
    """``hybrid.initialize``'s config for one ZeRO run in bf16 (fp32 masters), world 1, no clipping."""
    zero = {"stage": run["stage"]}
    if run.get("offload", "none") != "none":
        zero["offload_optimizer"] = run["offload"]
    return {"precision": "bf16", "zero": zero, "micro_batch_size": micro, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "adamw", "lr": LR, "weight_decay": WEIGHT_DECAY, "betas": list(BETAS), "eps": EPS},
            "steps_per_print": 0, "use_fused_kernels": fused}


class ModelFactory:
    """Fresh copies of one initial model_zoo GPT (fp32, on ``device``).

    The constructor initialises the model from ``seed`` once (model_zoo draws every weight on the CPU,
    about 25 s for gpt2-xl) and keeps a copy of that state in host memory (pinned on a GPU machine: the
    device's memory is the engines', and gpt2-xl's fp32 copy alone is 5.8 GiB); :meth:`build` makes each
    further model on the meta device and loads the copy, about a second for gpt2-xl over PCIe.
    """

    def __init__(self, cfg, topo, device: torch.device, seed: int = 1234):
        from model_zoo import GPTModel

        self.cfg, self.topo, self.device, self.seed = cfg, topo, device, seed
        # built where the engines' models live (the topology's device: the path the engines take), then moved out
        first = GPTModel(cfg, topo, device=device, seed=seed)
        pin = device.type == "cuda"
        self.initial = {k: v.detach().to("cpu").pin_memory() if pin else v.detach().clone()
                        for k, v in first.state_dict().items()}
        del first
        if pin:
            torch.cuda.empty_cache()

    def build(self, cfg=None):
        """A fresh model with the initial weights; ``cfg``: another config of the same shapes (say, another
        recomputation), default the factory's."""
        from hybrid import param_meta
        from model_zoo import GPTModel

        model = GPTModel(cfg or self.cfg, self.topo, device="meta", seed=self.seed)
        # to_empty makes new Parameter objects, which lose the tensor-parallel metadata: set it again
        # (the initializer attribute only serves materialize(), which these models never need)
        metas = {name: param_meta.get_tp_meta(p) for name, p in model.named_parameters()}
        model.to_empty(device=self.device)
        for name, p in model.named_parameters():
            param_meta.set_tp_meta(p, **metas[name].to_json())
        model.load_state_dict(self.initial)
        model.check_inputs = False  # one host sync per step less; the batches below are in range
        return model


def build_engine(factory: ModelFactory, run: Dict, micro: int, fused: bool = True, cfg=None):
    import hybrid

    return hybrid.initialize(factory.build(cfg), engine_config(run, micro, fused), topology=factory.topo)


def batch(step: int, micro: int, cfg, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``step``: random tokens whose label is the token itself (a copy task the tied
    embedding learns within a few steps, so the loss curve falls and a wrong update shows)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_length), generator=gen).to(device)
    return x, x


def close_engine(engine) -> None:
    """Free an engine's memory before the next run builds its own."""
    engine.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> Tuple[object, float]:
    """``fn()`` and its wall time in seconds, the device's queue drained before and after."""
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - start


def peak_tflops_measured(out_dir: Path) -> Optional[float]:
    """Part 1's measured bf16 matmul TFLOP/s, if part 1 wrote it."""
    import json

    path = out_dir / "part1_env.json"
    try:
        return float(json.loads(path.read_text())["info"]["matmul_bf16_tflops"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
