"""Run small real configurations on gloo ranks and report what each rank really held.

:func:`measure_configs` runs inside every rank of a ``run_distributed`` world
(all ranks take the same configs in the same order). For each config it
builds the model_zoo GPT and wraps it with ``hybrid.initialize``, trains one
warm-up step (so lazily allocated buffers exist), then one measured step:

* ``state``: live tensor bytes at the start of the step minus those alive
  before any model was built -- every byte this configuration holds between
  steps, found through the garbage collector (our own accounting);
* ``report``: ``engine.memory_report()``;
* ``saved``: bytes autograd saved during the forward pass (parameters excluded);
* ``peak``: the most live tensor bytes during the step (forward, backward and
  the optimizer step), minus the same baseline;
* ``comm``: ``comm_report()`` of the measured step.

The parent compares these with the planner (``hybrid.plan``).
"""

from __future__ import annotations

import gc
from typing import Dict, List, Sequence

import torch



def gpt_config(spec: Dict):
    from model_zoo import GPTConfig

    return GPTConfig(vocab_size=spec.get("vocab", 1000), hidden_size=spec.get("hidden", 128),
                     num_layers=spec.get("layers", 2), num_heads=spec.get("heads", 4),
                     num_query_groups=spec.get("groups"), kv_channels=spec.get("kv_channels"),
                     qk_norm=spec.get("qk_norm", False),
                     seq_length=spec.get("seq", 64), hidden_dropout=0.0, attention_dropout=0.0,
                     sequence_parallel=spec.get("sp", False), recompute=spec.get("recompute", "none"),
                     position=spec.get("position", "learned"), norm=spec.get("norm", "layernorm"),
                     mlp=spec.get("mlp", "gelu"), bias=spec.get("bias", True),
                     tie_embeddings=spec.get("tie", True))


def engine_config(spec: Dict) -> Dict:
    """The ``hybrid.initialize`` config of one spec (offload and the stage-3 knobs only when asked for)."""
    zero = {"stage": spec["stage"], "bucket_size": spec.get("bucket", 10**8)}
    if spec.get("offload", "none") != "none":
        zero["offload_optimizer"] = spec["offload"]
    # Only what a spec sets: the rest keeps the config's defaults, which the planner reads too.
    for key, zero_key in (("persist", "persistence_threshold"), ("prefetch", "prefetch_bucket_size")):
        if key in spec:
            zero[zero_key] = spec[key]
    # onebit_adam with freeze_step 1: the measured (second) step is a compressed one
    pipeline = {}
    if spec.get("pp", 1) > 1:
        pipeline = {"pipeline": {"schedule": spec.get("schedule", "1f1b"),
                                 "layers_per_virtual_stage": spec.get("per_virtual")}}
    return {"precision": spec["precision"], "zero": zero,
            "optimizer": {"type": spec.get("optimizer", "adamw"), "lr": 1e-3, "weight_decay": 0.1, "freeze_step": 1},
            "micro_batch_size": spec["micro"], "gradient_accumulation_steps": spec.get("gas", 1),
            "recompute": spec.get("recompute", "none"), "steps_per_print": 0, **pipeline}


def train_step(engine, batches, tracker=None, saved=None) -> List[int]:
    """One optimizer step of ``engine`` over ``batches`` (one micro-batch each, its own labels); with ``tracker``
    (a LiveTensorTracker) the live-tensor peak after each forward and after each backward and step, in order;
    ``saved`` (SavedActivations) watches the first forward."""
    peaks = []
    for i, x in enumerate(batches):
        if saved is not None and i == 0:
            with saved:
                loss = engine(x, x)
        else:
            loss = engine(x, x)
        if tracker is not None:
            peaks.append(tracker.peak_bytes)
            tracker.reset_peak()
        engine.backward(loss)
        del loss
        engine.step()
        if tracker is not None:
            peaks.append(tracker.peak_bytes)
            tracker.reset_peak()
    return peaks


