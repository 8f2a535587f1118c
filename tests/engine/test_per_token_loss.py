"""--calculate-per-token-loss (``calculate_per_token_loss``): the gradient is that of the global batch's summed token
losses over its count of unmasked tokens, not the mean of the micro-batches' per-token means.

The micro-batches carry loss masks with unequal counts (as --eod-mask-loss gives), where the two losses differ.
Each run takes one SGD step at lr 1 without weight decay or clipping, so the fp32 master weights move by exactly
the gradient (up to the update's one rounding); the reference is one process's backward of the per-token mean of
a plain GPTModel with the same weights. The single-process case runs by default, DP 2 and PP 2 are slow.
"""

import pytest
import torch

from tests.multiproc import run_distributed
from tests.numerics import U, gamma, max_ratio, transformer_bound

CFG = dict(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, seq_length=8, init_std=0.2)
SEED, SAMPLES = 7, 4
# unmasked tokens of each sample (of 8): unequal, so that per-token and per-micro-batch means differ
COUNTS = (8, 1, 5, 2)


def _data():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, CFG["vocab_size"], (SAMPLES, CFG["seq_length"] + 1), generator=g)
    mask = torch.zeros(SAMPLES, CFG["seq_length"])
    for k, n in enumerate(COUNTS):
        mask[k, torch.randperm(CFG["seq_length"], generator=g)[:n]] = 1.0
    return [{"input_ids": ids[k:k + 1, :-1], "labels": ids[k:k + 1, 1:], "loss_mask": mask[k:k + 1]}
            for k in range(SAMPLES)]


def _step(topo, per_token: bool = True):
    """One train_batch at ``topo`` (micro-batch 1, global batch SAMPLES): this stage's weight change and the
    reported loss."""
    import hybrid
    from hybrid.tensor_parallel.gather import full_state
    from model_zoo import GPTConfig, GPTModel

    model = GPTModel(GPTConfig(**CFG), topo, seed=SEED)
    engine = hybrid.initialize(model, {"precision": "fp32", "zero": {"stage": 1}, "steps_per_print": 0,
                                       "optimizer": {"type": "sgd", "lr": 1.0, "weight_decay": 0.0},
                                       "micro_batch_size": 1, "global_batch_size": SAMPLES,
                                       "calculate_per_token_loss": per_token}, topology=topo)
    share = SAMPLES // topo.dp_size
    mine = _data()[topo.dp_rank * share:(topo.dp_rank + 1) * share]
    before = {n: t.clone() for n, t in full_state(engine.module, topo).items()}
    _, loss = engine.train_batch(mine, dp_mean=True)
    after = full_state(engine.module, topo)
    return {"delta": {n: before[n] - after[n] for n in before}, "before": before, "loss": loss}


def _reference():
    """Per-token and per-micro-batch gradients and losses of one process, on the same weights."""
    from hybrid.tensor_parallel.gather import full_state
    from hybrid.topology import Topology
    from model_zoo import GPTConfig, GPTModel

    out = {}
    for kind in ("per_token", "per_micro_batch"):
        model = GPTModel(GPTConfig(**CFG), Topology.local(), seed=SEED)
        means = [model(**mb) for mb in _data()]
        if kind == "per_token":
            loss = sum(m * COUNTS[k] for k, m in enumerate(means)) / sum(COUNTS)
        else:
            loss = sum(means) / SAMPLES
        loss.backward()
        out[kind] = {"loss": float(loss.detach()), "grads": full_state(model, Topology.local(), grads=True)}
    return out


def _check(runs, ref):
    cfg = _gpt_config()
    rel = transformer_bound(cfg, sum(COUNTS), part="grads")
    seen = set()
    for run in runs:
        for name, delta in run["delta"].items():
            delta, before = torch.as_tensor(delta), torch.as_tensor(run["before"][name])
            seen.add(name)
            want = ref["per_token"]["grads"][name]
            # the gradient's own bound, plus the SGD update's rounding of before - grad (and delta's of the two)
            bound = rel * want.abs().max() + 2 * U * (before.abs() + want.abs())
            assert max_ratio(delta, want, bound) <= 1, name
        # the reported loss: the global batch's token losses over its token count
        assert abs(run["loss"] - ref["per_token"]["loss"]) <= _loss_bound(ref["per_token"]["loss"])
    assert seen == set(ref["per_token"]["grads"])
    # the old reduction is visibly another gradient: the test tells the two apart
    head = "layers.0.mlp.in_proj.weight"
    old = ref["per_micro_batch"]["grads"][head]
    assert (old - ref["per_token"]["grads"][head]).abs().max() > 0.1 * old.abs().max()


