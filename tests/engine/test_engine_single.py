"""The engine in one process: parity with torch.optim.AdamW, precision paths, skipping, errors, docs."""

import logging
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hybrid
from hybrid.config import ConfigError
from hybrid.topology import Topology

DOCS = Path(__file__).resolve().parents[2] / "docs" / "engine.md"


class MLP(torch.nn.Module):
    def __init__(self, d_in=12, d_hidden=24, d_out=5):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.norm = torch.nn.LayerNorm(d_hidden)
        self.fc2 = torch.nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(self.norm(F.gelu(self.fc1(x))))


def make_pair(seed=0):
    torch.manual_seed(seed)
    model = MLP()
    ref = MLP()
    ref.load_state_dict(model.state_dict())
    return model, ref


def reference_adamw(ref, lr_at, weight_decay, clip):
    """torch.optim.AdamW with the engine's default grouping: 1-D parameters are not decayed."""
    decay = [p for p in ref.parameters() if p.dim() > 1]
    no_decay = [p for p in ref.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr_at(0), betas=(0.9, 0.95), eps=1e-8)

    def step(i, batch):
        for g in opt.param_groups:
            g["lr"] = lr_at(i)
        opt.zero_grad()
        loss = F.mse_loss(ref(batch[0]), batch[1])
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip > 0 else float("inf")))
        opt.step()
        return loss.item(), norm

    return step


def batches(n, size, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 12, generator=g), torch.randn(size, 5, generator=g)) for _ in range(n)]


def assert_close(a, b, rtol=1e-5, atol=1e-7):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


CFG = {"optimizer": {"type": "adamw", "lr": 0.02, "betas": [0.9, 0.95], "weight_decay": 0.1},
       "scheduler": {"type": "cosine", "warmup_iters": 3, "decay_iters": 10, "min_lr": 0.002},
       "clip_grad": 0.5, "steps_per_print": 0}


def lr_hand(i):
    # Hand-written schedule of CFG: linear warmup over 3 steps from 0, cosine to 0.002 at step 10.
    if i < 3:
        return 0.02 * i / 3
    r = min(1.0, (i - 3) / 7)
    return 0.002 + 0.018 * (1 + math.cos(math.pi * r)) / 2


def test_fp32_parity_with_torch_adamw_schedule_clip_and_decay_grouping():
    model, ref = make_pair()
    model.eval()
    engine = hybrid.initialize(model, CFG)
    ref_step = reference_adamw(ref, lr_hand, 0.1, 0.5)
    for i, batch in enumerate(batches(10, 8)):
        assert engine.lr == pytest.approx(lr_hand(i), rel=1e-12, abs=1e-15)
        loss = F.mse_loss(engine(batch[0]), batch[1])
        engine.backward(loss)
        assert engine.step() is True
        ref_loss, ref_norm = ref_step(i, batch)
        assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
        assert engine.get_grad_norm() == pytest.approx(ref_norm, rel=1e-5)
    assert engine.global_step == 10 and engine.micro_steps == 10 and engine.skipped_steps == 0
    assert engine.last_lr == pytest.approx(lr_hand(9)) and engine.lr == pytest.approx(0.002)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p, q)
    assert model.training  # the engine put the model in training mode


def test_accumulation_micro2_x4_equals_one_batch_of_8():
    model, ref = make_pair()
    engine = hybrid.initialize(model, CFG, micro_batch_size=2, global_batch_size=8)
    assert engine.batch.gradient_accumulation_steps == 4
    ref_step = reference_adamw(ref, lr_hand, 0.1, 0.5)
    for i, (x, y) in enumerate(batches(5, 8)):
        stepped = []
        for k in range(4):
            assert engine.is_accumulation_boundary == (k == 3)
            engine.backward(F.mse_loss(engine(x[2 * k:2 * k + 2]), y[2 * k:2 * k + 2]))
            stepped.append(engine.step())
        assert stepped == [False, False, False, True]
        ref_step(i, (x, y))
    assert engine.global_step == 5 and engine.micro_steps == 20
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q)


