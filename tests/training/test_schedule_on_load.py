"""A resumed run whose schedule flags differ from the checkpoint's: refused by default, the configured settings
with ``--override-opt-param-scheduler``, the saved ones with ``--use-checkpoint-opt-param-scheduler`` (each also
in Megatron-LM's spelling, ``--override-opt_param-scheduler`` and ``--use-checkpoint-opt_param-scheduler``)."""

import math

import pytest

from hybrid.checkpoint import CheckpointReader

RUN = ["--mock-data", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
       "--vocab-size", "64", "--micro-batch-size", "1", "--global-batch-size", "2", "--eval-interval", "0",
       "--log-interval", "1", "--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style", "cosine",
       "--lr-warmup-iters", "1", "--start-weight-decay", "0.0", "--end-weight-decay", "0.1",
       "--weight-decay-incr-style", "linear"]


def _main(argv, monkeypatch, capsys):
    """``hybrid-train argv`` in this process, a world of one: (exit code, {iteration: lr}, stderr)."""
    from hybrid.training.trainer import main

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    lrs = {int(line.split("/")[0].split()[-1]): float(line.split("lr: ")[1].split(" ")[0])
           for line in out.out.splitlines() if line.startswith("iteration")}
    return code, lrs, out.err


def _wd_schedule(save_dir) -> dict:
    return CheckpointReader(save_dir).trainer_state["engine"]["wd_schedule"]


def _cosine(i: int, length: int) -> float:
    """The learning rate of step i (0-based) of RUN's schedule decaying over ``length`` steps."""
    if i < 1:
        return 0.0
    return 1e-3 + (1e-2 - 1e-3) * (1 + math.cos(math.pi * (i - 1) / (length - 1))) / 2


@pytest.mark.parametrize("spelling", ["--use-checkpoint-opt-param-scheduler", "--use-checkpoint-opt_param-scheduler",
                                      "--override-opt-param-scheduler", "--override-opt_param-scheduler"])
def test_a_longer_resumed_run_keeps_or_takes_the_schedule_as_told(tmp_path, monkeypatch, capsys, spelling):
    first, second = tmp_path / "first", tmp_path / "second"
    code, straight, err = _main(RUN + ["--train-iters", "4", "--save", first, "--save-interval", "2"], monkeypatch,
                                capsys)
    assert code == 0, err
    # the line prints the learning rate the step used, to 4 significant digits
    assert all(abs(straight[i] - _cosine(i - 1, 4)) <= 5e-4 * _cosine(i - 1, 4) for i in (2, 3, 4)), straight
    resume = RUN + ["--train-iters", "6", "--load", first / "iter_0000002", "--save", second]
    code, _, err = _main(resume, monkeypatch, capsys)
    assert code == 1 and "decay_iters: checkpoint 4 vs now 6" in err
    assert "--override-opt-param-scheduler keeps the new settings, --use-checkpoint-opt-param-scheduler takes " \
           "the saved ones" in err
    code, resumed, err = _main(resume + [spelling], monkeypatch, capsys)
    assert code == 0, err
    if "use-checkpoint" in spelling:
        # the saved schedule: steps 3 and 4 as the first run had them, then its end, min_lr
        assert [resumed[i] for i in (3, 4)] == [straight[i] for i in (3, 4)]
        assert resumed[5] == resumed[6] == 1e-3
        assert _wd_schedule(second) == _wd_schedule(first) and _wd_schedule(second)["length"] == 4
    else:
        # the configured one: decaying over 6 steps from the saved position
        assert all(abs(resumed[i] - _cosine(i - 1, 6)) <= 5e-4 * _cosine(i - 1, 6) for i in (3, 4, 5, 6))
        assert resumed[3] > straight[3]
        assert _wd_schedule(second)["length"] == 6


def test_keeping_and_taking_the_schedule_exclude_each_other():
    from hybrid.config import ConfigError
    from hybrid.training.cli import parse_args, validate

    argv = RUN + ["--train-iters", "4", "--load", "x", "--override-opt-param-scheduler",
                  "--use-checkpoint-opt-param-scheduler"]
    with pytest.raises(ConfigError, match=r"'checkpoint\.override_opt_param_scheduler' keeps the configured "
                                          r"schedule and 'checkpoint\.use_checkpoint_opt_param_scheduler' takes "
                                          r"the saved one: give one"):
        validate(parse_args(argv), world_size=1)
    assert parse_args(RUN + ["--train-iters", "4"]).checkpoint.schedule_on_load == "check"