def _loss_bound(loss: float) -> float:
    """Each micro-batch's loss within the model's bound, then weighted and summed over the micro-batches (and the
    data-parallel average) in float64 and fp32: a few more roundings of the total."""
    return (transformer_bound(_gpt_config(), CFG["seq_length"], part="loss") + gamma(2 * SAMPLES)) * abs(loss)


def _gpt_config():
    from model_zoo import GPTConfig

    return GPTConfig(**CFG)


def test_per_token_gradient_equals_one_process_reference():
    from hybrid.topology import Topology

    _check([_step(Topology.local())], _reference())


def test_without_the_flag_micro_batches_weigh_equally():
    from hybrid.topology import Topology

    run = _step(Topology.local(), per_token=False)
    ref = _reference()
    assert abs(run["loss"] - ref["per_micro_batch"]["loss"]) <= _loss_bound(ref["per_micro_batch"]["loss"])


def _evaluate(topo, per_token: bool = True) -> float:
    """``eval_batches`` at ``topo`` over two global batches of 2 samples, samples 0-1 then 2-3 (unmasked tokens
    9 and 7: unequal)."""
    import hybrid
    from model_zoo import GPTConfig, GPTModel

    engine = hybrid.initialize(GPTModel(GPTConfig(**CFG), topo, seed=SEED),
                               {"precision": "fp32", "zero": {"stage": 1}, "steps_per_print": 0,
                                "optimizer": {"type": "sgd", "lr": 1.0}, "micro_batch_size": 1,
                                "global_batch_size": 2, "calculate_per_token_loss": per_token}, topology=topo)
    engine.eval()
    data, share = _data(), 2 // topo.dp_size
    return engine.eval_batches([data[2 * b + topo.dp_rank * share:2 * b + (topo.dp_rank + 1) * share]
                                for b in range(2)])


def _eval_reference():
    """One process, eval mode: the per-token loss of all four samples (their token losses over their 16 tokens)
    and the mean of the two batches' micro-batch means."""
    from hybrid.topology import Topology
    from model_zoo import GPTConfig, GPTModel

    model = GPTModel(GPTConfig(**CFG), Topology.local(), seed=SEED).eval()
    with torch.no_grad():
        means = [float(model(**mb)) for mb in _data()]
    return {"per_token": sum(m * n for m, n in zip(means, COUNTS)) / sum(COUNTS),
            "per_micro_batch": sum(means) / SAMPLES}


def test_validation_weighs_every_token_alike_across_batches():
    """--calculate-per-token-loss's validation loss: all the evaluated batches' token losses over all their
    unmasked tokens (Megatron-LM's), not the mean of the batches' losses; without it, the mean of micro-batch
    means as before."""
    from hybrid.topology import Topology

    ref = _eval_reference()
    for per_token, key in ((True, "per_token"), (False, "per_micro_batch")):
        got = _evaluate(Topology.local(), per_token)
        assert abs(got - ref[key]) <= _loss_bound(ref[key]), (key, got, ref[key])
    # the two definitions differ by far more than the bound here: the test tells them apart
    assert abs(ref["per_token"] - ref["per_micro_batch"]) > 100 * _loss_bound(ref["per_token"])


def _evaluate_dp() -> float:
    from hybrid.topology import Topology

    return _evaluate(Topology(tp=1))


@pytest.mark.slow
def test_validation_per_token_over_two_data_parallel_ranks():
    ref = _eval_reference()["per_token"]
    for got in run_distributed(_evaluate_dp, 2, timeout=240):
        assert abs(got - ref) <= _loss_bound(ref)


def _dist(layout):
    """:func:`_step` on this rank, its tensors as numpy arrays (pickled by value, not as shared torch storage)."""
    from hybrid.topology import Topology

    out = _step(Topology(**layout))
    return {**out, **{k: {n: t.numpy() for n, t in out[k].items()} for k in ("delta", "before")}}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tp=1), dict(tp=1, pp=2)], ids=["dp2", "pp2"])
def test_per_token_gradient_over_two_ranks(layout):
    _check(run_distributed(_dist, 2, layout, timeout=240), _reference())
