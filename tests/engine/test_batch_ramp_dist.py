"""A batch-size ramp-up (``rampup_batch_size``) trains like one process given each step's whole global batch.

World 2, gloo, fp32, one spawn for every configuration:

* a plain ``nn.Module`` at DP=2 for ZeRO stages 1, 2 and 3 (micro batch 2), driven by
  ``engine(...)`` / ``engine.backward`` / ``engine.step`` per micro-batch;
* a model_zoo GPT at PP=2 (DP=1, ZeRO stage 1, micro batch 2), driven by ``engine.train_batch``.

All ramp ``rampup_batch_size = (4, 4, 24)`` up to ``global_batch_size = 12`` and use weight decay (1-D
parameters exempt), gradient clipping and a warmup + cosine learning-rate schedule in samples. The ramp,
worked out by hand (``n = (12 - 4) / 4 = 2`` increments, so the size after ``c`` consumed samples is
``min(4 + 4 * floor(c * 2 / 24), 12) = 4 + 4 * floor(c / 12)``, capped at 12):

    step               1   2   3   4   5   6   7   8
    consumed before    0   4   8  12  20  28  40  52      (64 after the last)
    global batch       4   4   4   8   8  12  12  12
    micro-batches/rank 1   1   1   2   2   3   3   3      at DP 2, micro 2 (the MLP)
                       2   2   2   4   4   6   6   6      at DP 1, micro 2 (the pipeline)

The parent trains one process with ``torch.optim.AdamW`` on each step's whole global batch (samples
``[consumed, consumed + size)`` of one fixed stream, mean loss over the batch), the learning rate of each step
computed by hand from the samples consumed before it, and compares losses, gradient norms and final
parameters (tolerances: see :func:`_loss_bound` and the constants below).
"""


import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.hand_lr import warmup_cosine
from tests.engine.test_engine_dist import new_mlp
from tests.multiproc import run_distributed
from tests.numerics import adam_trajectory_tolerance, gamma, max_ratio, record, transformer_bound

WORLD = 2
MICRO = 2
RAMP = (4, 4, 24)  # start, increment, samples
GLOBAL = 12
# The hand-computed ramp (module docstring): each step's global batch and the samples consumed before it.
SIZES = [4, 4, 4, 8, 8, 12, 12, 12]
CONSUMED_BEFORE = [0, 4, 8, 12, 20, 28, 40, 52]
STEPS = len(SIZES)
TOTAL = CONSUMED_BEFORE[-1] + SIZES[-1]  # 64 samples in all
LR, MIN_LR, WD = 0.01, 0.001, 0.1
# Clipping bounds each model's gradient norm in some steps but not in others (the MLP's reference norms run from
# 2.5 to 5.5, the GPT's from 0.5 to 1.7): where it clips, the step is blind to a constant factor on the gradient,
# such as a wrong loss divisor; where it does not, such a factor reaches Adam's moments.
MLP_CLIP, GPT_CLIP = 4.0, 1.0
WARMUP_SAMPLES, DECAY_SAMPLES = 12, TOTAL
CFG = {"optimizer": {"type": "adamw", "lr": LR, "betas": [0.9, 0.95], "weight_decay": WD},
       "scheduler": {"type": "cosine", "warmup_samples": WARMUP_SAMPLES, "decay_samples": DECAY_SAMPLES,
                     "min_lr": MIN_LR},
       "steps_per_print": 0, "micro_batch_size": MICRO, "global_batch_size": GLOBAL,
       "rampup_batch_size": list(RAMP)}
# As in test_engine_dist: no linear biases (the attention key bias has an exactly-zero true gradient, so Adam would
# normalise pure rounding noise into full-size steps); the norms keep the 1-D (no weight decay) group.
GPT = dict(vocab_size=200, hidden_size=32, num_layers=2, num_heads=4, seq_length=16, init_std=0.05, bias=False)
GPT_SEED = 5


