"""Two emulated nodes (network namespaces joined by a tbf-shaped veth) train the tiny GPT.

World 4 = 2 nodes x 2 ranks, TP=2 inside each node, DP=2 across the link, ZeRO-1. Checks that
the job trains, that the data-parallel traffic crossed the shaped link in about the amount the
model size predicts, and that nothing (namespace or process) is left behind; and that a
checkpoint moves between the 2-node cluster and one node of 4 ranks, both ways, resuming bit for
bit. Skips, with the reason, where namespaces cannot be made (not root, no iproute2).
"""

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from hybrid.checkpoint import CheckpointReader
from hybrid.plan.model_memory import shard_shapes
from model_zoo.config import GPTConfig
from tests.multiproc import local_torchrun

REPO = Path(__file__).resolve().parents[1]
PREFIX = "hyt"  # not the tool's default, so a benchmark's cluster and this test never collide
NODES, RANKS_PER_NODE, TP, STEPS = 2, 2, 2, 3
MODEL = dict(num_layers=2, hidden_size=64, num_heads=4, seq_length=32, vocab_size=512)
TRAIN = ["-m", "hybrid.train", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--vocab-size", "512", "--mock-data", "--micro-batch-size", "1",
         "--global-batch-size", "4", "--lr", "1e-3", "--eval-interval", "0", "--log-interval", "1",
         "--train-iters", str(STEPS), "--tensor-model-parallel-size", str(TP), "--zero-stage", "1"]


@pytest.fixture(scope="module")
def tool():
    from tools import emulated_cluster as module
    try:
        module.check_available(PREFIX)
    except module.ClusterUnavailable as e:
        pytest.skip(str(e))
    return module


def estimated_link_bytes(steps: int) -> dict:
    """What each node's veth should send, from the model size alone (payload, no TCP/IP headers).

    One TP rank's shard holds S fp32 elements; the node's TP ranks are each in a DP group of two
    that spans the link. Per step each of them sends the ring reduce-scatter of the gradients,
    0.5 x 4S at world 2, and the ZeRO-1 all-gather of the new weights, 0.5 x 4S: together one
    all-reduce's bytes. Once at the start, node 0 broadcasts the weights over DP: 4S per TP rank.
    """
    shard = sum(p.numel for p in shard_shapes(GPTConfig(**MODEL), TP))
    per_step = RANKS_PER_NODE * 1.0 * 4 * shard
    return {"node1": steps * per_step, "node0": steps * per_step + RANKS_PER_NODE * 4 * shard, "shard": shard}


def test_two_emulated_nodes_train_over_a_shaped_link(tool):
    with tool.EmulatedCluster(nodes=NODES, ranks_per_node=RANKS_PER_NODE, rate="200mbit", prefix=PREFIX,
                              lock_timeout_s=60) as cluster:
        node0, node1 = cluster.nodes
        for node in cluster.nodes:
            qdisc = cluster.qdisc(node)
            assert "tbf" in qdisc and "200Mbit" in qdisc, qdisc
        result = cluster.run(TRAIN, timeout_s=120, cwd=str(REPO))
        marker = cluster.marker
    print(result.describe())
    for node in result.nodes:
        assert node.returncode == 0, f"{node.node.netns}: {node.killed or node.returncode}\n{node.output[-3000:]}"
    assert re.search(rf"iteration\s+{STEPS}/{STEPS}", result.nodes[0].output), result.nodes[0].output[-3000:]

    # The DP traffic crossed the shaped link: the interface counters against the communicator's own count of
    # the bytes each node sent off-node (the trainer's last line), within 10%, and against the model-size estimate.
    estimate = estimated_link_bytes(STEPS)
    counted = re.search(r"inter-node traffic \(bytes sent off each node\): (.*)", result.nodes[0].output)
    assert counted, result.nodes[0].output[-3000:]
    by_node = {int(k): int(b) for k, b in re.findall(r"node (\d+) (\d+)", counted.group(1))}
    for k, node in enumerate(result.nodes):
        sent = result.link_bytes[node.node.netns]["tx_bytes"]
        expected = estimate[f"node{k}"]
        print(f"{node.node.netns}: tx {sent:,} B, communicator {by_node[k]:,} B ({by_node[k] / sent:.3f} of tx), "
              f"estimate {expected:,.0f} B (shard {estimate['shard']:,} elements), ratio {sent / expected:.3f}")
        assert abs(by_node[k] - sent) <= 0.10 * sent, (k, by_node[k], sent)
        assert 0.8 * expected <= sent <= 1.5 * expected, (sent, expected)
    b0, b1 = (result.link_bytes[n.netns] for n in (node0, node1))
    # One point-to-point link: what one end sent, the other received, up to a few small packets of the finished
    # job's connections closing (counted at one end and not, or not yet, at the other: one run of the suite saw
    # 90 bytes of 2.2 MB), never a share of the traffic.
    slack = 4 * 128
    assert abs(b0["tx_bytes"] - b1["rx_bytes"]) <= slack and abs(b1["tx_bytes"] - b0["rx_bytes"]) <= slack, (b0, b1)

    # Nothing left behind: no namespace of ours, no process the run started.
    assert tool.own_namespaces(PREFIX) == []
    assert tool.marked_processes(marker) == []