def test_bf16_cast_path_keeps_fp32_master_and_trains():
    model, _ = make_pair()
    engine = hybrid.initialize(model, {"precision": "bf16", "optimizer": {"lr": 1e-2}, "steps_per_print": 0})
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert engine.memory_report()["master"] > 0  # fp32 master copies exist besides the bf16 weights
    x, y = batches(1, 16)[0]
    losses = []
    for _ in range(8):
        loss = F.mse_loss(engine(x.bfloat16()).float(), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    assert engine.loss_scale == 1.0


def test_autocast_path_keeps_fp32_params_and_runs_matmuls_in_bf16():
    model, _ = make_pair()
    engine = hybrid.initialize(model, {"precision": "bf16", "autocast": True, "steps_per_print": 0})
    assert all(p.dtype == torch.float32 for p in model.parameters())
    out = engine(torch.randn(4, 12))
    assert out.dtype == torch.bfloat16
    engine.backward(out.float().pow(2).mean())
    engine.step()
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
    assert engine.memory_report()["master"] == 0  # the fp32 parameters are the master weights


def test_autocast_follows_the_weights_device_not_the_topologys(monkeypatch):
    model, _ = make_pair()
    engine = hybrid.initialize(model, {"precision": "bf16", "autocast": True, "steps_per_print": 0})
    # One process on a GPU machine puts the topology's tensors on CUDA; this model was built on the CPU.
    monkeypatch.setattr(Topology, "device", property(lambda self: torch.device("cuda", 0)))
    assert engine(torch.randn(4, 12)).dtype == torch.bfloat16  # CPU autocast: CUDA's would leave it fp32


def test_fp16_overflow_skips_step_halves_scale_and_holds_the_schedule():
    model, _ = make_pair()
    engine = hybrid.initialize(model, {"precision": "fp16", "loss_scaling": {"initial_scale_power": 8,
                                                                              "hysteresis": 1},
                                       "scheduler": {"type": "linear", "warmup_iters": 0, "decay_iters": 10},
                                       "steps_per_print": 0})
    assert engine.loss_scale == 256.0
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 12).half()
    out = engine(x)
    engine.backward(out.float().sum() * float("inf"))
    assert engine.step() is False
    assert engine.skipped_steps == 1 and engine.global_step == 1 and engine.loss_scale == 128.0
    assert engine.lr == pytest.approx(1e-3) and engine.lr_schedule.iteration == 0 and engine.last_lr is None
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    engine.backward(engine(x).float().pow(2).mean())
    assert engine.step() is True
    assert engine.lr_schedule.iteration == 1 and engine.lr == pytest.approx(0.9e-3)


def test_overrides_deepspeed_dict_and_explicit_topology():
    model, _ = make_pair()
    engine = hybrid.initialize(model, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                                       "zero_optimization": {"stage": 1}, "steps_per_print": 0},
                               topology=Topology())
    assert engine.config.zero.stage == 1 and engine.batch.global_batch_size == 6
    model2, _ = make_pair()
    engine2 = hybrid.initialize(model2, None, zero={"stage": 2}, **{"optimizer.lr": 0.5}, steps_per_print=0)
    assert engine2.config.zero.stage == 2 and engine2.lr == 0.5 and engine2.optimizer.stage == 2


def test_custom_no_weight_decay_rule_is_used():
    model, ref = make_pair()
    engine = hybrid.initialize(model, {"optimizer": {"lr": 0.1, "weight_decay": 0.5}, "steps_per_print": 0},
                               no_weight_decay=lambda name, p: name.startswith("fc2"))
    decay = [p for n, p in ref.named_parameters() if not n.startswith("fc2")]
    no_decay = [p for n, p in ref.named_parameters() if n.startswith("fc2")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.5}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=0.1)
    for x, y in batches(3, 8):
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q)


def test_logging_and_tensorboard(tmp_path, caplog):
    model, _ = make_pair()
    engine = hybrid.initialize(model, {"steps_per_print": 2, "tensorboard": {
        "enabled": True, "output_path": str(tmp_path), "job_name": "job"}})
    with caplog.at_level(logging.INFO, logger="hybrid.engine"):
        for x, y in batches(4, 4):
            engine.backward(F.mse_loss(engine(x), y))
            engine.step()
    engine.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "hybrid.engine"]
    assert len(lines) == 2 and lines[0].startswith("step 2: loss ") and "lr 0.001" in lines[0]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "job"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/loss_scale", "train/skipped_steps"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert all(math.isfinite(e.value) for e in acc.Scalars("train/loss"))


def test_usage_errors():
    model, _ = make_pair()
    engine = hybrid.initialize(model, {"steps_per_print": 0})
    with pytest.raises(RuntimeError, match=r"engine\.step\(\) was called without engine\.backward"):
        engine.step()
    x = torch.randn(2, 12)
    with pytest.raises(ValueError, match="needs a scalar loss tensor"):
        engine.backward(engine(x))
    with pytest.raises(ValueError, match="needs a scalar loss tensor, got float"):
        engine.backward(1.0)
    with torch.no_grad():
        detached = engine(x).sum()
    with pytest.raises(ValueError, match="does not require grad"):
        engine.backward(detached)
    engine.backward(engine(x).sum())
    with pytest.raises(RuntimeError, match=r"called twice without engine\.step\(\)"):
        engine.backward(engine(x).sum())


