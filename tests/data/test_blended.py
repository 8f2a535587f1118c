"""Blending by weight, --data-path/--split parsing, and the train/valid/test builder."""

import numpy as np
import pytest

from hybrid.data.blended import (
    build_blending_indices,
    build_train_valid_test_datasets,
    parse_data_path,
    parse_split,
    split_ranges,
)
from hybrid.data.gpt_dataset import GPTDataset
from tests.data.testkit import unique_token_dataset

L = 8


def test_parse_data_path():
    assert parse_data_path(["corpus"]) == [(1.0, "corpus")]
    assert parse_data_path("0.3 A 0.7 B") == [(pytest.approx(0.3), "A"), (pytest.approx(0.7), "B")]
    assert parse_data_path(["3", "A", "1", "B"]) == [(0.75, "A"), (0.25, "B")]
    with pytest.raises(ValueError, match="weight/prefix pairs"):
        parse_data_path(["0.3", "A", "B"])
    with pytest.raises(ValueError, match="'A' should be the weight before prefix '0.5'"):
        parse_data_path(["A", "0.5"])
    with pytest.raises(ValueError, match="must be a positive number"):
        parse_data_path(["0", "A", "1", "B"])
    with pytest.raises(ValueError, match="empty"):
        parse_data_path([])


def test_parse_split():
    assert parse_split("949,50,1") == pytest.approx((0.949, 0.05, 0.001))
    assert parse_split("98/2") == pytest.approx((0.98, 0.02, 0.0))
    for bad in ("1,2,3,4", "a,b,c", "-1,2,0", "0,0,0"):
        with pytest.raises(ValueError, match="--split"):
            parse_split(bad)


def test_split_ranges_cover_all_documents():
    ranges = split_ranges(1000, parse_split("949,50,1"))
    assert ranges == [(0, 949), (949, 999), (999, 1000)]
    assert split_ranges(10, (1.0, 0.0, 0.0)) == [(0, 10), (10, 10), (10, 10)]


@pytest.mark.parametrize("weights", [(0.3, 0.7), (0.5, 0.2, 0.3), (0.05, 0.9, 0.05)])
def test_blending_ratios_follow_the_weights(weights):
    n = 20000
    owner, rank = build_blending_indices(weights, n)
    counts = np.bincount(owner, minlength=len(weights))
    assert counts.sum() == n
    np.testing.assert_allclose(counts / n, weights, atol=0.01)
    # Balanced at every prefix too, not just overall.
    for prefix in (10, 100, 1000):
        c = np.bincount(owner[:prefix], minlength=len(weights))
        assert np.all(np.abs(c - np.asarray(weights) * prefix) <= (len(weights) + 1) / 2)
    # Each dataset's samples are drawn in order 0, 1, 2, ...
    for d in range(len(weights)):
        assert rank[owner == d].tolist() == list(range(counts[d]))


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("blend")
    a, docs_a = unique_token_dataset(root / "a", num_docs=150, seed=1, max_len=20)
    b, docs_b = unique_token_dataset(root / "b", num_docs=100, seed=2, max_len=20)
    return root, a, b


def test_blended_train_valid_test(two_corpora):
    root, a, b = two_corpora
    train, valid, test = build_train_valid_test_datasets(
        ["0.3", a.prefix, "0.7", b.prefix], "90,10,0", L, (1000, 50, 0), seed=3, cache_dir=root / "cache")
    assert test is None and len(train) == 1000 and len(valid) == 50
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    np.testing.assert_allclose(counts / 1000, [0.3, 0.7], atol=0.01)
    # Components carry the split's documents, with a small surplus over weight x samples.
    comp_a, comp_b = train.datasets
    assert (comp_a.sequence_start, comp_a.sequence_end) == (0, 135)
    assert (comp_b.sequence_start, comp_b.sequence_end) == (0, 90)
    assert 300 < len(comp_a) <= 300 * 1.005 + 3 and 700 < len(comp_b) <= 700 * 1.005 + 3
    assert (valid.datasets[0].sequence_start, valid.datasets[0].sequence_end) == (135, 150)
    # Blend items are the component items.
    for i in (0, 1, 2, 500, 999):
        d, j = int(train.dataset_index[i]), int(train.dataset_sample_index[i])
        np.testing.assert_array_equal(train.sample_tokens(i), train.datasets[d].sample_tokens(j))
        assert train[i]["tokens"].tolist() == train.datasets[d][j]["tokens"].tolist()
    # Token values are unique per corpus file, so a valid sample never contains train tokens.
    train_tokens_a = set(np.concatenate([a[i] for i in range(135)]).tolist())
    for i in range(len(valid)):
        if int(valid.dataset_index[i]) == 0:
            assert not set(valid.sample_tokens(i).tolist()) & train_tokens_a


def test_single_prefix_gives_plain_gpt_datasets(two_corpora):
    root, a, _ = two_corpora
    train, valid, test = build_train_valid_test_datasets([a.prefix], "949,50,1", L, (100, 10, 0), seed=1,
                                                         cache_dir=root / "cache1")
    assert isinstance(train, GPTDataset) and isinstance(valid, GPTDataset) and test is None


def test_samples_requested_from_an_empty_split_is_an_error(two_corpora):
    root, a, _ = two_corpora
    with pytest.raises(ValueError, match="--split '100,0,0' gives valid no data"):
        build_train_valid_test_datasets([a.prefix], "100,0,0", L, (10, 10, 0), cache_dir=root / "c2")
