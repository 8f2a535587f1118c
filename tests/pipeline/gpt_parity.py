"""Ranks' side of the GPT pipeline parity tests: train through ``Engine.train_batch`` in several layouts.

The parent compares every layout with one process training the whole model with ``torch.optim.AdamW``
(:func:`tests.zero.common.reference_adamw`) on the same global batches.
"""

from __future__ import annotations

import torch

from tests.zero.common import token_batch

STEPS = 10
GLOBAL = 8
# Adam's epsilon at 1e-5, not 1e-8: with 3-4 layers some attention weights get gradients near zero, and
# Adam's g / sqrt(v) then turns rounding noise into full-size updates. One process training this model on
# the same batches split into 8 micro-batches instead of 1 differs from itself by 2.9e-5 at eps 1e-8 and by
# 1.2e-6 at eps 1e-5 (4 layers, 10 steps): only the latter leaves the 1e-5 bound meaning something.
LR, WD, CLIP, EPS = 1e-3, 0.1, 2.0, 1e-5
BUCKET = 30_000


def gpt_config(num_layers: int, tie: bool = True, sequence_parallel: bool = False, query_groups=None):
    from model_zoo import get_preset

    # the well-conditioned tiny GPT of tests/zero/test_gpt_parity.py (no biases, init_std 0.1)
    return get_preset("tiny").replace(num_layers=num_layers, hidden_size=64, num_heads=4, seq_length=16,
                                      vocab_size=500, bias=False, init_std=0.1, tie_embeddings=tie,
                                      sequence_parallel=sequence_parallel, num_query_groups=query_groups)


def engine_config(case: dict) -> dict:
    """The engine config of a test case: ``stage``, ``micro`` and optionally ``schedule``, ``per_virtual``,
    ``layers_per_stage``, ``optimizer``, ``offload``, ``precision``, ``async_save``, ``persist`` (ZeRO-3's
    persistence threshold), ``overlap`` (``zero.overlap_param_gather``)."""
    optimizer = case.get("optimizer", "adamw")
    extra = {"freeze_step": 3} if optimizer == "onebit_adam" else {}
    return {"checkpoint": {"async_save": case.get("async_save", False)}, "precision": case.get("precision", "fp32"),
            "optimizer": {"type": optimizer, "lr": LR, "weight_decay": WD, "eps": EPS, **extra}, "clip_grad": CLIP,
            "zero": {"stage": case["stage"], "bucket_size": BUCKET, "offload_optimizer": case.get("offload", "none"),
                     "overlap_param_gather": case.get("overlap", False),
                     **({"persistence_threshold": case["persist"]} if "persist" in case else {})},
            "micro_batch_size": case["micro"], "global_batch_size": GLOBAL, "steps_per_print": 0,
            "pipeline": {"schedule": case.get("schedule", "1f1b"), "layers_per_virtual_stage": case.get("per_virtual"),
                         "layers_per_stage": case.get("layers_per_stage")}}


def train_layout(case: dict) -> dict:
    """Train ``case`` (tp, pp, stage, micro, layers, tie, sp, schedule, per_virtual, optimizer) for STEPS."""
    topo, cfg, model, engine = _build(case)
    losses, norms = _steps(engine, topo, cfg, case["micro"], range(STEPS))
    stats = engine.last_pipeline_stats
    with engine.gathered_parameters():  # whole under ZeRO-3 (a no-op below it)
        params = _whole_params(model, topo)
    out = {"losses": losses, "norms": norms, "params": params, "pp_rank": topo.pp_rank,
           "dp_rank": topo.dp_rank, "max_in_flight": stats.max_in_flight,
           "inter_node": {op: v["inter_node_bytes"] for op, v in engine.comm_report().items()},
           "reduce_scatter_bytes": engine.comm_report().get("reduce_scatter/dp", {}).get("payload_bytes", 0),
           "segments": _segment_passes(engine.optimizer)}
    engine.close()
    topo.close()
    return out


def _segment_passes(opt) -> list:
    """(bytes, chunks whose passes reduce it) of every gradient segment, in launch order (stages 1-2)."""
    if not hasattr(opt, "segment_chunks"):  # stage 3 reduces units, not segments
        return []
    chunks, out = opt.segment_chunks, []
    for sid, (g, s) in enumerate(opt.reducer.order):
        group = opt.groups[g]
        out.append((group.segments[s].size * group.buffer.element_size(), 1 if chunks is None else len(chunks[sid])))
    return out


def run_cases(cases) -> list:
    return [train_layout(c) for c in cases]