def lr_hand(consumed):
    """The rate of the step that starts after ``consumed`` samples: linear warmup over 12 samples, then cosine
    decay to MIN_LR at 64 samples."""
    return warmup_cosine(consumed, LR, MIN_LR, WARMUP_SAMPLES, DECAY_SAMPLES)


def mlp_data():
    """The stream of samples: global batch k is rows [consumed_k, consumed_k + size_k)."""
    g = torch.Generator().manual_seed(3)
    return torch.randn(TOTAL, 10, generator=g), torch.randn(TOTAL, 3, generator=g)


def gpt_data():
    g = torch.Generator().manual_seed(4)
    return (torch.randint(0, GPT["vocab_size"], (TOTAL, GPT["seq_length"]), generator=g),
            torch.randint(0, GPT["vocab_size"], (TOTAL, GPT["seq_length"]), generator=g))


def _next_share(engine, topo, out, tensors):
    """Record the engine's account of the global batch it is about to run (``out["progress"]``); this DP rank's
    contiguous share of it (as hybrid.data.sampler lays it out), from each of ``tensors``."""
    before = _progress(engine)
    out["progress"].append(before)
    share = before["size"] // topo.dp_size
    first = before["consumed"] + topo.dp_rank * share
    return tuple(t[first:first + share] for t in tensors)


def _plain(tensors):
    # numpy arrays pickle by value; tensors would travel as shared memory that dies with the child.
    return {n: t.detach().float().numpy().copy() for n, t in tensors.items()}


def _progress(engine):
    """What the engine says about the global batch it is about to run."""
    return {"accum": engine.gradient_accumulation_steps, "divisor": engine.optimizer.gradient_accumulation_steps,
            "size": engine.global_batch_size, "consumed": engine.consumed_samples, "lr": engine.lr}


def _train_mlp(topo, stage):
    import hybrid

    zero = {"stage": stage, **({"persistence_threshold": 0} if stage == 3 else {})}  # stage 3: partition all
    engine = hybrid.initialize(new_mlp(), CFG, topology=topo, zero=zero, clip_grad=MLP_CLIP)
    x, y = mlp_data()
    out = {"losses": [], "norms": [], "progress": [], "updates": []}
    for _ in range(STEPS):
        xs, ys = _next_share(engine, topo, out, (x, y))
        micro_losses, updates = [], []
        for k in range(0, len(xs), MICRO):
            loss = F.mse_loss(engine(xs[k:k + MICRO]), ys[k:k + MICRO])
            engine.backward(loss)
            updates.append(engine.step())
            micro_losses.append(loss.item())
        out["updates"].append(updates)
        out["losses"].append(sum(micro_losses) / len(micro_losses))
        out["norms"].append(engine.get_grad_norm())
    out["after"] = _progress(engine)
    out["global_step"] = engine.global_step
    with engine.gathered_parameters():  # whole under ZeRO-3 (a no-op below it)
        out["params"] = _plain(dict(engine.module.named_parameters()))
    return out


def _train_gpt_pipeline(stage):
    import hybrid
    from hybrid.config.parse import config_from_dict
    from hybrid.pipeline.split import split_from_config
    from hybrid.tensor_parallel.gather import full_state
    from model_zoo import GPTConfig, GPTModel

    topo = hybrid.Topology(tp=1, pp=2, timeout_s=60)
    config = config_from_dict({**CFG, "zero": {"stage": stage}, "clip_grad": GPT_CLIP})
    cfg = GPTConfig(**GPT)
    model = GPTModel(cfg, topo, seed=GPT_SEED, split=split_from_config(config.pipeline, cfg.num_layers, topo.pp_size))
    engine = hybrid.initialize(model, config, topology=topo)
    ids, labels = gpt_data()
    out = {"losses": [], "norms": [], "progress": [], "updated": []}
    for _ in range(STEPS):
        xs, ys = _next_share(engine, topo, out, (ids, labels))
        updated, loss = engine.train_batch([{"input_ids": xs[k:k + MICRO], "labels": ys[k:k + MICRO]}
                                            for k in range(0, len(xs), MICRO)])
        out["updated"].append(updated)
        out["losses"].append(loss)
        out["norms"].append(engine.get_grad_norm())
    out["after"] = _progress(engine)
    out["pp_rank"] = topo.pp_rank
    out["params"] = _plain(full_state(model, topo))  # this stage's parameters (TP 1: whole)
    engine.close()
    topo.close()
    return out


