"""benchmarks/zero_vs_peers.py without running it: paired ratios and their spread, the two tables' pairs and
configurations, the weight-decay rule the peers get, and that the peers' plain twin is the same model as
hybrid's GPT (so a loss gap means a different training, not a different network)."""

import pytest
import torch

from benchmarks import zero_vs_peers as zvp
from benchmarks.paired import paired_ratio


def test_paired_ratio_pairs_rounds_not_medians():
    # Round 2 is a busy spell for both contenders: pairing per round cancels it, a ratio of medians would not.
    hybrid = {0: 100.0, 1: 300.0, 2: 110.0}
    peer = {0: 200.0, 1: 400.0, 2: 100.0}
    r = paired_ratio(hybrid, peer)
    assert r.rounds == (0, 1, 2)
    assert r.ratios == pytest.approx((0.5, 0.75, 1.1))
    assert r.median == pytest.approx(0.75)
    assert r.spread == pytest.approx((0.5, 1.1))
    assert r.format() == "0.75x (0.50-1.10)"
    assert r.as_dict()["min"] == pytest.approx(0.5)


def test_paired_ratio_skips_rounds_that_one_side_missed():
    r = paired_ratio({0: 1.0, 1: 2.0, 2: 3.0}, {1: 4.0, 2: 3.0, 3: 9.0})
    assert r.rounds == (1, 2) and r.ratios == pytest.approx((0.5, 1.0))
    assert paired_ratio({0: 1.0}, {1: 1.0}) is None
    with pytest.raises(ValueError, match="round 0"):
        paired_ratio({0: 1.0}, {0: 0.0})


def _run(ms, loss=2.0, peak=100.0):
    return {"median_ms": ms, "peak_mb": peak, "losses": [3.0, loss], "cpu_ms": 2 * ms, "train_mb": 10.0,
            "state_elements": 8, "max_dloss": 1e-7, "config": {}}


def test_pair_rows_and_tables():
    h, p = zvp.HYBRID[1], zvp.DEEPSPEED[1]
    runs = {h.name: {0: _run(100.0, peak=50.0), 1: _run(90.0), 2: _run(500.0)},
            p.name: {0: _run(200.0, loss=2.5), 2: _run(400.0, loss=2.25)}}  # the peer failed round 1
    (row,) = zvp.pair_rows(runs, [(h, p), (zvp.HYBRID[0], zvp.DDP)])  # DDP never ran: no row
    assert row["ratio"].rounds == (0, 2)
    assert row["ratio"].ratios == pytest.approx((0.5, 1.25))
    assert row["hybrid_ms"] == pytest.approx(300.0) and row["peer_ms"] == pytest.approx(300.0)  # paired rounds only
    assert row["hybrid_peak_mb"] == 100.0 and row["peer_loss"] == 2.25
    text = "\n".join(zvp.format_pair_table([row]))
    assert "0.88x (0.50-1.25)" in text and p.name in text
    lines = zvp.format_contender_table(runs, [h, p], psi=4, tol=1e-6)
    assert "100 90 500" in lines[2] and not lines[2].endswith("!")
    assert zvp.loss_problems(runs, tol=1e-6) == []
    runs[p.name][2]["max_dloss"] = float("nan")
    assert zvp.loss_problems(runs, tol=1e-6) == [f"{p.name}: max |loss - float64 reference| nan > 1.00e-06"]


def test_round_order_alternates():
    cs = zvp.all_contenders()
    assert zvp.round_order(cs, 0) == cs and zvp.round_order(cs, 1) == cs[::-1] and zvp.round_order(cs, 2) == cs


def test_tables_defaults_and_matched():
    defaults, matched = zvp.TABLES["defaults"], zvp.TABLES["matched"]
    assert [h for h, _ in defaults] == [h for h, _ in matched]
    assert [(h.stage, p.name) for h, p in defaults if p.kind == "ddp"] == [(s, "torch DDP") for s in range(4)]
    assert all(not p.matched for _, p in defaults)
    for (_, dp), (_, mp) in zip(defaults, matched):
        assert mp == dp if dp.kind in ("fsdp2", "dtensor_tp_fsdp2") else (mp.matched and mp.name.endswith("[matched]"))
    fsdp = {h.stage: p.reshard for h, p in defaults if p.kind == "fsdp2"}
    assert fsdp == {2: False, 3: True}
    names = [c.name for c in zvp.all_contenders()]
    assert len(names) == len(set(names)) == 18