def _one_node(argv, timeout_s: float = 180.0) -> subprocess.CompletedProcess:
    """``argv`` (after ``python``) as a 4-rank torchrun job on this machine's loopback, outside any namespace."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run(local_torchrun(argv, NODES * RANKS_PER_NODE), cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout_s)


def _assert_same_state(a: Path, b: Path) -> None:
    """Two checkpoints of the same layout hold bit-identical weights and optimizer partitions."""
    ra, rb = CheckpointReader(a), CheckpointReader(b)
    assert ra.layout == rb.layout and ra.iteration == rb.iteration
    for tp in range(ra.layout.tp):
        wa, wb = ra.load_model_shard(tp), rb.load_model_shard(tp)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), (a, b, tp)
        for dp in range(ra.layout.dp):
            oa, ob = ra.load_optimizer_shard(tp, dp), rb.load_optimizer_shard(tp, dp)
            ta, tb = list(_tensors(oa)), list(_tensors(ob))
            assert len(ta) == len(tb) > 0 and all(torch.equal(x, y) for x, y in zip(ta, tb)), (a, b, tp, dp)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _tensors(obj[k])
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


@pytest.mark.slow  # four jobs, about a minute: `pytest tests/test_emulated_cluster.py -m slow`
def test_checkpoints_move_between_two_nodes_and_one_both_ways(tool, tmp_path):
    """2 nodes -> 1 node and 1 node -> 2 nodes, in the same layout (TP=2 x DP=2): the resumed run ends on the
    same bits as the uninterrupted one."""
    train = list(TRAIN)
    train[train.index("--train-iters") + 1] = "4"
    two, one_resumed, one, two_resumed = (tmp_path / n for n in ("two", "one_resumed", "one", "two_resumed"))
    save = ["--save-interval", "2", "--save"]
    with tool.EmulatedCluster(nodes=NODES, ranks_per_node=RANKS_PER_NODE, rate="200mbit", prefix=PREFIX,
                              lock_timeout_s=60) as cluster:
        straight = cluster.run(train + save + [str(two)], timeout_s=120, cwd=str(REPO))
        assert straight.ok, straight.describe() + straight.nodes[0].output[-3000:]
        proc = _one_node(train + ["--train-iters", "2"] + save + [str(one)])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        resumed = cluster.run(train + save + [str(two_resumed), "--load", str(one / "iter_0000002")],
                              timeout_s=120, cwd=str(REPO))
        assert resumed.ok, resumed.describe() + resumed.nodes[0].output[-3000:]
    proc = _one_node(train + save + [str(one_resumed), "--load", str(two / "iter_0000002")])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _assert_same_state(two / "iter_0000002", one / "iter_0000002")  # the same first half on either cluster
    _assert_same_state(two / "iter_0000004", one_resumed / "iter_0000004")  # 2 nodes -> 1 node
    _assert_same_state(two / "iter_0000004", two_resumed / "iter_0000004")  # 1 node -> 2 nodes


@pytest.mark.parametrize("argv,message", [
    (["up", "--nodes", "0"], "--nodes 0: an emulated cluster has 2 to 64 nodes"),
    (["up", "--nodes", "1"], "--nodes 1: an emulated cluster has 2 to 64 nodes"),
    (["up", "--nodes", "65"], "--nodes 65: an emulated cluster has 2 to 64 nodes"),
    (["run", "--nodes", "0", "--", "-c", "pass"], "--nodes 0: an emulated cluster has 2 to 64 nodes"),
    (["run", "--timeout", "0", "--", "-c", "pass"], "--timeout 0: give a positive number of seconds"),
    (["run", "--timeout", "-5", "--", "-c", "pass"], "--timeout -5: give a positive number of seconds"),
    (["run", "--ranks-per-node", "0", "--", "-c", "pass"], "--ranks-per-node 0: give at least 1"),
])
def test_bad_flags_are_refused_before_anything_is_built(argv, message, monkeypatch, capsys):
    """Runs anywhere (no root needed): nothing may be looked up, locked or built for a bad flag."""
    from tools import emulated_cluster as module

    def never(*_args, **_kwargs):
        raise AssertionError("a cluster was looked up or built for a bad flag")

    for name in ("is_up", "check_available", "remove_stale"):
        monkeypatch.setattr(module, name, never)
    monkeypatch.setattr(module.EmulatedCluster, "up", never)
    monkeypatch.setattr(module.EmulatedCluster, "attach", never)
    assert module.main(["--prefix", "hyq", *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"emulated_cluster: {message}\n", err