def _interleaved_refusal():
    """The error initialize raises for a ramp whose sizes an interleaved pipeline cannot all run, or None."""
    import hybrid
    from hybrid.config.errors import ConfigError
    from hybrid.config.parse import config_from_dict
    from hybrid.pipeline.split import split_from_config
    from model_zoo import GPTConfig, GPTModel

    topo = hybrid.Topology(tp=1, pp=2, timeout_s=60)
    # 4 layers, one per virtual stage: two model chunks per rank, so the schedule needs an even micro-batch count.
    # The ramp 4, 6, 8, 10, 12 at micro 2 and DP 1 takes 2, 3, 4, 5, 6 micro-batches: 3 is the first it refuses.
    config = config_from_dict({**CFG, "rampup_batch_size": [4, 2, 24],
                                     "pipeline": {"schedule": "interleaved", "layers_per_virtual_stage": 1}})
    cfg = GPTConfig(**dict(GPT, num_layers=4))
    model = GPTModel(cfg, topo, seed=GPT_SEED, split=split_from_config(config.pipeline, cfg.num_layers, topo.pp_size))
    try:
        hybrid.initialize(model, config, topology=topo)
    except ConfigError as e:
        return str(e)
    finally:
        topo.close()
    return None


def _worker():
    import time

    from hybrid.topology import Topology

    t0 = time.perf_counter()
    dp2 = Topology(tp=1)
    out = {f"mlp_stage{s}": _train_mlp(dp2, s) for s in (1, 2, 3)}
    t1 = time.perf_counter()
    out["gpt_pp2_stage1"] = _train_gpt_pipeline(1)
    out["interleaved_refusal"] = _interleaved_refusal()
    out["seconds"] = {"mlp": t1 - t0, "gpt": time.perf_counter() - t1}
    return out


def _reference(model, data, forward_loss, clip, export=None):
    """One process, torch AdamW, each step on the whole global batch of the hand-computed ramp."""
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr_hand(0), betas=(0.9, 0.95), eps=1e-8)
    losses, norms, grad_l1 = [], [], []
    for consumed, size in zip(CONSUMED_BEFORE, SIZES):
        for g in opt.param_groups:
            g["lr"] = lr_hand(consumed)
        opt.zero_grad()
        loss = forward_loss(model, tuple(t[consumed:consumed + size] for t in data))
        loss.backward()
        grad_l1.append(sum(float(p.grad.abs().sum()) for p in model.parameters()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "grad_l1": grad_l1,
            "params": _plain(export(model) if export else dict(model.named_parameters()))}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, WORLD, timeout=300)


@pytest.fixture(scope="module")
def mlp_reference():
    return _reference(new_mlp(), mlp_data(), lambda m, b: F.mse_loss(m(b[0]), b[1]), MLP_CLIP)


@pytest.fixture(scope="module")
def gpt_reference():
    from hybrid.tensor_parallel.gather import full_state
    from hybrid.topology import Topology
    from model_zoo import GPTConfig, GPTModel

    # full_state: the logical tensors (the vocabulary padding dropped), as the runs export theirs
    return _reference(GPTModel(GPTConfig(**GPT), Topology.local(), seed=GPT_SEED), gpt_data(),
                      lambda m, b: m(b[0], labels=b[1]), GPT_CLIP, export=lambda m: full_state(m, Topology.local()))


