"""GPT samples: windows, determinism, epoch coverage, item fields, and the index cache."""

import json
import os
import threading

import numpy as np
import pytest
import torch

from hybrid.data.gpt_dataset import GPTDataset, build_gpt_indices, make_sample
from tests.data.testkit import unique_token_dataset

L = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return unique_token_dataset(tmp_path_factory.mktemp("gpt") / "u", num_docs=200, seed=1)


def _reference_samples(docs, doc_order_rows, seq_length):
    """Plain-Python windows: epoch by epoch, concatenate documents in order and slice."""
    out = []
    for order in doc_order_rows:
        stream = np.concatenate([docs[i] for i in order])
        per_epoch = (stream.size - 1) // seq_length
        out += [stream[j * seq_length : (j + 1) * seq_length + 1] for j in range(per_epoch)]
    return out


def test_samples_match_a_plain_reference(corpus):
    ds_idx, docs = corpus
    ds = GPTDataset(ds_idx, L, num_samples=700, seed=3, use_cache=False)
    rows = np.asarray(ds.doc_index).reshape(ds.num_epochs, len(docs))
    for row in rows:
        assert sorted(row.tolist()) == list(range(len(docs)))  # each epoch is a permutation
    ref = _reference_samples(docs, rows, L)
    for i in range(len(ds)):
        np.testing.assert_array_equal(ds.sample_tokens(i), ref[int(ds.shuffle_index[i])])


def test_same_seed_same_samples_different_seed_different(corpus, tmp_path):
    ds_idx, _ = corpus
    a = GPTDataset(ds_idx, L, 300, seed=11, cache_dir=tmp_path / "a")
    b = GPTDataset(ds_idx, L, 300, seed=11, cache_dir=tmp_path / "b")
    c = GPTDataset(ds_idx, L, 300, seed=12, cache_dir=tmp_path / "c")
    sa = np.stack([a.sample_tokens(i) for i in range(300)])
    sb = np.stack([b.sample_tokens(i) for i in range(300)])
    sc = np.stack([c.sample_tokens(i) for i in range(300)])
    np.testing.assert_array_equal(sa, sb)
    assert (sa != sc).any(axis=1).mean() > 0.9


def test_every_token_is_used_before_the_next_epoch(corpus):
    ds_idx, docs = corpus
    total = sum(len(d) for d in docs)
    ds = GPTDataset(ds_idx, L, num_samples=None, seed=5, use_cache=False)
    S = ds.samples_per_epoch
    ds = GPTDataset(ds_idx, L, num_samples=3 * S + 5, seed=5, use_cache=False)
    assert ds.num_epochs == 4
    for epoch in range(3):
        seen = np.concatenate([ds.sample_tokens(i)[:L] for i in range(epoch * S, (epoch + 1) * S)])
        assert all(ds.epoch_of(i) == epoch for i in range(epoch * S, (epoch + 1) * S))
        # Token values are their corpus positions: each is used at most once within the epoch,
        # and only the short tail of the epoch's stream (< seq_length + 1 tokens) is left out.
        assert np.unique(seen).size == seen.size == S * L
        assert total - seen.size <= L
    first, second = ds.sample_tokens(0), ds.sample_tokens(S)
    assert not np.array_equal(first, second)


def test_more_samples_keep_the_earlier_epochs(corpus):
    ds_idx, _ = corpus
    small = build_gpt_indices(ds_idx.sequence_lengths, L, 250, seed=2)
    large = build_gpt_indices(ds_idx.sequence_lengths, L, 1000, seed=2)
    n = small["doc_index"].size
    np.testing.assert_array_equal(small["doc_index"], large["doc_index"][:n])
    np.testing.assert_array_equal(small["sample_index"], large["sample_index"][: small["sample_index"].shape[0]])
    np.testing.assert_array_equal(small["shuffle_index"], large["shuffle_index"][:250])


def test_sequence_range_restricts_documents(corpus):
    ds_idx, docs = corpus
    ds = GPTDataset(ds_idx, L, None, seed=1, sequence_range=(50, 80), use_cache=False)
    allowed = set(np.concatenate(docs[50:80]).tolist())
    seen = np.concatenate([ds.sample_tokens(i) for i in range(len(ds))])
    assert set(seen.tolist()) <= allowed


def test_item_fields_with_eod(tmp_path):
    eod = 60000
    ds_idx, _ = unique_token_dataset(tmp_path / "e", num_docs=40, seed=2, max_len=6, eod=eod)
    ds = GPTDataset(ds_idx, L, 20, seed=0, eod_id=eod, eod_mask_loss=True, reset_position_ids=True,
                    use_cache=False)
    for i in range(len(ds)):
        raw = ds.sample_tokens(i)
        item = ds[i]
        assert item["tokens"].dtype == torch.int64 and item["tokens"].shape == (L,)
        assert torch.equal(item["tokens"], torch.from_numpy(raw[:-1]))
        assert torch.equal(item["labels"], torch.from_numpy(raw[1:]))
        assert torch.equal(item["loss_mask"], torch.from_numpy((raw[:-1] != eod).astype(np.float32)))
        pos, expected = 0, []
        for t in raw[:-1]:
            expected.append(pos)
            pos = 0 if t == eod else pos + 1
        assert item["position_ids"].tolist() == expected
    plain = make_sample(np.array([1, eod, 2, 3]), eod, eod_mask_loss=False, reset_position_ids=False)
    assert plain["loss_mask"].tolist() == [1, 1, 1] and plain["position_ids"].tolist() == [0, 1, 2]


