"""hpZ (``zero.hpz_partition_size``) for ZeRO stage 3 over 4 gloo ranks as 2 emulated nodes x 2 ranks.

With hpZ each rank also keeps its 1/2 slice of every gathered unit, sharded over its node's two dp ranks
(``dp_node``); backward re-gathers from those slices inside the node instead of over the whole dp group.
One spawn runs every configuration; the tests check that training is bit for bit what stage 3 without hpZ
does (and matches one process), that the backward gathers never leave the node, what the secondary copy
costs, the refusal of a wrong size, and checkpoints.
"""

import numpy as np
import pytest
import torch

from tests.multiproc import run_distributed
from tests.zero.common import TiedMLP, dp_mean, max_rel_diff, no_decay, numpy_params, rel_diff_list, token_batch
from tests.zero.test_gpt_parity import BUCKET, LR, MICRO_PER_TP, STEPS, WD, _reference, gpt_config

WORLD = 4
PER_NODE = 2  # dp ranks per emulated node: the hpZ size
LIVE = 40_000
# No prefetch window, so no keep window: forward keeps nothing for backward, which re-gathers every unit (these
# models fit any window, which would leave hpZ nothing to do)
NO_KEEP = 0
THRESHOLD = 100  # the GPT's norm weights stay whole (a persistent unit): hpZ leaves that unit alone
BAD_SIZE = "zero.hpz_partition_size = 4 but each node holds 2 data-parallel ranks of this group; set it to 2 " \
           "(or 1 to turn hpZ off)"


def _gpt_run(topo, hpz, *, steps=STEPS, recompute="none"):
    from hybrid.tensor_parallel.gather import full_state
    from model_zoo import GPTModel
    from tests.zero.common import make_zero, train_zero

    cfg = gpt_config().replace(recompute=recompute)
    model = GPTModel(cfg, topo)
    opt = make_zero(model, topo, stage=3, lr=LR, weight_decay=WD, no_weight_decay=lambda n, p: p.ndim < 2,
                    bucket_size=BUCKET, persistence_threshold=THRESHOLD, max_live_parameters=LIVE,
                    prefetch_bucket_size=NO_KEEP, hpz_partition_size=hpz)
    out = train_zero(model, opt, topo, steps, micro=MICRO_PER_TP, gas=1, vocab=cfg.vocab_size, seq=cfg.seq_length)
    with opt.gathered_parameters():
        full = {n: t.float().numpy() for n, t in full_state(model, topo).items()}
    res = {"losses": out["losses"], "norms": out["norms"], "params": full, "comm": opt.comm_report(),
           "memory": opt.memory_report(), "psi": opt.num_parameters(),
           "units": [(u.module_name, u.numel, u.persistent) for u in opt.units]}
    opt.remove_hooks()
    return res


def _quantized_run(topo, hpz):
    """TiedMLP with int4 gradients and int8 weights, 2 micro-batches per step: the secondary slices hold the
    dequantized weights the forward gather produced."""
    from tests.zero.common import make_zero, train_zero

    torch.manual_seed(0)
    model = TiedMLP(hidden=32)
    opt = make_zero(model, topo, stage=3, lr=3e-3, weight_decay=0.0, no_weight_decay=no_decay, bucket_size=2000,
                    quantization_block=64, gradient_accumulation_steps=2, persistence_threshold=0,
                    quantized_gradients="int4", quantized_weights="int8", hpz_partition_size=hpz,
                    prefetch_bucket_size=NO_KEEP)
    out = train_zero(model, opt, topo, 5, micro=2, gas=2, copy=True)
    with opt.gathered_parameters():
        params = numpy_params(model)
    comm = opt.comm_report()
    opt.remove_hooks()
    return {"losses": out["losses"], "params": params, "comm": comm}