# ---- tolerances ------------------------------------------------------------------------------------------
# The runs and the reference do the same fp32 arithmetic but for its order: the gradient of a global batch is
# summed over micro-batches, then over DP ranks (or pipeline passes), instead of in one batched backward, and
# each micro-batch's loss is divided by the accumulation count instead of the batch mean being taken at once.
#
# * Parameters. Two Adam runs that differ only in summation order stay within ADAM_NOISE_FRACTION of the
#   distance Adam can move an element in that many steps, ``steps * lr`` (tests/numerics.py,
#   adam_trajectory_tolerance; the peak rate LR bounds every step's rate). A wrong accumulation count or loss
#   divisor, or a schedule counting steps instead of samples, changes every element's update by a fraction of lr
#   at every step. Measured here (by patching the library in a scratch run): every micro-batch's loss divided by
#   the final accumulation count (3, or 6 on the pipeline) ends 11-14x the bound away, a schedule advancing 4
#   samples a step 13-14x; the runs as they are, 1e-4 to 3e-4 of it.
# * Losses. Step i's loss is computed at parameters that have drifted apart by at most
#   delta_i = adam_trajectory_tolerance(i, LR) per element; to first order the loss moves by at most
#   ``||grad L_i||_1 * delta_i`` (the reference's gradient, before clipping; the second-order term is
#   O(delta^2 ||H||), orders below it at delta <= 7e-4), plus the forward pass's own rounding: a normwise
#   u x (sum of the reduction lengths) estimate, as tests/numerics.transformer_bound makes for the GPT.
# * Gradient norms. Step 1 runs at the very same parameters: its norm differs by rounding alone, estimated the
#   same way from the forward's and the backward's reduction lengths. Later norms move with the drifted
#   parameters by an amount the arithmetic does not bound without the Hessian, so they are held to NORM_TOL
#   relative: a hundredth, far above what the drift does here (measured: below 2e-7 relative) and far below what
#   a wrong divisor does (a factor of 1/3 to 2/3 on a step's gradient: 67x NORM_TOL in the patched run above).
NORM_TOL = 1e-2
# The MLP's forward: fc1 (10 terms + bias), tanh, layer norm (mean and variance over 32, rsqrt), fc2 (32 terms
# + bias), the squared error and its mean over the batch (3 x 12 terms); its backward: the same lengths again,
# plus fc1/fc2's weight gradients summed over the batch (12 each) and the DP all-reduce (2).
MLP_FWD_K = 11 + 8 + 2 * 32 + 8 + 33 + 2 + 3 * GLOBAL
MLP_BWD_K = MLP_FWD_K + 2 * GLOBAL + WORLD


def _loss_bound(ref, i, forward_rel):
    return forward_rel * abs(ref["losses"][i]) + ref["grad_l1"][i] * adam_trajectory_tolerance(i, LR)


def _within(got, want, bound, what):
    """``|got - want| <= bound``, the ratio recorded in $NUMERICS_LOG (tests/numerics.record) for the margins."""
    ratio = record(abs(got - want) / bound if got != want else 0.0)
    assert ratio <= 1, f"{what}: got {got!r}, want {want!r}, off by {abs(got - want):.3e} > bound {bound:.3e}"


def _params_within(got, ref, bound):
    for name, want in ref.items():
        ratio = max_ratio(torch.from_numpy(got[name]), torch.from_numpy(want), bound)
        assert ratio <= 1, f"{name}: max |got - ref| is {ratio:.2f} x the bound {bound:.1e}"


def _assert_progress(run, accumulation):
    """The engine's own account of every step: the hand-computed ramp, not the final batch size."""
    for i, p in enumerate(run["progress"]):
        assert p["consumed"] == CONSUMED_BEFORE[i], (i, p)
        assert p["size"] == SIZES[i], (i, p)
        assert p["accum"] == accumulation[i], (i, p)
        assert p["divisor"] == accumulation[i], (i, p)  # the ZeRO optimizer's loss divisor follows it
        assert p["lr"] == pytest.approx(lr_hand(CONSUMED_BEFORE[i]), rel=1e-12, abs=1e-15), (i, p)
    after = run["after"]
    assert after["consumed"] == TOTAL
    assert after["size"] == GLOBAL and after["accum"] == accumulation[-1]


