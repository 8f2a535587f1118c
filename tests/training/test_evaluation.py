"""Evaluation by the trainer: the validation split every ``--eval-interval`` steps and at the end of training,
the test split once at the end, and ``--skip-train`` runs that only evaluate a checkpoint.

The reference is the checkpoint exported to Hugging Face format and run by ``transformers``' GPT2LMHeadModel in
float64 over the same samples, which the test builds itself from the data files.
"""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hybrid.data import build_train_valid_test_datasets, write_dataset
from hybrid.training.cli import parse_args, validate
from hybrid.training.data import build_data
from tests.multiproc import run_distributed
from tests.numerics import gamma, transformer_bound

SEQ, VOCAB, DOCS = 16, 64, 100
SPLIT = "8,1,1"
SHAPE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--vocab-size", str(VOCAB)]
RUN = ["--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-iters", "1",
       "--log-interval", "100", "--eval-iters", "2", "--seed", "7"]
MODEL = SHAPE + RUN
TRAIN_ITERS, EVAL_INTERVAL = 4, 2


def _corpus(prefix) -> None:
    """DOCS documents of 10-30 tokens. The last tenth (the test share of SPLIT) draws from the upper half of the
    vocabulary, the rest from the lower half: a model trained on the training share scores the test split far
    worse than the validation split, so evaluating the wrong split cannot pass for the right one."""
    rng = np.random.default_rng(0)
    docs = []
    for d in range(DOCS):
        low = VOCAB // 2 if d >= DOCS * 9 // 10 else 0
        docs.append(rng.integers(low, low + VOCAB // 2, rng.integers(10, 31)).astype(np.int32))
    write_dataset(str(prefix), docs, dtype=np.int32)


def _run(argv):
    from hybrid.training import Trainer

    cfg = parse_args(argv)
    validate(cfg, world_size=int(os.environ["WORLD_SIZE"]))
    trainer = Trainer(cfg)
    trainer.train()
    return trainer.evaluations


def _train_then_evaluate(data, save, layout, eval_layout):
    common = RUN + ["--data-path", data, "--split", SPLIT, "--eval-interval", str(EVAL_INTERVAL)]
    trained = _run(SHAPE + common + layout + ["--train-iters", str(TRAIN_ITERS), "--save", save])
    before = sorted(os.listdir(save))
    # the model's settings from the checkpoint; --save is accepted and ignored: an evaluation run writes nothing
    evaluated = _run(common + eval_layout + ["--skip-train", "--load", save, "--use-checkpoint-args", "--save", save])
    return trained, evaluated, before, sorted(os.listdir(save))


def _reference(data, save, tmp_path):
    """(mean loss, largest micro-batch loss) of the exported checkpoint on the first --eval-iters global
    batches of each evaluated split, in float64."""
    from transformers import GPT2LMHeadModel

    from hybrid.convert.hf import export_to_hf

    export_to_hf(save, tmp_path / "hf")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", torch_dtype=torch.float64).eval()
    count = 2 * 4  # --eval-iters x --global-batch-size
    _, valid, test = build_train_valid_test_datasets(data, SPLIT, SEQ, (0, count, count), seed=7)
    out = {}
    for split, ds in (("valid", valid), ("test", test)):
        losses = []
        with torch.no_grad():
            for i in range(count):  # micro batch 1: one sample each
                sample = ds[i]
                logits = hf(sample["tokens"].unsqueeze(0)).logits[0]
                per_token = F.cross_entropy(logits, sample["labels"], reduction="none")
                mask = sample["loss_mask"].double()
                losses.append(float((per_token * mask).sum() / mask.sum()))
        out[split] = (sum(losses) / count, max(losses))
    return out


def _bound(largest: float) -> float:
    """The trainer's fp32 loss against the float64 one: the model's forward bound on each micro-batch's loss
    (tests/numerics.py), plus the means over 8 micro-batches, 2 DP ranks and 2 batches, in fp32."""
    from hybrid.training.model import model_config

    cfg = model_config(parse_args(MODEL + ["--mock-data", "--train-iters", "1"]), VOCAB)
    return (transformer_bound(cfg, SEQ, part="loss") + gamma(8 + 2 + 2)) * largest


def test_the_test_split_is_evaluated_at_the_end_and_skip_train_evaluates_a_checkpoint_as_it_was_trained(tmp_path):
    data, save = str(tmp_path / "corpus"), str(tmp_path / "ckpt")
    _corpus(data)
    # trained at TP 2 x DP 1, ZeRO-1; evaluated again at DP 2, ZeRO-3 (the weights partitioned over DP), the
    # model's shape read from the checkpoint (--use-checkpoint-args)
    results = run_distributed(_train_then_evaluate, 2, data, save,
                              ["--tensor-model-parallel-size", "2", "--zero-stage", "1"], ["--zero-stage", "3"],
                              timeout=240)
    trained, evaluated, before, after = results[0]
    assert all(r[:2] == results[0][:2] for r in results)  # every rank reports the same losses
    # validation every 2 steps, the last one not repeated at the end; the test split once, at the end
    assert [(s, it) for s, it, _ in trained] == [("valid", 2), ("valid", 4), ("test", 4)]
    # --skip-train: both splits, at the checkpoint's iteration; nothing saved
    assert [(s, it) for s, it, _ in evaluated] == [("valid", 4), ("test", 4)]
    assert after == before
    ref = _reference(data, save, tmp_path)
    final = {s: loss for s, it, loss in trained if it == TRAIN_ITERS}
    for split, (want, largest) in ref.items():
        for got in (final[split], dict((s, loss) for s, _, loss in evaluated)[split]):
            assert abs(got - want) <= _bound(largest), (split, got, want)
    # the data make the splits tell apart: trained on the lower half of the vocabulary, the model finds the
    # upper half's test documents far less likely
    assert ref["test"][0] > ref["valid"][0] + 0.1


def _cfg(*argv):
    cfg = parse_args(MODEL + ["--train-iters", "5", *argv])
    validate(cfg, world_size=1)
    return cfg


def _build(cfg, global_batch=4):
    return build_data(cfg, SEQ, VOCAB, train_samples=20, global_batch=global_batch, eod_id=None, rank=0,
                      barrier=lambda: None)


def test_test_data_of_its_own_is_read_whole(tmp_path):
    for name in ("train", "valid", "test"):
        _corpus(tmp_path / name)
    cfg = _cfg("--train-data-path", str(tmp_path / "train"), "--valid-data-path", str(tmp_path / "valid"),
               "--test-data-path", str(tmp_path / "test"), "--eval-interval", "5")
    data = _build(cfg)
    assert (data.test.sequence_start, data.test.sequence_end) == (0, DOCS)
    assert len(data.test) == 2 * 4 and data.test_skipped is None
    # without --test-data-path there is no test split
    cfg = _cfg("--train-data-path", str(tmp_path / "train"), "--valid-data-path", str(tmp_path / "valid"),
               "--eval-interval", "5")
    assert _build(cfg).test is None


def test_a_test_share_too_small_for_one_sample_is_skipped_with_the_reason(tmp_path):
    _corpus(tmp_path / "corpus")
    # 100 documents: the default split's test share (1 in 1000) is empty
    data = _build(_cfg("--data-path", str(tmp_path / "corpus"), "--eval-interval", "5"))
    assert data.test is None and data.valid is not None
    assert data.test_skipped.startswith(f"the test split of {tmp_path / 'corpus'} (sequences 100..100) has 0 "
                                        f"tokens, fewer than seq_length + 1 = {SEQ + 1}")
    # a test share of 0 asks for no test evaluation: nothing to say
    data = _build(_cfg("--data-path", str(tmp_path / "corpus"), "--split", "9,1,0", "--eval-interval", "5"))
    assert data.test is None and data.test_skipped is None


@pytest.mark.parametrize("argv,valid,test", [
    (["--eval-iters", "0"], False, False),  # Megatron's way to turn every evaluation off
    (["--eval-interval", "0"], False, True),  # no validation; the test split is still evaluated at the end
    (["--mock-data"], True, False),  # random tokens have no test split
])
def test_which_splits_are_built(tmp_path, argv, valid, test):
    _corpus(tmp_path / "corpus")
    source = [] if "--mock-data" in argv else ["--data-path", str(tmp_path / "corpus"), "--split", SPLIT]
    data = _build(_cfg(*source, "--eval-interval", "5", *argv))
    assert (data.valid is not None, data.test is not None) == (valid, test)


def test_test_data_path_goes_with_train_data_path():
    from hybrid.config import ConfigError

    with pytest.raises(ConfigError, match=r"'data\.test_path' goes with 'data\.train_path' \(a path for each "
                                          r"split\); give the training data too"):
        _cfg("--test-data-path", "T")


def test_skip_train_needs_no_run_length():
    from hybrid.config import ConfigError

    cfg = parse_args(MODEL + ["--mock-data", "--skip-train"])
    validate(cfg, world_size=1)
    assert cfg.run.skip_train and cfg.run.train_iters is None
    with pytest.raises(ConfigError, match=r"give the run's length"):
        validate(parse_args(MODEL + ["--mock-data"]), world_size=1)


def _main(argv, monkeypatch, capsys):
    """``hybrid-train argv`` in this process, a world of one: (exit code, stdout, stderr)."""
    from hybrid.training.trainer import main

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_skip_train_without_a_checkpoint_evaluates_the_initial_weights_and_an_empty_load_is_refused(
        tmp_path, monkeypatch, capsys):
    argv = MODEL + ["--mock-data", "--eval-interval", "5", "--skip-train"]
    code, out, _ = _main(argv, monkeypatch, capsys)
    assert code == 0
    lines = out.splitlines()
    assert any(line.startswith("evaluating 2-layer GPT on world=1") and "at iteration 0 (--skip-train" in line
               for line in lines), out
    valid = [line for line in lines if line.startswith("validation at iteration 0 |")]
    # untrained: about ln(vocab)
    assert len(valid) == 1 and abs(float(valid[0].split("lm loss:")[1].split("|")[0]) - np.log(VOCAB)) < 0.5
    assert not any(line.startswith(("iteration", "test at")) for line in lines)
    # a --load that holds nothing would evaluate fresh weights in place of the checkpoint's: refused
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = _main(argv + ["--load", str(empty)], monkeypatch, capsys)
    assert code == 1 and "validation at" not in out
    assert err.strip() == (f"hybrid-train: error: --load {empty}: {empty} holds no checkpoint for --skip-train to "
                           f"evaluate; give a checkpoint's directory, or no --load to evaluate the initial weights")
    # Megatron-LM's --exit-on-missing-checkpoint refuses it for a training run too (without it: a fresh start)
    train = MODEL + ["--mock-data", "--eval-interval", "0", "--train-iters", "1", "--load", str(empty)]
    code, out, err = _main(train + ["--exit-on-missing-checkpoint"], monkeypatch, capsys)
    assert code == 1 and not any(line.startswith("iteration") for line in out.splitlines())
    assert err.strip() == (f"hybrid-train: error: --load {empty}: {empty} holds no checkpoint "
                           f"(--exit-on-missing-checkpoint); give a checkpoint's directory, or leave the flag out to "
                           f"start from scratch")
    code, out, _ = _main(train, monkeypatch, capsys)
    assert code == 0 and "no checkpoint there yet, starting from scratch" in out


LEGACY = Path(__file__).resolve().parents[1] / "fixtures" / "legacy_checkpoint" / "zero1"  # flat trainer args


def test_use_checkpoint_args_takes_the_model_settings_no_flag_gives():
    cfg = parse_args(["--use-checkpoint-args", "--load", str(LEGACY), "--mock-data", "--micro-batch-size", "1",
                      "--train-iters", "1", "--seq-length", "8", "--hidden-dropout", "0.2"])
    m = cfg.model
    # stored by an earlier release as flat arguments: num_layers 1, hidden 32, 4 heads, sequence 16, vocabulary 128
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.vocab_size) == (1, 32, 4, 128)
    assert m.seq_length == 8 and m.hidden_dropout == 0.2  # given as flags: theirs
    validate(cfg, world_size=1)
    # how the model was computed (here sequence parallelism, for TP 2) is not the model: not taken
    from hybrid.training.cli import checkpoint_model_settings

    taken = checkpoint_model_settings(cfg)
    assert taken["model.num_layers"] == 1 and "model.sequence_parallel" not in taken


def test_skip_train_with_use_checkpoint_args_evaluates_a_checkpoint_from_its_directory_alone(
        monkeypatch, capsys):
    # saved at TP 2 by an earlier release; evaluated in one process
    code, out, err = _main(["--use-checkpoint-args", "--load", str(LEGACY), "--skip-train", "--mock-data",
                            "--micro-batch-size", "1", "--global-batch-size", "4", "--eval-interval", "5",
                            "--eval-iters", "1"], monkeypatch, capsys)
    assert code == 0, err
    assert "weights only (--skip-train)" in out
    valid = [line for line in out.splitlines() if line.startswith("validation at iteration 3 |")]
    assert len(valid) == 1, out


@pytest.mark.parametrize("load,match", [
    (None, r"'checkpoint\.use_checkpoint_args' reads the model settings from the checkpoint loaded; it needs "
           r"'checkpoint\.load'"),
    ("empty", r"'checkpoint\.use_checkpoint_args': 'checkpoint\.load' .*empty holds no checkpoint to read the "
              r"model settings from \(set by --use-checkpoint-args, --load\)"),
])
def test_use_checkpoint_args_without_a_checkpoint_is_refused(tmp_path, load, match):
    from hybrid.config import ConfigError

    argv = ["--use-checkpoint-args", "--mock-data", "--micro-batch-size", "1", "--train-iters", "1"] + SHAPE
    if load is not None:
        (tmp_path / load).mkdir()
        argv += ["--load", str(tmp_path / load)]
    with pytest.raises(ConfigError, match=match):
        validate(parse_args(argv), world_size=1)