@pytest.mark.parametrize("prepare,config,kwargs,error,match", [
    (lambda m: m.bfloat16(), {}, {}, ConfigError, r"parameter 'fc1\.weight' is bf16 but 'precision' is fp32"),
    (lambda m: m.bfloat16(), {"precision": "bf16", "autocast": True}, {}, ConfigError,
     r"'fc1\.weight' is bf16 but 'autocast' is true, which keeps parameters in fp32"),
    (lambda m: m.half(), {"precision": "bf16"}, {}, ConfigError, r"'fc1\.weight' is fp16 but 'precision' is bf16"),
    (lambda m: m, {"recompute": "full"}, {}, ConfigError, r"'recompute' is 'full', but MLP has no recomputation"),
    (lambda m: m, {"tensor_parallel_size": 2}, {"topology": Topology()}, ConfigError,
     r"'tensor_parallel_size' is 2 but the topology has tp=1"),
    (lambda m: m, {}, {"no_weight_decay": "bias"}, TypeError, r"no_weight_decay must be a callable"),
    (lambda m: m.requires_grad_(False), {}, {}, ValueError, r"MLP has no parameters with requires_grad=True"),
    (lambda m: "not a model", {}, {}, TypeError, r"needs a torch\.nn\.Module, got str"),
    (lambda m: m, {"zero": {"stage": 4}}, {}, ConfigError, r"'zero\.stage' must be one of 0, 1, 2, 3, got 4"),
    (lambda m: m, {"global_batch_size": 6, "micro_batch_size": 4}, {}, ConfigError,
     r"global_batch_size 6 is not divisible by micro_batch_size x data-parallel size = 4 x 1 = 4"),
    (lambda m: m, {}, {"zero": {"stgae": 1}}, ConfigError, r"unknown config key 'zero\.stgae'\. Did you mean"),
])
def test_initialize_errors(prepare, config, kwargs, error, match):
    model, _ = make_pair()
    with pytest.raises(error, match=match):
        hybrid.initialize(prepare(model), config, **kwargs)


def test_engine_cannot_be_wrapped_twice():
    model, _ = make_pair()
    engine = hybrid.initialize(model, {"steps_per_print": 0})
    with pytest.raises(TypeError, match="already wrapped"):
        hybrid.initialize(engine)


def _python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_docs_before_and_after_loops_run_and_agree():
    setup, before, after = _python_blocks(DOCS.read_text())[:3]
    changed = _count_changed_lines(before, after)
    assert changed <= 5, f"the docs claim at most five changed lines, found {changed}"
    ns_before, ns_after = {}, {}
    exec(setup + before, ns_before)  # noqa: S102 - the documented example itself
    exec(setup + after, ns_after)  # noqa: S102
    model_before = ns_before["model"]
    model_after = ns_after["model"].module
    for p, q in zip(model_after.parameters(), model_before.parameters()):
        assert_close(p, q)
    assert ns_after["model"].global_step == 20


def _count_changed_lines(before, after):
    import difflib

    a, b = before.strip().splitlines(), after.strip().splitlines()
    changed = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b).get_opcodes():
        if tag != "equal":
            changed += max(i2 - i1, j2 - j1)
    return changed


def test_initialize_without_a_topology_starts_the_group_with_the_configs_timeout(monkeypatch):
    import hybrid.distributed

    seen = {}
    real = hybrid.distributed.init_distributed

    def recording(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)  # one process here: no group is created

    monkeypatch.setattr(hybrid.distributed, "init_distributed", recording)
    engine = hybrid.initialize(MLP(), {"distributed": {"timeout_minutes": 0.5}, "checkpoint": {"async_save": True}})
    assert seen == {"timeout_s": 30.0}
    assert engine.topology.world_size == 1
    # every group, and the background writer's waits, are bounded by the same timeout
    assert engine.topology.comm.timeout.total_seconds() == 30.0
    assert engine.checkpoints.background_saver().timeout_s == 30.0


def test_saves_are_bounded_by_the_config_when_the_topology_has_no_timeout(tmp_path, monkeypatch):
    import hybrid.engine.checkpoint as engine_checkpoint

    engine = hybrid.initialize(MLP(), {"distributed": {"timeout_minutes": 0.25}, "checkpoint": {"async_save": True}},
                               topology=Topology())
    assert engine.topology.comm.timeout is None
    assert engine.checkpoints.background_saver().timeout_s == 15.0
    # and a synchronous save's writes
    engine.config.checkpoint.async_save = False
    seen = {}
    real = engine_checkpoint.save_checkpoint

    def recording(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_checkpoint, "save_checkpoint", recording)
    engine.save_checkpoint(tmp_path)
    assert seen["collective_timeout_s"] == 15.0