def test_split_too_small_is_a_clear_error(corpus):
    ds_idx, _ = corpus
    with pytest.raises(ValueError, match="fewer than seq_length \\+ 1 = 17.*--seq-length"):
        GPTDataset(ds_idx, L, 10, sequence_range=(0, 0), split_name="valid", use_cache=False)
    with pytest.raises(ValueError, match="need eod_id"):
        GPTDataset(ds_idx, L, 10, eod_mask_loss=True, use_cache=False)


def test_cache_is_built_once_and_reused(corpus, tmp_path):
    ds_idx, _ = corpus
    cache = tmp_path / "cache"
    a = GPTDataset(ds_idx, L, 123, seed=9, cache_dir=cache)
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and not [f for f in files if f.endswith(".tmp")]
    marker = next(f for f in files if f.endswith("-description.json"))
    desc = json.loads((cache / marker).read_text())
    assert (desc["seq_length"], desc["num_samples"], desc["seed"], desc["split"]) == (L, 123, 9, "train")
    mtimes = {f: os.stat(cache / f).st_mtime_ns for f in files}
    b = GPTDataset(ds_idx, L, 123, seed=9, cache_dir=cache)
    assert {f: os.stat(cache / f).st_mtime_ns for f in files} == mtimes  # loaded, not rebuilt
    assert isinstance(b.shuffle_index.base, np.memmap)  # read from the file, not rebuilt in memory
    np.testing.assert_array_equal(a.shuffle_index, b.shuffle_index)
    GPTDataset(ds_idx, L, 124, seed=9, cache_dir=cache)  # another key, other files
    assert len(os.listdir(cache)) == 8


def test_rank0_builds_while_other_ranks_wait(corpus, tmp_path, monkeypatch):
    import hybrid.data.gpt_dataset as gpt

    ds_idx, _ = corpus
    cache = tmp_path / "shared"
    world = 3
    barrier = threading.Barrier(world, timeout=30)
    builds, results, errors = [], {}, []
    real_build = gpt.build_gpt_indices

    def counting_build(*args, **kwargs):
        builds.append(threading.current_thread().name)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(gpt, "build_gpt_indices", counting_build)

    def rank_main(rank):
        try:
            ds = GPTDataset(ds_idx, L, 77, seed=4, cache_dir=cache, rank=rank, barrier=barrier.wait)
            results[rank] = np.array(ds.shuffle_index)
        except Exception as e:  # reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert builds == ["rank0"]  # one build, by rank 0; the others only read the files
    assert all(np.array_equal(results[0], results[r]) for r in range(world))
    assert len(os.listdir(cache)) == 4


def test_other_rank_without_shared_cache_gets_a_clear_error(corpus, tmp_path):
    ds_idx, _ = corpus
    with pytest.raises(FileNotFoundError, match="shared by all ranks"):
        GPTDataset(ds_idx, L, 50, cache_dir=tmp_path / "empty", rank=1, barrier=lambda: None)


def _build_under_torch_distributed(prefix, cache_dir):
    import hybrid.data.gpt_dataset as gpt

    calls = []
    real_build = gpt.build_gpt_indices
    gpt.build_gpt_indices = lambda *a, **k: calls.append(1) or real_build(*a, **k)
    ds = gpt.GPTDataset(prefix, L, 64, seed=8, cache_dir=cache_dir)  # rank and barrier from torch.distributed
    return len(calls), np.array(ds.shuffle_index).tolist(), ds.sample_tokens(5).tolist()


def test_default_rank_and_barrier_come_from_torch_distributed(corpus, tmp_path):
    from tests.multiproc import run_distributed

    ds_idx, _ = corpus
    results = run_distributed(_build_under_torch_distributed, 2, ds_idx.prefix, str(tmp_path / "c"), timeout=120)
    assert [calls for calls, _, _ in results] == [1, 0]
    assert results[0][1:] == results[1][1:]


def test_pickles_without_copying_the_tokens(corpus):
    import pickle

    ds_idx, _ = corpus
    ds = GPTDataset(ds_idx, L, 100, seed=1, use_cache=False)
    blob = pickle.dumps(ds)
    index_bytes = ds.doc_index.nbytes + ds.sample_index.nbytes + ds.shuffle_index.nbytes
    assert len(blob) < index_bytes + 4096  # the .bin is reopened by prefix, not serialized
    clone = pickle.loads(blob)
    assert all(np.array_equal(clone.sample_tokens(i), ds.sample_tokens(i)) for i in range(len(ds)))


def test_rewritten_data_does_not_reuse_stale_indices(tmp_path):
    from hybrid.data.indexed import write_dataset

    cache = tmp_path / "cache"
    lengths = np.random.default_rng(0).integers(1, 40, size=60)
    for order in (lengths, lengths[::-1]):  # same path, document count and token count; other lengths
        docs = np.split(np.arange(int(lengths.sum())), np.cumsum(order)[:-1])
        ds = GPTDataset(write_dataset(tmp_path / "d", docs), L, 40, seed=0, cache_dir=cache)
        rows = np.asarray(ds.doc_index).reshape(ds.num_epochs, len(docs))
        ref = _reference_samples(docs, rows, L)
        assert all(np.array_equal(ds.sample_tokens(i), ref[int(ds.shuffle_index[i])]) for i in range(40))
    assert len(os.listdir(cache)) == 8  # two keys
