"""Acceptance (world 4, gloo, fp32): ``hybrid.initialize`` training matches single-process torch AdamW.

One spawn runs every configuration:

* a plain ``nn.Module`` (not TP) at DP=4 for ZeRO stages 0, 1 and 2 (micro batch
  2, global batch 8), and at stage 1 with accumulation (micro 1 x 2 steps);
* a model_zoo GPT at TP=2 x DP=2, ZeRO stage 2.

All use weight decay (1-D parameters exempt, the engine's default), a warmup +
cosine schedule and gradient clipping. The parent process computes the
single-process references with ``torch.optim.AdamW`` on the same global
batches and compares 10 steps of losses and the final parameters within 1e-5
relative (``max|got - ref| / max|ref|`` per tensor).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from tests.multiproc import run_distributed

STEPS = 10
GLOBAL_MLP = 8
TOL = 1e-5
CFG = {"optimizer": {"type": "adamw", "lr": 0.01, "betas": [0.9, 0.95], "weight_decay": 0.1},
       "scheduler": {"type": "cosine", "warmup_iters": 3, "decay_iters": STEPS, "min_lr": 0.001},
       "clip_grad": 0.3, "steps_per_print": 0}
# No linear biases: the key bias of attention has an exactly-zero gradient in exact arithmetic (softmax
# ignores a shift shared by all keys), so its float-rounding residue (~1e-10) is all Adam sees, and
# Adam's g / sqrt(v) turns that noise into full-size updates that differ between any two summation
# orders. Norm weights and biases still exercise the 1-D (no weight decay) group.
GPT = dict(vocab_size=200, hidden_size=32, num_layers=2, num_heads=4, seq_length=16, init_std=0.05, bias=False)
GPT_GLOBAL = 4
GPT_SEED = 5


def lr_hand(i):
    if i < 3:
        return 0.01 * i / 3
    return 0.001 + 0.009 * (1 + math.cos(math.pi * (i - 3) / (STEPS - 3))) / 2


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(10, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 3)

    def forward(self, x):
        return self.fc2(self.norm(torch.tanh(self.fc1(x))))


def mlp_data():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(GLOBAL_MLP, 10, generator=g), torch.randn(GLOBAL_MLP, 3, generator=g))
            for _ in range(STEPS)]


def gpt_data():
    g = torch.Generator().manual_seed(4)
    return [(torch.randint(0, GPT["vocab_size"], (GPT_GLOBAL, GPT["seq_length"]), generator=g),
             torch.randint(0, GPT["vocab_size"], (GPT_GLOBAL, GPT["seq_length"]), generator=g))
            for _ in range(STEPS)]


def new_mlp():
    torch.manual_seed(0)
    return MLP()


def _plain(tensors):
    # numpy arrays pickle by value; tensors would travel as shared memory that dies with the child.
    return {n: t.detach().numpy().copy() for n, t in tensors.items()}


def _train_mlp(topo, stage, micro):
    import hybrid

    rank, dp = topo.dp_rank, topo.dp_size
    engine = hybrid.initialize(new_mlp(), CFG, topology=topo, zero={"stage": stage},
                               micro_batch_size=micro, global_batch_size=GLOBAL_MLP)
    per_rank = GLOBAL_MLP // dp
    losses, norms, lrs = [], [], []
    for x, y in mlp_data():
        xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        micro_losses = []
        for k in range(0, per_rank, micro):
            loss = F.mse_loss(engine(xs[k:k + micro]), ys[k:k + micro])
            engine.backward(loss)
            lrs.append(engine.lr)
            engine.step()
            micro_losses.append(loss.item())
        losses.append(sum(micro_losses) / len(micro_losses))
        norms.append(engine.get_grad_norm())
    comm = engine.comm_report()
    return {"losses": losses, "norms": norms, "global_step": engine.global_step, "comm_ops": sorted(comm),
            "params": _plain({n: p for n, p in engine.module.named_parameters()}),
            "accum": engine.batch.gradient_accumulation_steps}


def _train_gpt(topo, stage):
    import hybrid
    from hybrid.tensor_parallel.gather import full_state
    from model_zoo import GPTConfig, GPTModel

    model = GPTModel(GPTConfig(**GPT), topo, seed=GPT_SEED)
    engine = hybrid.initialize(model, CFG, topology=topo, zero={"stage": stage},
                               global_batch_size=GPT_GLOBAL, gradient_accumulation_steps=1)
    per_rank = engine.batch.micro_batch_size
    r = topo.dp_rank
    losses = []
    for ids, labels in gpt_data():
        loss = engine(ids[r * per_rank:(r + 1) * per_rank], labels=labels[r * per_rank:(r + 1) * per_rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "params": _plain(full_state(engine.module, topo)), "tp": topo.tp_size,
            "norm": engine.get_grad_norm()}


def _train_gpt_batches(topo, stage):
    """As :func:`_train_gpt`, through ``train_batch(dp_mean=True)`` with the weights' all-gathers left in flight
    after each step (``zero.overlap_param_gather``)."""
    import hybrid
    from hybrid.tensor_parallel.gather import full_state
    from model_zoo import GPTConfig, GPTModel

    model = GPTModel(GPTConfig(**GPT), topo, seed=GPT_SEED)
    engine = hybrid.initialize(model, CFG, topology=topo, zero={"stage": stage, "overlap_param_gather": True},
                               global_batch_size=GPT_GLOBAL, gradient_accumulation_steps=1)
    per_rank, r = engine.batch.micro_batch_size, topo.dp_rank
    losses = []
    for ids, labels in gpt_data():
        share = slice(r * per_rank, (r + 1) * per_rank)
        losses.append(engine.train_batch([{"input_ids": ids[share], "labels": labels[share]}], dp_mean=True)[1])
    with engine.gathered_parameters():  # waits for the last step's gathers
        params = _plain(full_state(engine.module, topo))
    engine.close()
    return {"losses": losses, "params": params}


def _topology_mismatch_error(model_topo, engine_topo):
    import hybrid
    from model_zoo import GPTConfig, GPTModel

    model = GPTModel(GPTConfig(**GPT), model_topo, seed=GPT_SEED)
    try:
        hybrid.initialize(model, CFG, topology=engine_topo)
    except ValueError as err:
        return str(err)
    return None


def _worker():
    import time

    from hybrid.topology import Topology

    t0 = time.perf_counter()
    dp4 = Topology(tp=1)
    out = {f"stage{s}": _train_mlp(dp4, s, micro=2) for s in (0, 1, 2)}
    out["stage1_accum"] = _train_mlp(dp4, 1, micro=1)
    t1 = time.perf_counter()
    tp2 = Topology(tp=2)
    out["gpt_tp2_stage2"] = _train_gpt(tp2, stage=2)
    out["gpt_tp2_stage1_batches"] = _train_gpt_batches(tp2, stage=1)
    out["topology_mismatch"] = _topology_mismatch_error(tp2, dp4)
    out["seconds"] = {"mlp": t1 - t0, "gpt": time.perf_counter() - t1}
    return out


def _reference(model, data, forward_loss):
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr_hand(0), betas=(0.9, 0.95), eps=1e-8)
    losses, norms = [], []
    for i, batch in enumerate(data):
        for g in opt.param_groups:
            g["lr"] = lr_hand(i)
        opt.zero_grad()
        loss = forward_loss(model, batch)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)))
        opt.step()
        losses.append(loss.item())
    return losses, norms, {n: p.detach() for n, p in model.named_parameters()}


def _rel(got, ref):
    got = torch.from_numpy(got)
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 4, timeout=240)


@pytest.fixture(scope="module")
def mlp_reference():
    return _reference(new_mlp(), mlp_data(), lambda m, b: F.mse_loss(m(b[0]), b[1]))


@pytest.fixture(scope="module")
def gpt_reference():
    from hybrid.topology import Topology
    from model_zoo import GPTConfig, GPTModel

    from hybrid import param_meta

    model = GPTModel(GPTConfig(**GPT), Topology.local(), seed=GPT_SEED)
    losses, norms, params = _reference(model, gpt_data(), lambda m, b: m(b[0], labels=b[1]))
    # Drop the vocabulary padding (zero rows that never receive gradient) to compare logical tensors.
    metas = {n: param_meta.get_tp_meta(p) for n, p in model.named_parameters()}
    logical = {n: param_meta.merge([p], metas[n]) if metas[n].partitioned else p for n, p in params.items()}
    return losses, norms, logical


@pytest.mark.parametrize("run", ["stage0", "stage1", "stage2", "stage1_accum"])
def test_plain_module_matches_single_process_adamw(results, mlp_reference, run):
    ref_losses, ref_norms, ref_params = mlp_reference
    # Every DP rank saw a quarter of each global batch: their mean loss is the global-batch loss.
    losses = [sum(r[run]["losses"][i] for r in results) / 4 for i in range(STEPS)]
    for got, ref in zip(losses, ref_losses):
        assert got == pytest.approx(ref, rel=TOL)
    for r in results:
        assert r[run]["global_step"] == STEPS
        assert r[run]["accum"] == (2 if run == "stage1_accum" else 1)
        for got, ref in zip(r[run]["norms"], ref_norms):
            assert got == pytest.approx(ref, rel=TOL)
        for name, ref in ref_params.items():
            assert _rel(r[run]["params"][name], ref) <= TOL, name


def test_collectives_follow_the_stage(results):
    ops = {run: set(results[0][run]["comm_ops"]) for run in ("stage0", "stage1", "stage2")}
    assert "all_reduce/dp" in ops["stage0"]
    assert {"reduce_scatter/dp", "all_gather/dp"} <= ops["stage2"]
    assert "all_gather/dp" in ops["stage1"]


def test_gpt_tp2_dp2_stage2_matches_single_process_adamw(results, gpt_reference):
    ref_losses, ref_norms, ref_params = gpt_reference
    runs = [r["gpt_tp2_stage2"] for r in results]
    assert all(run["tp"] == 2 for run in runs)
    # Ranks 0,1 form DP replica 0 and ranks 2,3 replica 1; TP ranks report the same loss.
    for i, ref in enumerate(ref_losses):
        assert runs[0]["losses"][i] == runs[1]["losses"][i]
        assert (runs[0]["losses"][i] + runs[2]["losses"][i]) / 2 == pytest.approx(ref, rel=TOL)
    assert runs[0]["norm"] == pytest.approx(ref_norms[-1], rel=TOL)
    for run in runs:
        assert set(run["params"]) == set(ref_params)
        for name, ref in ref_params.items():
            assert _rel(run["params"][name], ref) <= TOL, name


def test_train_batch_averages_the_loss_over_dp_with_the_gathers_in_flight(results, gpt_reference):
    """``train_batch(dp_mean=True)`` returns the global batch's loss on every rank, and ZeRO-1 with
    ``zero.overlap_param_gather`` trains the single-process model."""
    ref_losses, _, ref_params = gpt_reference
    runs = [r["gpt_tp2_stage1_batches"] for r in results]
    for run in runs:
        assert run["losses"] == runs[0]["losses"]
        assert run["losses"] == pytest.approx(ref_losses, rel=TOL)
        for name, ref in ref_params.items():
            assert _rel(run["params"][name], ref) <= TOL, name


def test_model_built_for_another_tp_size_is_refused(results):
    for r in results:
        assert r["topology_mismatch"] == ("the model was built for tp=2 but the engine's topology has tp=1; "
                                          "pass the model's topology to hybrid.initialize")