def test_peer_configurations():
    args = zvp.parse([])
    zero, opt = zvp.hybrid_zero_defaults()
    assert zvp.ddp_kwargs(zvp.DDP, args) == {}
    assert zvp.ddp_kwargs(zvp._matched(zvp.DDP), args) == {"bucket_cap_mb": zero.bucket_size * 4 / 2**20}
    for s in (1, 2, 3):
        ds = zvp.deepspeed_config(zvp.DEEPSPEED[s], args)
        assert ds["zero_optimization"] == {"stage": s}  # DeepSpeed's own defaults: nothing else set
        assert ds["optimizer"]["params"] == {"lr": args.lr, "betas": list(opt.betas), "eps": opt.eps,
                                             "weight_decay": args.wd}
        assert ds["gradient_clipping"] == 0.0
        m = zvp.deepspeed_config(zvp._matched(zvp.DEEPSPEED[s]), args)["zero_optimization"]
        assert m["reduce_bucket_size"] == m["allgather_bucket_size"] == zero.bucket_size
        assert m["overlap_comm"] is zero.overlap_comm
        assert ("stage3_prefetch_bucket_size" in m) == (s == 3)
    bucket = zvp.parse(["--bucket", "1000"])
    assert zvp.hybrid_config(zvp.HYBRID[2], bucket)["zero"] == {"stage": 2, "bucket_size": 1000}
    assert zvp.hybrid_config(zvp.HYBRID[2], args)["zero"] == {"stage": 2}
    assert zvp.hybrid_config(zvp.HYBRID_TP, args)["micro_batch_size"] == args.global_batch // (zvp.WORLD // zvp.TP)


def test_bad_arguments_fail_in_one_line(capsys):
    with pytest.raises(SystemExit):
        zvp.parse(["--global-batch", "6"])
    assert "--global-batch must be divisible by 4" in capsys.readouterr().err


def test_peers_train_the_same_model_with_the_same_decay():
    """The plain twin computes hybrid's GPT loss, and its param groups are hybrid's default no-decay rule."""
    from hybrid import Topology
    from hybrid.engine.builders import exclude_1d_params
    from model_zoo import GPTModel

    args = zvp.parse(["--quick"])
    cfg = zvp.gpt_config(args)
    torch.manual_seed(0)
    zoo = GPTModel(cfg, Topology.local()).double()
    torch.manual_seed(0)
    twin = zvp.PlainGPT.from_zoo(cfg).double()
    x, y = zvp.batch(0, args)
    # float64 weights and activations: the two differ in summation order only (fused vs split qkv), ~1e-15;
    # the zoo's cross-entropy returns its loss rounded to fp32 (within eps/2 relative), which dominates
    with torch.no_grad():
        assert float(zoo(x, y)) == pytest.approx(float(twin(x, y)), rel=torch.finfo(torch.float32).eps, abs=0)
    decayed, exempt = zvp.param_groups(twin.named_parameters(), 0.1)
    zoo_exempt = sum(p.numel() for n, p in zoo.named_parameters() if exclude_1d_params(n, p))
    assert sum(p.numel() for p in exempt["params"]) == zoo_exempt > 0
    assert decayed["weight_decay"] == 0.1 and exempt["weight_decay"] == 0.0


def test_loss_tolerance_floor():
    eps = torch.finfo(torch.float32).eps
    assert zvp.loss_tolerance([2.0, 1.0], [2.0, 1.0]) == pytest.approx(4 * eps * 2.0)  # the floor: one rounding
    assert zvp.loss_tolerance([2.0, 1.0], [2.0, 1.1]) == pytest.approx(0.4)  # 4x the fp32 reference's own gap
