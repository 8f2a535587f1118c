"""The trainer's data: datasets for the train, valid and test splits.

Sample order is a function of (seed, global sample index) only, and DP rank r
reads its slice of each global batch, so the batches a run sees do not depend
on its layout and a resumed run continues from ``consumed_samples`` exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from hybrid.config import HybridConfig
from hybrid.data import SplitTooSmallError, build_train_valid_test_datasets, parse_split
from hybrid.data.gpt_dataset import document_ids


def packed_document_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """The document of each input token, int64 of ``tokens``' shape (``[b, s]`` or ``[s]``), numbered from 0 in
    each sample (:func:`hybrid.data.gpt_dataset.document_ids`: the rule ``--reset-position-ids`` restarts positions
    by too). Read by :func:`model_zoo.document_attention.document_attention`."""
    return document_ids(tokens == eod_id)


class MockDataset(torch.utils.data.Dataset):
    """Random tokens, each sample drawn from a generator seeded by (seed, index): for benchmarks and smoke tests."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict:
        rng = np.random.default_rng([self.seed, idx])
        tokens = torch.from_numpy(rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64))
        return {"tokens": tokens[:-1], "labels": tokens[1:],
                "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
                "position_ids": torch.arange(self.seq_length, dtype=torch.int64)}


@dataclasses.dataclass
class TrainData:
    """The run's datasets; ``None`` where the run reads none of that split."""

    train: Optional[torch.utils.data.Dataset]  # None with run.skip_train
    valid: Optional[torch.utils.data.Dataset]
    test: Optional[torch.utils.data.Dataset]
    # why a test share of the data is not evaluated (it holds too few tokens for one sample), for a note
    test_skipped: Optional[str] = None


def build_data(config: HybridConfig, seq_length: int, vocab_size: int, train_samples: int, global_batch: int,
               eod_id: Optional[int], rank: int, barrier) -> TrainData:
    """Datasets sized for the whole run: ``train_samples`` training samples (every global batch of the run; 0
    builds none), and for each evaluated split ``eval.iters`` batches of ``global_batch`` (each evaluation
    reads the same ones).

    Validation data is read when the run validates (``eval.validates``); test data when the data has a test
    share (``data.split``'s third part, or ``data.test_path``). Random tokens (``data.mock``) have no test split.
    """
    evaluation, data, seed = config.eval, config.data, config.seed
    eval_samples = evaluation.iters * global_batch
    valid_samples = eval_samples if evaluation.validates else 0
    if data.mock:
        def mock(samples: int, offset: int):
            return MockDataset(samples, seq_length, vocab_size, seed + offset) if samples else None
        return TrainData(mock(train_samples, 0), mock(valid_samples, 1), None)

    def datasets(paths, split: str, counts):
        return build_train_valid_test_datasets(
            paths, split, seq_length, counts, seed=seed, cache_dir=data.cache_path, eod_id=eod_id,
            eod_mask_loss=data.eod_mask_loss, reset_position_ids=data.reset_position_ids, rank=rank,
            barrier=barrier)

    if data.train_path:  # a path for each split: all of its documents are that split's
        train = datasets(data.train_path, "1,0,0", (train_samples, 0, 0))[0]
        valid = datasets(data.valid_path, "0,1,0", (0, valid_samples, 0))[1] if valid_samples else None
        test_paths, test_split = data.test_path, "0,0,1"
    else:
        train, valid, _ = datasets(data.path, data.split, (train_samples, valid_samples, 0))
        test_paths, test_split = data.path, data.split
    if not (test_paths and eval_samples and parse_split(test_split)[2] > 0):
        return TrainData(train, valid, None)
    try:
        return TrainData(train, valid, datasets(test_paths, test_split, (0, 0, eval_samples))[2])
    except SplitTooSmallError as e:  # every rank reads the same data, so every rank skips alike
        return TrainData(train, valid, None, test_skipped=str(e))
