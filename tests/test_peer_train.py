"""benchmarks/peer_train.py: a peer trains under torchrun and slow_link reads its output as it reads hybrid.train's."""

import os
import subprocess
from pathlib import Path

from benchmarks import slow_link
from tests.multiproc import local_torchrun

REPO = Path(__file__).resolve().parents[1]
WORLD = 4


def _torchrun(argv, timeout_s: float = 240.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run(local_torchrun(argv, WORLD), cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def _args(**over):
    args = slow_link.parse(["--hidden", "32", "--layers", "1", "--heads", "4", "--seq", "32", "--vocab", "128",
                            "--iters", "3", "--only", "fsdp2-dp4-noreshard,dp4-z2"])
    for k, v in over.items():
        setattr(args, k, v)
    return args


def test_peers_run_only_when_asked_or_named():
    plain = {c.name for c in slow_link.parse([]).contenders}
    with_peers = {c.name for c in slow_link.parse(["--peers"]).contenders}
    peers = {c.name for c in slow_link.CONTENDERS if c.peer is not None}
    assert peers and not plain & peers
    assert with_peers == plain | peers
    assert [c.name for c in _args().contenders] == ["dp4-z2", "fsdp2-dp4-noreshard"]


def test_a_peer_trains_under_torchrun_and_slow_link_parses_its_lines():
    args = _args()
    peer = next(c for c in args.contenders if c.peer is not None)
    argv = slow_link.train_argv(peer, args, args.iters)
    assert argv[0].endswith("peer_train.py") and "hybrid.train" not in argv
    done = _torchrun(argv)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    iterations = slow_link.parse_iterations(done.stdout)
    assert [i for i, _, _ in iterations] == [1, 2, 3] and all(ms > 0 for _, ms, _ in iterations)
    profile = slow_link.parse_profile(done.stdout)
    assert profile["iterations_measured"] == 2  # the first is left out, as hybrid.train's profile does
    assert profile["iteration_ms_median"] > 0 and profile["exposed_comm_ms_median"] is None
    assert len(profile["peak_rss_mib"]) == WORLD and all(r > 0 for r in profile["peak_rss_mib"])
    # the loss moves: the peer really trains
    losses = [float(line.split("lm loss: ")[1].split(" ")[0]) for line in done.stdout.splitlines()
              if "lm loss: " in line]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_a_micro_batch_that_is_not_global_over_world_is_refused_naming_the_rule():
    args = _args(micro_batch=2)
    peer = next(c for c in args.contenders if c.peer is not None)
    done = _torchrun(slow_link.train_argv(peer, args, 1))
    assert done.returncode != 0
    assert "--micro-batch-size x ranks = --global-batch-size" in done.stderr