def _assert_norms(norms, ref, first_rel):
    _within(norms[0], ref["norms"][0], first_rel * ref["norms"][0], "step 1 gradient norm")
    for i, (got, want) in enumerate(zip(norms, ref["norms"])):
        _within(got, want, NORM_TOL * want, f"step {i + 1} gradient norm")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ramped_plain_module_matches_single_process_adamw(results, mlp_reference, stage):
    run = f"mlp_stage{stage}"
    ref = mlp_reference
    accumulation = [size // (MICRO * WORLD) for size in SIZES]
    assert accumulation == [1, 1, 1, 2, 2, 3, 3, 3]
    for r in results:
        _assert_progress(r[run], accumulation)
        assert r[run]["global_step"] == STEPS
        # the optimizer steps at the last micro-batch of each global batch, and only there
        assert r[run]["updates"] == [[False] * (a - 1) + [True] for a in accumulation]
    # Each DP rank saw half of each global batch in equal micro-batches: the mean of their means is the batch's.
    losses = [sum(r[run]["losses"][i] for r in results) / WORLD for i in range(STEPS)]
    for i, (got, want) in enumerate(zip(losses, ref["losses"])):
        _within(got, want, _loss_bound(ref, i, gamma(MLP_FWD_K)), f"step {i + 1} loss")
    for r in results:
        _assert_norms(r[run]["norms"], ref, gamma(MLP_FWD_K + MLP_BWD_K))
        _params_within(r[run]["params"], ref["params"], adam_trajectory_tolerance(STEPS, LR))


def test_ramped_gpt_pipeline_matches_single_process_adamw(results, gpt_reference):
    from model_zoo import GPTConfig

    ref, cfg = gpt_reference, GPTConfig(**GPT)
    runs = [r["gpt_pp2_stage1"] for r in results]
    assert sorted(run["pp_rank"] for run in runs) == [0, 1]
    accumulation = [size // MICRO for size in SIZES]  # DP 1
    assert accumulation == [2, 2, 2, 4, 4, 6, 6, 6]
    for run in runs:
        _assert_progress(run, accumulation)
        assert run["updated"] == [True] * STEPS
    # The loss is computed on the last stage and broadcast: both stages report the same, the batch mean.
    assert runs[0]["losses"] == runs[1]["losses"]
    for i, (got, want) in enumerate(zip(runs[0]["losses"], ref["losses"])):
        forward = transformer_bound(cfg, SIZES[i] * cfg.seq_length, part="loss")
        _within(got, want, _loss_bound(ref, i, forward), f"step {i + 1} loss")
    for run in runs:
        _assert_norms(run["norms"], ref, transformer_bound(cfg, SIZES[0] * cfg.seq_length, part="grads"))
    # Every parameter is held by a stage (the tied embedding by both, bit for bit the same).
    merged = {}
    for run in runs:
        for name, value in run["params"].items():
            if name in merged:
                np.testing.assert_array_equal(merged[name], value, err_msg=name)
            merged[name] = value
    assert set(merged) == set(ref["params"])
    _params_within(merged, ref["params"], adam_trajectory_tolerance(STEPS, LR))


def test_an_interleaved_pipeline_refuses_a_ramp_size_it_cannot_run_before_the_first_step(results):
    for r in results:
        message = r["interleaved_refusal"]
        assert message is not None, "initialize accepted a ramp with an odd micro-batch count"
        assert message.startswith("rampup_batch_size: its global batch 6 is 3 micro-batches per data-parallel "
                                  "rank, and the interleaved schedule needs the micro-batch count (3) to be a "
                                  "multiple of pipeline_model_parallel_size=2"), message