def _measure_one(spec: Dict, baseline: int) -> Dict:
    import hybrid
    from hybrid import Topology
    from hybrid.plan.measure import LiveTensorTracker, SavedActivations, storage_keys
    from model_zoo import GPTModel

    topo = Topology(tp=spec["tp"])
    cfg = gpt_config(spec)
    gas = spec.get("gas", 1)
    model = GPTModel(cfg, topo)
    model.check_inputs = False
    engine = hybrid.initialize(model, engine_config(spec), topology=topo)
    gen = torch.Generator().manual_seed(100 + topo.dp_rank)
    batches = [torch.randint(0, cfg.vocab_size, (spec["micro"], cfg.seq_length), generator=gen)
               for _ in range(gas)]

    train_step(engine, batches)
    if spec.get("optimizer") == "onebit_adam":
        train_step(engine, batches)  # the first compressed step allocates the error buffers: measure the one after
    saved = SavedActivations(storage_keys(model.parameters()))
    with LiveTensorTracker() as tracker:
        state = tracker.start_bytes - baseline
        peaks = [p - baseline for p in train_step(engine, batches, tracker, saved)]
    opt = engine.optimizer
    out = {"state": state, "report": engine.memory_report(), "saved": saved.bytes,
           "forward_peak": peaks[0], "backward_peak": max(peaks[1:]), "peak": max(peaks), "comm": engine.comm_report(),
           "compiled_adam": bool(getattr(opt.inner, "compiled", False)), "tp_rank": topo.tp_rank,
           "dp_rank": topo.dp_rank, "dp": topo.dp_size}
    opt.remove_hooks()  # the hooks would otherwise keep the flat buffers alive past this config
    engine.close()
    del model, engine, opt, batches
    gc.collect()
    return out


def measure_configs(specs: List[Dict]) -> List[Dict]:
    from hybrid.plan.measure import live_tensor_bytes

    torch.manual_seed(0)
    baseline = live_tensor_bytes()  # what the process holds before any model (each config frees its own)
    return [_measure_one(spec, baseline) for spec in specs]


class FreshCopies(Sequence):
    """Micro-batches handed to ``train_batch`` as fresh copies of the token ids at every access: the ids a
    forward saves are then held by autograd alone, and freed by the backward, as for one process. (A caller's
    own list would keep every micro-batch's ids for the whole step: data, not activations.)"""

    def __init__(self, ids: List[torch.Tensor]):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        x = self.ids[i].clone()
        return {"input_ids": x, "labels": x}


def _measure_pipeline(spec: Dict, baseline: int) -> Dict:
    """:func:`_measure_one` for a pipeline (``spec["pp"]`` stages, ``gas`` micro-batches per step through
    ``Engine.train_batch``): the step's peak is measured whole, and ``held`` is the most saved-activation bytes
    held at once over the schedule (:class:`hybrid.plan.measure.SavedActivations`)."""
    import hybrid
    from hybrid import Topology
    from hybrid.config.parse import config_from_dict
    from hybrid.pipeline.split import split_from_config
    from hybrid.plan.measure import LiveTensorTracker, SavedActivations, storage_keys
    from model_zoo import GPTModel

    topo = Topology(tp=spec["tp"], pp=spec["pp"], timeout_s=120)
    cfg = gpt_config(spec)
    config = config_from_dict(engine_config(spec))
    model = GPTModel(cfg, topo, split=split_from_config(config.pipeline, cfg.num_layers, topo.pp_size))
    model.check_inputs = False
    engine = hybrid.initialize(model, config, topology=topo)
    gen = torch.Generator().manual_seed(100 + topo.dp_rank)
    batches = FreshCopies([torch.randint(0, cfg.vocab_size, (spec["micro"], cfg.seq_length), generator=gen)
                           for _ in range(spec["gas"])])
    engine.train_batch(batches)
    saved = SavedActivations(storage_keys(model.parameters()))
    with LiveTensorTracker() as tracker, saved:
        state = tracker.start_bytes - baseline
        engine.train_batch(batches)
        peak = tracker.peak_bytes - baseline
    out = {"state": state, "report": engine.memory_report(), "held": saved.peak_held_bytes, "peak": peak,
           "comm": engine.comm_report(), "in_flight": engine.last_pipeline_stats.max_in_flight,
           "compiled_adam": bool(getattr(engine.optimizer.inner, "compiled", False)), "tp_rank": topo.tp_rank,
           "dp_rank": topo.dp_rank, "pp_rank": topo.pp_rank}
    engine.optimizer.remove_hooks()
    engine.close()
    topo.close()
    del model, engine, batches
    gc.collect()
    return out


def measure_pipeline_configs(specs: List[Dict]) -> List[Dict]:
    from hybrid.plan.measure import live_tensor_bytes

    torch.manual_seed(0)
    baseline = live_tensor_bytes()
    return [_measure_pipeline(spec, baseline) for spec in specs]