def _steps(model, opt, topo, first, count, micro=2):
    """Train global batches ``first .. first+count-1`` (one micro-batch each); this rank's losses."""
    losses = []
    for s in range(first, first + count):
        x, y = token_batch(s, micro * topo.dp_size)
        lo = topo.dp_rank * micro
        loss = model(x[lo: lo + micro], y[lo: lo + micro])
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _checkpoint_run(topo):
    """Train 3 steps with hpZ, save, train 3 more; then a fresh model and optimizer load the save, run an eval
    forward and a ``gathered_parameters()`` read (neither is training), and train the same 3 steps."""
    from tests.zero.common import make_zero

    def build():
        torch.manual_seed(0)
        model = TiedMLP()
        return model, make_zero(model, topo, stage=3, lr=1e-2, persistence_threshold=0, no_weight_decay=no_decay,
                                hpz_partition_size=PER_NODE)

    model, opt = build()
    _steps(model, opt, topo, 0, 3)
    saved = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state_dict().items()}
    saved["groups"] = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in g.items()} for g in saved["groups"]]
    first = _steps(model, opt, topo, 3, 3)
    with opt.gathered_parameters():
        first_params = numpy_params(model)
    opt.remove_hooks()

    model, opt = build()
    opt.load_state_dict(saved)
    with torch.no_grad():  # an eval forward: gathers over dp (and refreshes the slices), no backward
        x, y = token_batch(3, 2 * topo.dp_size)
        lo = topo.dp_rank * 2
        eval_loss = model(x[lo: lo + 2], y[lo: lo + 2]).item()
    with opt.gathered_parameters():
        numpy_params(model)
    second = _steps(model, opt, topo, 3, 3)
    with opt.gathered_parameters():
        second_params = numpy_params(model)
    opt.remove_hooks()
    return {"first": first, "second": second, "eval": eval_loss, "first_params": first_params,
            "second_params": second_params}


def _bad_size(topo):
    from hybrid.zero import ZeroConfigError
    from tests.zero.common import make_zero

    try:
        make_zero(TiedMLP(), topo, stage=3, hpz_partition_size=4)
    except ZeroConfigError as e:
        return str(e)
    return None


def _suite():
    from hybrid import Topology

    topo = Topology(ranks_per_node=PER_NODE)
    res = {"bad": _bad_size(topo)}
    for hpz in (1, PER_NODE):
        res[("gpt", hpz)] = _gpt_run(topo, hpz)
        res[("recompute", hpz)] = _gpt_run(topo, hpz, steps=2, recompute="full")
        res[("quant", hpz)] = _quantized_run(topo, hpz)
    res["checkpoint"] = _checkpoint_run(topo)
    return res


@pytest.fixture(scope="module")
def results():
    return run_distributed(_suite, WORLD, timeout=400)


def _same(a, b):
    return set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_hpz_trains_bit_identically_to_stage3_and_matches_one_process(results):
    ref_losses, ref_norms, ref_params = _reference()
    for kind in ("gpt", "recompute", "quant"):
        for r in results:
            off, on = r[(kind, 1)], r[(kind, PER_NODE)]
            assert on["losses"] == off["losses"], kind
            assert _same(on["params"], off["params"]), kind
    on = [r[("gpt", PER_NODE)] for r in results]
    losses = rel_diff_list(dp_mean([r["losses"] for r in on]), ref_losses)
    params = max_rel_diff(on[0]["params"], ref_params)
    print(f"stage 3 + hpZ 2, dp 4 as 2 nodes x 2, fp32, {STEPS} steps: losses {losses:.1e}, params {params:.1e} "
          f"max relative against one process")
    assert losses < 1e-5 and params < 1e-5  # the stage-3 parity tests' tolerance
    for r in on:
        assert rel_diff_list(r["norms"], ref_norms) < 1e-5


