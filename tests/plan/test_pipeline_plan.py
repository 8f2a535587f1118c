"""The planner's pipeline layouts on paper: activations in flight, the bubble, stage memory, ranking.

``test_pipeline_truth.py`` holds the same predictions against real runs; these
check the rules against formulas written here, independently of the code.
"""

from __future__ import annotations

import math

import pytest

from hybrid.layout import LayoutError, ParallelLayout
from hybrid.plan import CPU, Candidate, LinkSpec, TrainingSetup, activation_bytes, predict_step_time
from hybrid.plan.cli import main
from hybrid.plan.cluster import Cluster
from hybrid.plan.estimate import estimate_memory, estimate_stages
from hybrid.plan.layouts import Choices, enumerate_layouts, plan
from hybrid.plan.pipeline_stages import stage_share, transfers
from model_zoo import get_preset
from tests.plan.test_layouts_cli import TNLG


def _candidate(pp, schedule="1f1b", v=1, tp=1, dp=1, stage=1, **kw):
    return Candidate(ParallelLayout(tp=tp, dp=dp, pp=pp, zero_stage=stage, precision="fp32"),
                     pipeline_schedule=schedule, virtual_stages=v, **kw)


def test_activations_in_flight_follow_the_schedule():
    cfg = get_preset("tiny").replace(num_layers=8)
    act = activation_bytes(cfg, 1, precision="fp32", profile=CPU)
    for pp, m in ((4, 8), (4, 2), (2, 16)):
        for r in range(pp):
            # 1F1B: rank r warms up with p - r forwards (fewer when the step has fewer micro-batches)
            assert stage_share(cfg, _candidate(pp), act, m, r).in_flight == min(m, pp - r)
            assert stage_share(cfg, _candidate(pp, "gpipe"), act, m, r).in_flight == m
    # interleaved, v chunks: rank r runs (p - r - 1) * 2 + (v - 1) * p warm-up forwards, then one more
    for pp, v, m in ((2, 2, 4), (4, 2, 8)):
        for r in range(pp):
            share = stage_share(cfg, _candidate(pp, "interleaved", v), act, m, r)
            assert share.in_flight == (pp - r - 1) * 2 + (v - 1) * pp + 1
    # bytes: the first 1F1B stage of 4 holds 4 micro-batches of its layer (8 layers + embedding + head over 4
    # stages: 1, 2, 3, 2), its embedding and its outputs
    assert _candidate(4).stage_split(cfg).counts() == [1, 2, 3, 2]
    share = stage_share(cfg, _candidate(4), act, 8, 0)
    output = 4 * cfg.seq_length * cfg.hidden_size
    assert share.saved == 4 * (act.per_layer + act.embedding)
    assert share.held == share.saved + 4 * output


def test_stage_memory_and_traffic():
    cfg = get_preset("tiny").replace(num_layers=8)
    setup = TrainingSetup(profile=CPU)
    whole = estimate_memory(cfg, _candidate(1), setup)
    stages = estimate_stages(cfg, _candidate(4), setup, 8)
    # every stage holds about a quarter of the layers' weights; the tied word embeddings twice (first and last)
    h, v = cfg.hidden_size, cfg.padded_vocab_size(1)
    assert sum(m.weights for m in stages) == pytest.approx(whole.weights + 4 * v * h, rel=0.01)
    assert [m.in_flight for m in stages] == [4, 3, 2, 1]  # 1F1B: rank r holds p - r of the 8 micro-batches
    with pytest.raises(ValueError, match="micro_batches"):
        estimate_memory(cfg, _candidate(4), setup)
    # transfers: a middle rank sends (and receives) an activation and a gradient per micro-batch
    calls, nbytes = transfers(cfg, _candidate(4), 8, 1)
    assert (calls, nbytes) == (16, 4 * cfg.seq_length * cfg.hidden_size)
    assert transfers(cfg, _candidate(4, tp=2, sequence_parallel=True), 8, 0)[1] == nbytes // 2
    assert transfers(cfg, _candidate(2, "interleaved", 2), 4, 0)[0] == 3 * 4  # parts 0 and 2: three transfers


