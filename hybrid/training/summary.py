"""The effective optimizer settings, as one start-up line.

The engine's defaults are not torch's (no weight decay unless asked; biases and
norm weights exempt from it, the Megatron convention; no clipping), so the
trainer prints what this run will actually do before its first step.
"""

from __future__ import annotations

from typing import Callable, Iterable, Tuple

import torch

from hybrid.config import HybridConfig
from hybrid.config.flags import flags_of


def count_exempt(named_parameters: Iterable[Tuple[str, torch.nn.Parameter]],
                 no_weight_decay: Callable[[str, torch.nn.Parameter], bool]) -> Tuple[int, int]:
    """(exempt, trainable): how many trainable parameters ``no_weight_decay`` exempts from weight decay."""
    trainable = [(n, p) for n, p in named_parameters if p.requires_grad]
    return sum(bool(no_weight_decay(n, p)) for n, p in trainable), len(trainable)


def _schedule_words(sched) -> str:
    """``cosine schedule, 2000 warmup steps``; WSD adds its anneal (``WSD schedule, ..., exponential anneal over
    the last 500 steps``)."""
    words = f"{sched.type} schedule, {sched.warmup_length} warmup {sched.unit}"
    if sched.type == "wsd":
        words += f", {sched.wsd_decay_style} anneal over the last {sched.wsd_length} {sched.unit}"
    return words


def optimizer_line(config: HybridConfig, exempt: int, trainable: int) -> str:
    """``optimizer: adamw | lr ... | betas ... | eps ... | weight decay ... | clip-grad ... | ZeRO stage ...``."""
    opt, sched, zero = config.optimizer, config.scheduler, config.zero
    parts = [f"optimizer: {opt.type}",
             f"lr {opt.lr:g} (peak; {_schedule_words(sched)}, min {sched.min_lr:g})"]
    if opt.type == "sgd":
        parts.append(f"momentum {opt.momentum:g}")
    else:
        parts += [f"betas ({opt.betas[0]:g}, {opt.betas[1]:g})", f"eps {opt.eps:g}"]
    start, end = opt.weight_decay_range
    decay = f"weight decay {end:g}" if start == end else (
        f"weight decay {start:g} -> {end:g} ({opt.weight_decay_incr_style} over "
        f"{sched.weight_decay_incr_length} {sched.unit})")
    if not opt.decays:
        parts.append("weight decay 0 (none)")
    elif opt.decay_1d_params:
        parts.append(f"{decay} on all {trainable} parameters")
    else:
        flag = flags_of(HybridConfig, "optimizer.decay_1d_params")[0]
        parts.append(f"{decay}, {exempt} of {trainable} parameters exempt (at most one dimension: biases, norm "
                     f"weights; {flag} decays them too)")
    parts.append(f"clip-grad {config.clip_grad:g}" + (" (off)" if config.clip_grad == 0 else ""))
    offload = f", optimizer offloaded to {zero.offload_optimizer}" if zero.offload_optimizer != "none" else ""
    parts.append(f"ZeRO stage {zero.stage}{offload}")
    return " | ".join(parts)