def _inter(results, key, name):
    """Bytes each node sent off it for collective ``name`` (summed over its ranks), nodes in order."""
    per_node = [0.0] * (WORLD // PER_NODE)
    for rank, r in enumerate(results):
        per_node[rank // PER_NODE] += r[key]["comm"].get(name, {}).get("inter_node_bytes", 0.0)
    return per_node


def test_backward_gathers_stay_inside_the_node(results):
    for kind in ("gpt", "quant"):  # the last step's traffic (every step after the first moves the same)
        on, off = (kind, PER_NODE), (kind, 1)
        for r in results:
            node = r[on]["comm"]["all_gather/dp_node"]
            assert node["calls"] > 0 and node["inter_node_bytes"] == 0
            assert "all_gather/dp_node" not in r[off]["comm"]
            # Every unit re-gathered in backward moved over dp_node instead of dp (and unquantized, so the
            # quantized run's payloads differ); the forward and post-step gathers and the gradients are unchanged.
            assert r[off]["comm"]["all_gather/dp"]["calls"] == r[on]["comm"]["all_gather/dp"]["calls"] + node["calls"]
            assert r[off]["comm"]["reduce_scatter/dp"] == r[on]["comm"]["reduce_scatter/dp"]
        on_bytes = sum(_inter(results, on, "all_gather/dp"))
        off_bytes = sum(_inter(results, off, "all_gather/dp"))
        print(f"{kind}: all-gather bytes leaving the nodes per step, hpZ {on_bytes:.0f} vs stage 3 {off_bytes:.0f} "
              f"({on_bytes / off_bytes:.3f}); dp_node gathers {results[0][on]['comm']['all_gather/dp_node']}")
        assert 0.4 < on_bytes / off_bytes < 0.6  # about half: forward's gathers only


def test_the_planner_predicts_the_gathers_bytes(results):
    """The forward gathers over dp (every unit, the tied head's once more) and what leaves each node: within
    0.1% of the communicator's figures; backward's dp_node gathers are every unit the backward needs again."""
    from hybrid.plan.comm_volume import dp_volume
    from hybrid.plan.links import Placement, split_by_link
    from hybrid.plan.model_memory import stage3_layout

    cfg = gpt_config()
    layout = stage3_layout(cfg, 1, WORLD, "fp32", THRESHOLD)
    predicted = dp_volume(layout, 3, 1, tied_head=cfg.tie_embeddings, hpz=PER_NODE, keep=NO_KEEP)
    links = split_by_link(predicted, Placement(tp=1, dp=WORLD, nodes=WORLD // PER_NODE, ranks_per_node=PER_NODE))
    key = ("gpt", PER_NODE)
    for name in ("all_gather/dp", "reduce_scatter/dp"):
        got, want = results[0][key]["comm"][name]["payload_bytes"], predicted[name]["payload_bytes"]
        assert abs(got - want) <= 1e-3 * want, (name, got, want)
        for got_node, want_node in zip(_inter(results, key, name), links[name].inter_bytes_by_node):
            assert abs(got_node - want_node) <= 1e-3 * want_node, (name, got_node, want_node)
    assert links["all_gather/dp_node"].inter_bytes_by_node == (0.0, 0.0)
    # The position table's backward needs no weights (an embedding lookup saves none): not gathered again.
    units = results[0][key]["units"]
    tables = sum(n for name, n, p in units if not p and name == "embedding.position_embeddings")
    got = results[0][key]["comm"]["all_gather/dp_node"]["payload_bytes"]
    assert got == predicted["all_gather/dp_node"]["payload_bytes"] - 4 * tables, (got, predicted)


def test_the_secondary_partition_costs_params_over_l(results):
    from hybrid.plan.model_memory import stage3_layout, stage3_state_bytes

    cfg = gpt_config()
    planned = stage3_state_bytes(stage3_layout(cfg, 1, WORLD, "fp32", THRESHOLD), hpz=PER_NODE)
    for r in results:
        on, off = r[("gpt", PER_NODE)], r[("gpt", 1)]
        gathered = sum(n for _, n, p in on["units"] if not p)  # padded elements of the gathered units
        persistent = sum(n for _, n, p in on["units"] if p)
        secondary = on["memory"]["secondary_params"]
        assert secondary == 4 * gathered // PER_NODE
        trainable = on["psi"] - persistent  # unpadded
        assert 4 * trainable / PER_NODE <= secondary <= 4 * (trainable + WORLD * 64 * len(on["units"])) / PER_NODE
        assert secondary == planned.secondary_weights
        assert off["memory"]["secondary_params"] == 0
        assert on["memory"]["total"] == off["memory"]["total"] + secondary
        assert on["memory"]["params"] == off["memory"]["params"]


def test_a_size_other_than_the_node_share_is_refused_in_one_line(results):
    for r in results:
        assert r["bad"] == BAD_SIZE


def test_checkpoints_round_trip_with_hpz(results):
    for r in results:
        c = r["checkpoint"]
        assert c["second"] == c["first"]
        assert _same(c["second_params"], c["first_params"])
        assert c["eval"] == c["first"][0]  # the eval forward saw the loaded weights
