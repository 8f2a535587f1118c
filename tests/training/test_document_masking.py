"""Packed documents in the trainer (issue 50, items 5 and 7): ``--reset-attention-mask`` gives each micro-batch
``document_ids`` by Megatron's end-of-document rule, ``--reset-position-ids`` restarts the positions at the same
tokens, and the model then keeps the documents apart."""

import types

import numpy as np
import pytest
import torch

from hybrid.config import ConfigError
from hybrid.data import write_dataset
from hybrid.training.cli import parse_args, validate
from hybrid.training.data import build_data, packed_document_ids

EOD, SEQ, VOCAB = 3, 16, 64
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--group-query-attention", "--position-embedding-type", "rope", "--seq-length", str(SEQ),
         "--vocab-size", str(VOCAB), "--micro-batch-size", "2", "--train-iters", "5", "--eval-interval", "0"]


def _megatron_document_ids(tokens: list) -> list:
    """Megatron's get_ltor_masks_and_position_ids, as a loop: after the end-of-document token at i, tokens
    i + 1 onwards belong to the next document; the end-of-document token to the one it ends."""
    ids, doc = [], 0
    for token in tokens:
        ids.append(doc)
        if token == EOD:
            doc += 1
    return ids


def test_a_token_after_an_end_of_document_starts_the_next_document():
    rows = [[5, 6, EOD, 7, EOD, EOD, 8, 9], [EOD, 1, 2, 3 + 1, 5, 6, 7, EOD], [9] * 8]
    got = packed_document_ids(torch.tensor(rows), EOD)
    assert got.dtype == torch.int64
    assert got.tolist() == [_megatron_document_ids(r) for r in rows]
    assert got.tolist()[0] == [0, 0, 0, 1, 1, 2, 3, 3]  # an EOD alone is a document of length 1


def _packed(tmp_path, reset_positions: bool, reset_mask: bool = True):
    docs = [np.array([5, 6, EOD], dtype=np.int32), np.array([7, 8, 9, 10, 11, EOD], dtype=np.int32),
            np.array([12, EOD], dtype=np.int32)] * 6
    write_dataset(str(tmp_path / "d"), docs, dtype=np.int32)
    argv = MODEL + ["--data-path", str(tmp_path / "d"), "--split", "1,0,0"]
    argv += ["--reset-position-ids"] * reset_positions + ["--reset-attention-mask"] * reset_mask
    return parse_args(argv)


def test_the_positions_restart_where_the_documents_change(tmp_path):
    cfg = _packed(tmp_path, reset_positions=True)
    assert cfg.data.reset_attention_mask and cfg.data.reset_position_ids
    data = build_data(cfg, SEQ, VOCAB, train_samples=4, global_batch=2, eod_id=EOD, rank=0, barrier=lambda: None)
    for i in range(4):
        sample = data.train[i]
        ids = packed_document_ids(sample["tokens"], EOD).tolist()
        positions = sample["position_ids"].tolist()
        assert len(set(ids)) > 1
        # a position is the distance to its document's first token
        assert positions == [j - ids.index(doc) for j, doc in enumerate(ids)], (ids, positions)


def _trainer_inputs(cfg, micro_batches):
    """The trainer's own per-micro-batch model inputs (Trainer._model_inputs) without building a whole run."""
    from hybrid.training.trainer import Trainer

    owner = types.SimpleNamespace(topology=types.SimpleNamespace(device=torch.device("cpu")), config=cfg,
                                  tokenizer=types.SimpleNamespace(eod_id=EOD))
    return Trainer._model_inputs(owner, micro_batches)


def test_the_trainer_keeps_the_packed_documents_apart(tmp_path):
    """Acceptance (without context parallelism): through the trainer's inputs, changing every token of the first
    document changes no logit of the others; without --reset-attention-mask the inputs carry no document ids
    and the later documents' logits move."""
    from hybrid import Topology
    from hybrid.training.model import model_config
    from model_zoo import GPTModel

    cfg = _packed(tmp_path, reset_positions=True)
    data = build_data(cfg, SEQ, VOCAB, train_samples=2, global_batch=2, eod_id=EOD, rank=0, barrier=lambda: None)
    batch = torch.utils.data.default_collate([data.train[0], data.train[1]])
    tokens = batch["tokens"]
    first_end = int((tokens[0] == EOD).nonzero()[0]) + 1  # sample 0's first document, its EOD included
    changed = {**batch, "tokens": tokens.clone()}
    changed["tokens"][0, :first_end] = (tokens[0, :first_end] + 17) % VOCAB  # never EOD: 3 - 17 is no token
    assert not (changed["tokens"][0, :first_end] == EOD).any()
    changed["tokens"][0, first_end - 1] = EOD  # the document still ends where it did

    torch.manual_seed(0)
    model = GPTModel(model_config(cfg, VOCAB).validate(1), Topology.local()).eval()

    def logits(c, mb):
        (inputs,) = _trainer_inputs(c, [mb])
        inputs.pop("labels"), inputs.pop("loss_mask")
        with torch.no_grad():
            return model(**inputs), inputs

    a, inputs = logits(cfg, batch)
    b, _ = logits(cfg, changed)
    assert inputs["document_ids"].tolist() == [_megatron_document_ids(r) for r in tokens.tolist()]
    assert torch.equal(a[0, first_end:], b[0, first_end:]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0, :first_end], b[0, :first_end])

    plain = _packed(tmp_path, reset_positions=True, reset_mask=False)
    a, inputs = logits(plain, batch)
    b, _ = logits(plain, changed)
    assert "document_ids" not in inputs and not torch.allclose(a[0, first_end:], b[0, first_end:])


@pytest.mark.parametrize("argv,match", [
    (["--mock-data", "--reset-attention-mask"], r"'data\.reset_attention_mask' acts at end-of-document tokens, "
                                                r"and random tokens \('data\.mock'\) have none: remove it"),
    (["--data-path", "D", "--reset-attention-mask"], r"'data\.reset_attention_mask' needs the tokenizer's "
                                                     r"end-of-document id"),
])
def test_reset_attention_mask_needs_end_of_document_tokens(argv, match):
    with pytest.raises(ConfigError, match=match):
        validate(parse_args(MODEL + argv), world_size=1)


def test_the_ranks_of_a_context_parallel_group_read_the_same_samples():
    """Item 7: the trainer's sampler slices each global batch by the dp coordinate (Topology.dp_rank is
    Grid.coord_of(rank).dp), and the cp ranks of a group differ only in their cp coordinate, so each reads the
    whole of the same samples (and keeps its chunks of them)."""
    from hybrid.data import GlobalBatchSampler
    from hybrid.grid import Grid

    grid = Grid(tp=2, dp=2, pp=1, cp=2)
    reads = {}
    for rank in range(grid.world_size):
        coord = grid.coord_of(rank)
        sampler = GlobalBatchSampler(64, 0, 2, 8, coord.dp, grid.dp)
        reads.setdefault((coord.tp, coord.dp, coord.pp), []).append(list(sampler))
    assert len(reads) == 4
    for group in reads.values():  # the two cp ranks of each (tp, dp, pp)
        assert len(group) == 2 and group[0] == group[1]
    dp0, dp1 = reads[(0, 0, 0)][0], reads[(0, 1, 0)][0]
    assert dp0 != dp1  # while data-parallel ranks read different samples