def _build(case: dict):
    import hybrid
    from hybrid.config.parse import config_from_dict
    from hybrid.pipeline.split import split_from_config
    from model_zoo import GPTModel

    # ranks_per_node: one pipeline stage per node (TP and DP inside it)
    topo = hybrid.Topology(tp=case["tp"], pp=case["pp"], timeout_s=60,
                           ranks_per_node=torch.distributed.get_world_size() // case["pp"])
    cfg = gpt_config(case["layers"], case.get("tie", True), case.get("sp", False), case.get("query_groups"))
    config = config_from_dict(engine_config(case))
    model = GPTModel(cfg, topo, split=split_from_config(config.pipeline, cfg.num_layers, topo.pp_size))
    return topo, cfg, model, hybrid.initialize(model, config, topology=topo)


def _steps(engine, topo, cfg, micro: int, steps):
    """Train on global batches ``steps``, this DP rank's share of each; returns the losses and gradient norms."""
    share = GLOBAL // topo.dp_size
    r = topo.dp_rank
    losses, norms = [], []
    for s in steps:
        x, y = token_batch(s, GLOBAL, cfg.vocab_size, cfg.seq_length)
        x, y = x[r * share:(r + 1) * share], y[r * share:(r + 1) * share]
        losses.append(engine.train_batch([{"input_ids": x[i:i + micro], "labels": y[i:i + micro]}
                                          for i in range(0, share, micro)])[1])
        norms.append(engine.get_grad_norm())
        engine.poll_checkpoint()  # commits a background save once every rank has written it
    return losses, norms


def _whole_params(model, topo) -> dict:
    """This stage's parameters, TP-merged (on TP rank 0 of DP rank 0; None elsewhere)."""
    from hybrid.tensor_parallel.gather import full_state

    params = {n: t.float().numpy().copy() for n, t in full_state(model, topo).items()}
    return params if topo.tp_rank == 0 and topo.dp_rank == 0 else None


def checkpoint_chain(source: dict, targets: list, directory: str, rewrites: dict, saved_at: int, steps: int) -> dict:
    """``source`` trains ``saved_at`` steps, saves, and goes on to ``steps`` (the run that never stops); rank 0 then
    rewrites the checkpoint with the offline tool once per entry of ``rewrites`` (``{label: (directory,
    reshard_checkpoint keywords)}``), and every layout of ``targets`` loads it (``"where"``: ``"saved"`` or a
    rewrite's label), saves at once to ``"save_at_load"`` when given, and trains on to ``steps``. Returns each run's
    final parameters (whole, on TP 0 of DP 0), weights as this rank holds them (for the bit-identical checks) and
    whether its load resharded."""
    import hybrid.engine.reshard as reshard_on_load
    from hybrid.convert.reshard import reshard_checkpoint

    topo, cfg, model, engine = _build(source)
    _steps(engine, topo, cfg, source["micro"], range(saved_at))
    engine.save_checkpoint(directory)  # in the background when the source says async_save
    losses, _ = _steps(engine, topo, cfg, source["micro"], range(saved_at, steps))
    engine.wait_checkpoint()
    out = {"straight": {"params": _whole_params(model, topo), "losses": losses, "local": _local(model)}}
    engine.close()
    topo.close()
    if torch.distributed.get_rank() == 0:
        for target_dir, keywords in rewrites.values():
            reshard_checkpoint(directory, target_dir, bucket_size=BUCKET, **keywords)
    torch.distributed.barrier()
    resharded = []
    original = reshard_on_load.load_resharded

    def counted(*args, **kwargs):  # EngineCheckpoints.load takes this path only when the layouts or flat segments differ
        resharded.append(True)
        return original(*args, **kwargs)

    reshard_on_load.load_resharded = counted
    try:
        for k, target in enumerate(targets):
            topo, cfg, model, engine = _build(target)
            resharded.clear()
            engine.load_checkpoint(directory if target["where"] == "saved" else rewrites[target["where"]][0])
            if target.get("save_at_load"):
                engine.save_checkpoint(target["save_at_load"])
            losses, _ = _steps(engine, topo, cfg, target["micro"], range(saved_at, steps))
            out[k] = {"params": _whole_params(model, topo), "losses": losses, "local": _local(model),
                      "resharded": bool(resharded)}
            engine.close()
            topo.close()
    finally:
        reshard_on_load.load_resharded = original
    return out


def _local(model) -> dict:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def merged(per_rank) -> dict:
    out = {}
    for params in per_rank:
        out.update(params or {})
    return out
