"""--profile: a torch.profiler Chrome trace of iterations [start, end) on the chosen ranks, each collective a span
named by its operation and axis."""

import glob
import importlib.util
import json
import os

import pytest

from hybrid.config import ConfigError
from tests.monitor.tiny_run import SMALL, train
from tests.multiproc import run_distributed

SMALL = SMALL + ["--log-interval", "100", "--eval-interval", "0"]


def _trace(folder, rank):
    """The one trace ``rank`` wrote in ``folder``: its events."""
    (path,) = glob.glob(os.path.join(folder, f"rank{rank}.*.pt.trace.json"))
    with open(path) as f:
        return json.load(f)["traceEvents"]


def _names(events):
    return {e.get("name") for e in events if e.get("ph") == "X"}


def _steps(events):
    return sorted(int(name.split("#")[1]) for name in _names(events) if name.startswith("ProfilerStep#"))


def test_one_process_traces_the_window(tmp_path):
    """The fast case: one process, iterations [2, 4) of 5 are the trace's steps, nothing else is."""
    board = str(tmp_path / "tb")
    run_distributed(train, 1, SMALL + ["--train-iters", "5", "--global-batch-size", "1", "--tensorboard-dir",
                                        board, "--profile", "--profile-step-start", "2", "--profile-step-end", "4"])
    events = _trace(board, 0)
    assert _steps(events) == [2, 3]
    assert any(name.startswith("aten::") for name in _names(events))  # the ops the iterations ran


def test_the_communicator_guard_is_a_labelled_span_while_profiling():
    """Every launch and wait of the communicator passes a Guard: under a profiler it is the span
    ``{op}/{axis}`` around the call (here a 20 ms stand-in for the collective), and outside one no span at all."""
    import time

    import torch

    from hybrid.comm import Guard, OpName

    blocked = []
    guard = Guard(OpName("reduce_scatter", "dp", (0, 1)), None, blocked.append)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with guard:
            time.sleep(0.02)
    (span,) = [e for e in prof.events() if e.name == "reduce_scatter/dp"]
    # the span holds the whole call: at least the 20 ms slept (to the profiler clock's microsecond)
    assert span.cpu_time_total >= 20e3 - 1 and blocked[0] >= 0.02
    with guard:  # no profiler: nothing opened
        assert guard._span is None


@pytest.mark.slow
def test_four_ranks_trace_the_chosen_ranks_with_labelled_collectives(tmp_path):
    """TP 2 x DP 2 at ZeRO 1, ranks 0 and 1 traced over iterations 3 and 4: a trace each, none from ranks 2 and
    3; each holds those two steps and the collectives by axis (the TP all-reduces of the layers, ZeRO's DP
    reduce-scatter of the gradients and all-gather of the weights). With --wandb-project too: one W&B run, rank
    0's."""
    board, runs = str(tmp_path / "tb"), str(tmp_path / "wb")
    wandb = ["--wandb-project", "p", "--wandb-save-dir", runs] if importlib.util.find_spec("wandb") else []
    run_distributed(train, 4, SMALL + ["--train-iters", "5", "--global-batch-size", "4", "--tensorboard-dir",
                                        board, "--tensor-model-parallel-size", "2", "--zero-stage", "1",
                                        "--profile", "--profile-step-start", "3", "--profile-step-end", "5",
                                        "--profile-ranks", "0", "1", *wandb], timeout=240)
    if wandb:
        assert len(glob.glob(os.path.join(runs, "wandb", "offline-run-*"))) == 1
    assert sorted(os.path.basename(p).split(".")[0] for p in glob.glob(os.path.join(board, "*.pt.trace.json"))) \
        == ["rank0", "rank1"]
    for rank in (0, 1):
        events = _trace(board, rank)
        assert _steps(events) == [3, 4]
        names = _names(events)
        assert {"all_reduce/tp", "reduce_scatter/dp", "all_gather/dp"} <= names, sorted(
            n for n in names if "/" in n)
        # every labelled span lies inside a traced step
        steps = [e for e in events if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")]
        for e in events:
            if e.get("ph") == "X" and e["name"] == "all_reduce/tp":
                assert any(s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] for s in steps)


def test_bad_profile_settings_are_refused_in_one_line():
    from hybrid.training import parse_args
    from hybrid.training.torch_profiler import check_settings

    cfg = parse_args(SMALL + ["--train-iters", "5", "--profile", "--profile-step-start", "4", "--profile-step-end",
                              "4", "--profile-ranks", "0", "5"])
    with pytest.raises(ConfigError) as raised:
        check_settings(cfg, world_size=4)
    text = str(raised.value)
    assert "\n" not in text and "3 config keys need changing" in text
    assert "[4, 4), which holds none" in text and "0 to 3" in text and "--tensorboard-dir" in text