def test_the_step_pays_the_bubble():
    cfg = get_preset("tiny").replace(num_layers=8)
    fast = LinkSpec(intra_bytes_per_s=math.inf, inter_bytes_per_s_per_node=math.inf)
    for pp, v, m in ((4, 1, 8), (2, 2, 4)):
        layout = ParallelLayout(tp=1, dp=1, pp=pp, zero_stage=1, precision="fp32")
        schedule = "interleaved" if v > 1 else "1f1b"
        setup = TrainingSetup(profile=CPU)
        t = predict_step_time(cfg, layout, 1, m, 1, 1, fast, 1e9, setup=setup, pipeline_schedule=schedule,
                              virtual_stages=v)
        b = (pp - 1) / (v * m + pp - 1)
        assert t.bubble == pytest.approx(t.compute * b / (1 - b))
        assert t.pipeline == 0.0  # transfers over infinitely fast links take no time


def test_a_slow_link_carries_every_rank_of_the_nodes_pipeline_sends():
    # GPT-2 1.5B on 2 nodes of 8, one stage per node: all 8 ranks of a node send their activations (or their
    # gradients) at once over the node's one link. The transfers that fill and drain the pipeline wait; the
    # others hide behind compute as long as the link carries them in time, and once it cannot, the step is at
    # least the time the link needs.
    cfg = get_preset("gpt2-xl")
    layout = ParallelLayout(tp=1, dp=8, pp=2, zero_stage=1, precision="bf16")
    m = 512 // 8  # micro-batches per step of each DP rank (micro batch 1)
    calls, nbytes = transfers(cfg, Candidate(layout, micro_batch=1), m, 0)  # rank 0: m activations forward
    assert calls == m
    exposed = {}
    for gbytes_per_s in (0.125, 1.25, 12.5):
        bandwidth = gbytes_per_s * 1e9
        link = LinkSpec(intra_bytes_per_s=150e9, inter_bytes_per_s_per_node=bandwidth)
        t = predict_step_time(cfg, layout, 1, 512, 1, 8, link, 0.4 * 989e12)
        transfer = 8 * nbytes / bandwidth  # one transfer: the node's 8 ranks' pieces together
        busy = calls * transfer  # the node's link carrying the step's sends
        assert t.total >= busy
        assert t.pipeline >= 2 * transfer + max(0.0, busy - t.compute)
        exposed[gbytes_per_s] = (busy, t.pipeline, t.compute)
    busy, pipeline, compute = exposed[0.125]
    assert busy > compute and pipeline >= busy - compute  # the link cannot keep up: it sets the step
    busy, pipeline, compute = exposed[12.5]
    assert busy < compute and pipeline < 0.1 * compute  # it keeps up: the transfers hide behind compute


def test_pipelines_are_enumerated_and_ranked():
    config = get_preset("turing-nlg-17b")
    cluster = Cluster(gpus=256, gpus_per_node=16, gpu_memory=32 * 2**30, inter_node_gbps=12.5)
    layouts = enumerate_layouts(config, cluster, 512, Choices(pp=(1, 2, 4, 16), stages=(1, 2, 3)))
    assert {c.pp for c in layouts} == {1, 2, 4, 16}
    assert all(c.tp * c.dp * c.pp == 256 for c in layouts)
    assert not [c for c in layouts if c.pp > 1 and c.traits.parameters]  # stage 3 does not pipeline
    ranked = plan(config, cluster, 512, choices=Choices(pp=(1, 4, 16), stages=(1,), offloads=("none",),
                                                        recomputes=("none",), micro_batches=(1,)))
    by_pp = {}
    for e in ranked:
        by_pp.setdefault(e.candidate.pp, e)
    # a deeper pipeline holds fewer weights per GPU
    assert by_pp[16].memory.weights < by_pp[4].memory.weights < by_pp[1].memory.weights
    with pytest.raises(LayoutError, match=r"no pipeline size in \[3\]"):
        enumerate_layouts(config, cluster, 512, Choices(pp=(3,)))  # 3 divides no stage of 256 GPUs


def test_command_line_ranks_pipelines(capsys):
    assert main(TNLG + ["--pp", "1", "4", "16", "--zero-stage", "1", "--offload", "none", "--recompute", "none",
                        "--inter-node-bandwidth", "12.5", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert " pp " in out.splitlines()[4] and "pipe s" in out
    assert "best: tp=" in out and " pp=" in out.split("best:")[1].splitlines()[0]
