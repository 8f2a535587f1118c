"""Models, data and single-process references shared by the ZeRO tests."""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 32
SEQ = 8


class TiedMLP(nn.Module):
    """A small language model with a tied embedding/head weight and a frozen layer."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 24):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.norm = nn.LayerNorm(4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.frozen = nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.fc2(F.gelu(self.norm(self.fc1(h))))
        h = self.frozen(h)
        return F.cross_entropy(self.head(h).flatten(0, 1).float(), y.flatten())


def no_decay(name: str, p: torch.nn.Parameter) -> bool:
    return p.ndim < 2


def token_batch(step: int, n: int, vocab: int = VOCAB, seq: int = SEQ,
                copy: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``step``: ``n`` random sequences and labels (the same on every rank).

    Random labels leave nothing to learn (the loss stays near log(vocab));
    ``copy=True`` makes the label the input token, which the tied embedding
    learns within a few steps.
    """
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, vocab, (n, seq), generator=g)
    return (x, x.clone()) if copy else (x, torch.randint(0, vocab, (n, seq), generator=g))


def reference_adamw(model: nn.Module, steps: int, global_batch: int, *, lr: float, weight_decay: float,
                    clip: float = 0.0, vocab: int = VOCAB, seq: int = SEQ, export=None, copy: bool = False,
                    eps: float = 1e-8):
    """Plain single-process torch.optim.AdamW on whole global batches.

    Returns (losses, grad norms before clipping, {name: final param as numpy});
    ``export(model)`` -> {name: tensor} overrides how the final parameters are read.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if not no_decay(n, p)], "weight_decay": weight_decay},
              {"params": [p for n, p in named if no_decay(n, p)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, eps=eps)
    losses, norms = [], []
    for s in range(steps):
        x, y = token_batch(s, global_batch, vocab, seq, copy)
        loss = model(x, y)
        loss.backward()
        params = [p for _, p in named]
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    final = export(model) if export is not None else dict(model.named_parameters())
    return losses, norms, {n: p.detach().float().numpy().copy() for n, p in final.items()}


def train_zero(model: nn.Module, opt, topology, steps: int, micro: int, gas: int, *,
               vocab: int = VOCAB, seq: int = SEQ, loss_hook=None, copy: bool = False) -> Dict[str, list]:
    """Train with a ZeroOptimizer; this DP rank takes its slice of every global batch.

    Returns this rank's mean micro-batch loss per step, grad norms, and step results.
    """
    dp, r = topology.dp_size, topology.dp_rank
    out: Dict[str, list] = {"losses": [], "norms": [], "updated": [], "scales": []}
    for s in range(steps):
        x, y = token_batch(s, micro * gas * dp, vocab, seq, copy)
        total = 0.0
        for k in range(gas):
            lo = (r * gas + k) * micro
            loss = model(x[lo: lo + micro], y[lo: lo + micro])
            total += loss.item() / gas
            opt.backward(loss_hook(s, loss) if loss_hook else loss)
        out["scales"].append(opt.loss_scale)
        out["updated"].append(opt.step())
        opt.zero_grad()
        out["losses"].append(total)
        out["norms"].append(opt.get_grad_norm())
    return out


def numpy_params(model: nn.Module) -> Dict[str, np.ndarray]:
    return {n: p.detach().float().numpy().copy() for n, p in model.named_parameters()}


def max_rel_diff(a: Dict[str, np.ndarray], b: Dict[str, np.ndarray]) -> float:
    """Largest per-tensor ``max|a-b| / max|b|`` over the names of ``b`` (which ``a`` must all have)."""
    assert set(b) <= set(a), sorted(set(b) - set(a))
    worst = 0.0
    for name, ref in b.items():
        denom = max(float(np.abs(ref).max()), 1e-12)
        worst = max(worst, float(np.abs(a[name] - ref).max()) / denom)
    return worst


def rel_diff_list(a: List[float], b: List[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def dp_mean(per_rank: List[List[float]]) -> List[float]:
    """Average per-step values over DP ranks (each rank's list is its local micro-batch means)."""
    return [float(np.mean(v)) for v in zip(*per_rank)]


_OPTIMIZER_KEYS = {"optimizer": "type", "lr": "lr", "betas": "betas", "eps": "eps", "weight_decay": "weight_decay",
                   "momentum": "momentum", "freeze_step": "freeze_step", "var_freeze_step": "var_freeze_step",
                   "var_update_scaler": "var_update_scaler", "local_step_scaler": "local_step_scaler",
                   "local_step_clipper": "local_step_clipper"}


def make_zero(model: nn.Module, topology, **kwargs):
    """``build_zero_optimizer`` with the config sections' keys and the run-time arguments given flat.

    Keys of :class:`~hybrid.config.ZeroConfig` (``stage``, ``bucket_size``, ...) go to the ``zero`` section,
    ``optimizer`` (the type), ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``momentum`` to the
    ``optimizer`` section, everything else to the optimizer's constructor.
    """
    import dataclasses

    from hybrid.config.schema import OptimizerConfig, ZeroConfig
    from hybrid.zero import build_zero_optimizer

    zero_keys = {f.name for f in dataclasses.fields(ZeroConfig)}
    zero = {k: kwargs.pop(k) for k in list(kwargs) if k in zero_keys}
    opt = {_OPTIMIZER_KEYS[k]: kwargs.pop(k) for k in list(kwargs) if k in _OPTIMIZER_KEYS}
    return build_zero_optimizer(model, topology, ZeroConfig(**zero), OptimizerConfig(**opt), **kwargs)


def clone_state(sd):
    """A deep copy of an optimizer ``state_dict()`` (tensors cloned): a state to load after training on."""
    if isinstance(sd, dict):
        return {k: clone_state(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [clone_state(v) for v in sd]
    return sd.clone() if isinstance(sd, torch.Tensor) else sd
