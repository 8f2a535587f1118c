"""``--train-data-path`` / ``--valid-data-path`` (Megatron's): each split reads only its own data, all of it,
and the settings that would contradict it are refused with one line."""

import numpy as np
import pytest

from hybrid.config import ConfigError
from hybrid.data import write_dataset
from hybrid.training.cli import parse_args, validate
from hybrid.training.data import build_data

SEQ = 16
MODEL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--vocab-size", "64", "--micro-batch-size", "2", "--train-iters", "5", "--eval-iters", "2"]


def _dataset(prefix, first: int, docs: int):
    """``docs`` documents of 12 tokens numbered from ``first``: every token tells its dataset."""
    tokens = np.arange(first, first + 12 * docs, dtype=np.int32)
    write_dataset(str(prefix), np.split(tokens, docs), dtype=np.int32)
    return set(tokens.tolist())


def test_each_split_reads_its_own_data(tmp_path):
    train_tokens = _dataset(tmp_path / "train", 0, 40)
    valid_tokens = _dataset(tmp_path / "valid", 100_000, 10)
    cfg = parse_args(MODEL + ["--train-data-path", str(tmp_path / "train"), "--valid-data-path",
                              str(tmp_path / "valid"), "--eval-interval", "5"])
    validate(cfg, world_size=1)
    data = build_data(cfg, SEQ, 64, train_samples=10, global_batch=2, eod_id=None, rank=0, barrier=lambda: None)
    assert len(data.train) >= 10 and len(data.valid) >= 4
    seen_train = set().union(*(data.train[i]["tokens"].tolist() for i in range(len(data.train))))
    seen_valid = set().union(*(data.valid[i]["tokens"].tolist() for i in range(len(data.valid))))
    assert seen_train <= train_tokens and seen_valid <= valid_tokens
    # all of each file is its split's: every document, none left to a division by --split
    assert (data.train.sequence_start, data.train.sequence_end) == (0, 40)
    assert (data.valid.sequence_start, data.valid.sequence_end) == (0, 10)
    assert data.train.tokens_per_epoch == 12 * 40


@pytest.mark.parametrize("argv,match", [
    (["--train-data-path", "T"], r"evaluation every 1000 steps \('eval\.interval'\) needs validation data: give "
                                 r"'data\.valid_path', or set 'eval\.interval' 0 \(set by --valid-data-path, "
                                 r"--eval-interval\)"),
    (["--valid-data-path", "V"], r"'data\.valid_path' goes with 'data\.train_path'"),
    (["--data-path", "D", "--train-data-path", "T", "--valid-data-path", "V"],
     r"give the data as 'data\.path' \(divided by 'data\.split'\) or as a path for each split"),
    (["--train-data-path", "T", "--valid-data-path", "V", "--split", "9,1,0"],
     r"'data\.split' '9,1,0' divides 'data\.path'; with a path for each split it divides nothing: remove it"),
    (["--mock-data", "--train-data-path", "T", "--eval-interval", "0"],
     r"'data\.mock' trains on random tokens and would ignore 'data\.train_path'"),
])
def test_contradicting_data_settings_are_refused(argv, match):
    with pytest.raises(ConfigError, match=match):
        validate(parse_args(MODEL + argv), world_size=1)


def test_a_missing_split_file_names_its_flag(tmp_path):
    _dataset(tmp_path / "train", 0, 4)
    cfg = parse_args(MODEL + ["--train-data-path", str(tmp_path / "train"), "--valid-data-path",
                              str(tmp_path / "nope"), "--eval-interval", "5"])
    with pytest.raises(ConfigError, match=r"'data\.valid_path': .*nope\.bin does not exist.*\(set by "
                                          r"--valid-data-path\)"):
        validate(cfg, world_size=1)


def test_reset_position_ids_restarts_the_positions_after_each_end_of_document(tmp_path):
    eod = 3
    docs = [np.array([5, 6, eod], dtype=np.int32), np.array([7, 8, 9, 10, eod], dtype=np.int32)] * 8
    write_dataset(str(tmp_path / "d"), docs, dtype=np.int32)
    argv = MODEL + ["--data-path", str(tmp_path / "d"), "--split", "1,0,0", "--eval-interval", "0"]
    for reset in (False, True):
        cfg = parse_args(argv + (["--reset-position-ids"] if reset else []))
        data = build_data(cfg, SEQ, 64, train_samples=2, global_batch=2, eod_id=eod, rank=0, barrier=lambda: None)
        sample = data.train[0]
        tokens, positions = sample["tokens"].tolist(), sample["position_ids"].tolist()
        if not reset:
            assert positions == list(range(SEQ))
            continue
        # each position counts from the token after the last end-of-document before it
        start = 0
        for i, (token, position) in enumerate(zip(tokens, positions)):
            assert position == i - start, (tokens, positions)
            if token == eod:
                start = i + 1
        assert eod in tokens[:-1] and positions != list(range(SEQ))


@pytest.mark.parametrize("argv,match", [
    (["--mock-data", "--reset-position-ids"], r"'data\.reset_position_ids' acts at end-of-document tokens, and "
                                              r"random tokens \('data\.mock'\) have none: remove it"),
    (["--data-path", "D", "--eod-mask-loss"], r"'data\.eod_mask_loss' needs the tokenizer's end-of-document id: "
                                              r"give the tokenizer the data was preprocessed with"),
])
def test_end_of_document_settings_need_a_tokenizer(argv, match):
    with pytest.raises(ConfigError, match=match):
        validate(parse_args(MODEL + ["--eval-interval", "0"] + argv), world_size=1)
