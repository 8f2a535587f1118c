"""Training parity through the engine: a GPT trained 10 AdamW steps in a parallel layout against one process doing
the same in plain PyTorch (the helpers of tests/engine/test_moe_training_parity.py and test_cp_training_parity.py).

The reference is GPTModel at one process with ``torch.optim.AdamW``: each global batch's micro-batches of
``MICRO`` sequences in order (the balancing loss is a per-micro-batch quantity, so the reference takes the
micro-batches each data-parallel rank takes), each loss over the accumulation count, the balancing losses joined
to backward with the same factor, clipping at ``CLIP`` (active on some steps). Dropless routing, the balancing
loss on. Tolerances as tests/engine/test_batch_ramp_dist.py derives them: Adam's drift bound for the parameters
(tests/numerics.adam_trajectory_tolerance), its first-order effect on the loss plus the forward's rounding
(tests/numerics.transformer_bound, with the router and the k-way expert sum as two more reductions) for the losses.
"""

from __future__ import annotations

from typing import Optional

import torch

from tests.multiproc import run_distributed
from tests.numerics import U, adam_trajectory_tolerance, max_ratio, record, transformer_bound

WORLD = 4
MICRO = 2
GLOBAL = 8
STEPS = 10
LR, WD, CLIP = 0.01, 0.1, 1.0
MOE = dict(vocab_size=200, hidden_size=32, num_layers=2, num_heads=4, seq_length=16, init_std=0.05, bias=False,
           position="rope", norm="rmsnorm", mlp="swiglu", tie_embeddings=False, num_experts=4, moe_router_topk=2,
           moe_ffn_hidden_size=32, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
SEED = 5
CFG = {"optimizer": {"type": "adamw", "lr": LR, "betas": [0.9, 0.95], "weight_decay": WD},
       "steps_per_print": 0, "micro_batch_size": MICRO, "global_batch_size": GLOBAL, "clip_grad": CLIP}


def data(base: dict = MOE):
    g = torch.Generator().manual_seed(4)
    shape = (STEPS * GLOBAL, base["seq_length"])
    return torch.randint(0, base["vocab_size"], shape, generator=g), torch.randint(0, base["vocab_size"], shape,
                                                                                     generator=g)


def documents(base: dict = MOE):
    """Packed-document ids ``[n, s]`` for :func:`data`'s sequences: two documents each, the first ending at a
    position that varies from sample to sample (across the context-parallel chunks too)."""
    n, s = STEPS * GLOBAL, base["seq_length"]
    ends = 1 + (torch.arange(n) * 5) % (s - 1)
    return (torch.arange(s) >= ends[:, None]).long()


def _plain(tensors):
    return {n: t.detach().float().numpy().copy() for n, t in tensors.items()}


def train(tp: int, pp: int, ep: int, stage: int, overrides: dict, cp: int = 1, base: dict = MOE,
          compiled: bool = False, extra: Optional[dict] = None, packed: bool = False):
    """``compiled``: each transformer block through torch.compile (model_zoo.compile); ``extra``: more engine
    config keys (a pipeline schedule, zero switches); ``packed``: attention inside :func:`documents`."""
    import hybrid
    from hybrid.config.parse import config_from_dict
    from hybrid.pipeline.split import split_from_config
    from hybrid.tensor_parallel.gather import full_state
    from model_zoo import GPTConfig, GPTModel

    topo = hybrid.Topology(tp=tp, pp=pp, ep=ep, cp=cp, timeout_s=60)
    zero = {"stage": stage, **({"persistence_threshold": 0} if stage == 3 else {})}
    extra = dict(extra or {})
    config = config_from_dict({**CFG, **extra, "zero": {**zero, **extra.pop("zero", {})}})
    cfg = GPTConfig(**{**base, "sequence_parallel": tp > 1, **overrides})
    model = GPTModel(cfg, topo, seed=SEED, split=split_from_config(config.pipeline, cfg.num_layers, pp))
    if compiled:
        from model_zoo.compile import compile_blocks

        compile_blocks(model)
    engine = hybrid.initialize(model, config, topology=topo)
    ids, labels = data(base)
    docs = documents(base) if packed else None
    share = GLOBAL // topo.dp_size
    out = {"losses": [], "norms": []}
    for step in range(STEPS):
        first = step * GLOBAL + topo.dp_rank * share
        rows = [slice(k, k + MICRO) for k in range(first, first + share, MICRO)]
        _, loss = engine.train_batch([{"input_ids": ids[r], "labels": labels[r],
                                       **({"document_ids": docs[r]} if packed else {})} for r in rows], dp_mean=True)
        out["losses"].append(loss)
        out["norms"].append(engine.get_grad_norm())
    with engine.gathered_parameters():
        out["params"] = _plain(full_state(model, topo))  # whole over TP; this stage's, this ep rank's experts
    engine.close()
    topo.close()
    return out


def reference(overrides: dict, base: dict = MOE, packed: bool = False):
    from hybrid.tensor_parallel.gather import full_state
    from hybrid.topology import Topology
    from model_zoo import GPTConfig, GPTModel

    topo = Topology.local()
    model = GPTModel(GPTConfig(**{**base, **overrides}), topo, seed=SEED)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    ids, labels = data(base)
    docs = documents(base) if packed else None
    micro_count = GLOBAL // MICRO
    if model.moe_aux_scale is not None:
        model.moe_aux_scale.value = 1.0 / micro_count  # the balancing losses' gradients, as the LM loss's
    losses, norms, grad_l1 = [], [], []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for k in range(step * GLOBAL, (step + 1) * GLOBAL, MICRO):
            loss = model(ids[k:k + MICRO], labels=labels[k:k + MICRO],
                         document_ids=docs[k:k + MICRO] if packed else None)
            (loss / micro_count).backward()
            total += loss.item()
        grad_l1.append(sum(float(p.grad.abs().sum()) for p in model.parameters()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        model.after_optimizer_step()
        losses.append(total / micro_count)
    return {"losses": losses, "norms": norms, "grad_l1": grad_l1, "params": _plain(full_state(model, topo))}


NORM_TOL = 1e-2  # later steps' gradient norms: as test_batch_ramp_dist.py argues


def bounds(cfg, tokens: int):
    """Relative bounds (loss, gradients) of one forward and backward of ``cfg`` over ``tokens`` tokens against
    another summation order: :func:`tests.numerics.transformer_bound`, plus an MoE layer's two more reductions
    per layer (the router's h-term logits and each token's k-way expert sum; u per term of each, as
    transformer_bound counts a reduction: tests/numerics.U, fp32 plus the reference's)."""
    moe = cfg.num_layers * (cfg.hidden_size + cfg.moe_router_topk) * U if cfg.is_moe else 0.0
    fwd = transformer_bound(cfg, tokens, part="loss") + moe
    return fwd, transformer_bound(cfg, tokens, part="grads") + fwd


def check(runs, ref, overrides, base: dict = MOE):
    from model_zoo import GPTConfig

    cfg = GPTConfig(**{**base, **overrides})
    tokens = MICRO * cfg.seq_length
    fwd, first = bounds(cfg, tokens)
    merged = {}
    for run in runs:
        for name, value in run["params"].items():  # every context-parallel rank holds the same parameters
            if name in merged:
                assert (merged[name] == value).all(), f"{name} differs between ranks that hold it"
            merged[name] = value
        for i, (got, want) in enumerate(zip(run["losses"], ref["losses"])):
            bound = fwd * abs(want) + ref["grad_l1"][i] * adam_trajectory_tolerance(i, LR)
            ratio = record(abs(got - want) / bound if got != want else 0.0)
            assert ratio <= 1, f"step {i + 1} loss {got} vs {want}: {ratio:.2f} x the bound"
        # step 1 runs at the very same parameters: its gradient norm differs by rounding alone (a balancing loss
        # whose gradient missed its scale on one micro-batch moved it by 1e-3 relative, three times this bound)
        ratio = record(abs(run["norms"][0] - ref["norms"][0]) / (first * ref["norms"][0]))
        assert ratio <= 1, f"step 1 gradient norm {run['norms'][0]} vs {ref['norms'][0]}: {ratio:.2f} x the bound"
        for i, (got, want) in enumerate(zip(run["norms"], ref["norms"])):
            ratio = record(abs(got - want) / (NORM_TOL * want))
            assert ratio <= 1, f"step {i + 1} gradient norm {got} vs {want}"
    assert set(merged) == set(ref["params"])  # every expert came back from some rank
    for name, want in ref["params"].items():
        ratio = max_ratio(torch.from_numpy(merged[name]), torch.from_numpy(want), adam_trajectory_tolerance(STEPS, LR))
        assert ratio <= 1, f"{name}: {ratio:.2f} x the bound"
