"""Blending several datasets by weight, train/valid/test splits, and the one-call builder.

``--data-path 0.3 A 0.7 B`` draws 30% of the samples from ``A`` and 70% from
``B``; ``--data-path A`` uses ``A`` alone. ``--split 949,50,1`` gives each
prefix's first 94.9% of documents to train, the next 5% to valid, the rest to
test (weights are normalized; fewer than three fill with 0).

Blending order: dataset ``d``'s ``k``-th sample is due at time ``(k + 0.5) /
w_d``; samples are taken in order of due time (ties by dataset order). After
any ``N`` draws each dataset has contributed ``w_d * N`` samples to within
``(D + 1) / 2`` samples (``D`` datasets; within 1.5 for two), and the order is computed with one vectorized sort. Each component is
built with a small surplus of samples over ``w_d * N``.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import numpy as np
import torch

from .errors import DataError
from .gpt_dataset import GPTDataset, default_cache_dir
from .index_cache import fallback_dirs, load_or_build
from .indexed import IndexedDataset, strip_extension

SPLIT_NAMES = ("train", "valid", "test")
DEFAULT_SURPLUS = 0.005


def parse_data_path(data_path: Sequence[str] | str) -> list[tuple[float, str]]:
    """``["0.3", "A", "0.7", "B"]`` or ``["A"]`` -> [(weight, prefix)], weights summing to 1.

    A prefix given with its file's extension (``A.bin``, ``A.idx``) means ``A``.
    """
    items = data_path.split() if isinstance(data_path, str) else [str(x) for x in data_path]
    if not items:
        raise DataError("--data-path is empty; give a prefix, or weight/prefix pairs like '0.3 A 0.7 B'")
    if len(items) == 1:
        return [(1.0, strip_extension(items[0]))]
    if len(items) % 2:
        raise DataError(
            f"--data-path {' '.join(items)!r}: with several datasets give weight/prefix pairs, "
            f"e.g. '0.3 A 0.7 B' (got {len(items)} items)"
        )
    pairs = []
    for weight, prefix in zip(items[0::2], items[1::2]):
        try:
            w = float(weight)
        except ValueError:
            raise DataError(f"--data-path: {weight!r} should be the weight before prefix {prefix!r}") from None
        if not (w > 0 and math.isfinite(w)):
            raise DataError(f"--data-path: weight {weight} of {prefix!r} must be a positive number")
        pairs.append((w, strip_extension(prefix)))
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


def parse_split(split: str) -> tuple[float, float, float]:
    """``"949,50,1"`` (or ``"98/2/0"``) -> normalized (train, valid, test) fractions."""
    parts = [p for p in split.replace("/", ",").split(",") if p.strip()]
    if not 1 <= len(parts) <= 3:
        raise DataError(f"--split {split!r}: expected up to three weights such as '949,50,1'")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise DataError(f"--split {split!r}: weights must be numbers, e.g. '949,50,1'") from None
    if any(v < 0 or not math.isfinite(v) for v in values) or sum(values) <= 0:
        raise DataError(f"--split {split!r}: weights must be non-negative with a positive sum")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return tuple(v / total for v in values)


def split_ranges(num_documents: int, fractions: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous document ranges, one per fraction, covering ``[0, num_documents)``."""
    bounds = [0]
    for f in np.cumsum(fractions)[:-1]:
        bounds.append(min(num_documents, int(round(f * num_documents))))
    bounds.append(num_documents)
    return list(zip(bounds[:-1], bounds[1:]))


def build_blending_indices(weights: Sequence[float], num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset id int16 [N], sample index within that dataset int64 [N]) for ``N`` draws."""
    w = np.asarray(weights, dtype=np.float64)
    counts = [int(math.ceil(wd * num_samples)) + blend_slack(w.size) for wd in w]
    due = np.concatenate([(np.arange(c, dtype=np.float64) + 0.5) / wd for c, wd in zip(counts, w)])
    owner = np.repeat(np.arange(w.size, dtype=np.int16), counts)
    rank = np.concatenate([np.arange(c, dtype=np.int64) for c in counts])
    order = np.argsort(due, kind="stable")[:num_samples]
    return owner[order], rank[order]


def blend_slack(num_datasets: int) -> int:
    """Bound on how far a dataset's draws can run ahead of ``w_d * N`` (at most D/2 + 1/2)."""
    return (num_datasets + 1) // 2 + 1


class BlendedDataset(torch.utils.data.Dataset):
    """Interleaves ``datasets`` by ``weights``; ``ds[i]`` is item ``i`` of the blend.

    ``dataset_index``/``dataset_sample_index`` are cached like the GPT indices.
    """

    def __init__(self, datasets, weights, num_samples: int, cache_dir=None, description=None, rank=None,
                 barrier=None, cache_fallbacks=()):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("BlendedDataset needs one weight per dataset")
        self.datasets, self.weights, self.num_samples = list(datasets), list(weights), num_samples
        arrays = load_or_build(
            cache_dir,
            {"class": "BlendedDataset", "weights": list(map(float, weights)), "num_samples": num_samples,
             "components": description},
            ("dataset_index", "dataset_sample_index"),
            lambda: dict(zip(("dataset_index", "dataset_sample_index"),
                             build_blending_indices(weights, num_samples))),
            rank=rank,
            barrier=barrier,
            fallbacks=cache_fallbacks,
        )
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        for d, ds in enumerate(self.datasets):
            used = int(np.count_nonzero(self.dataset_index == d))
            if used > len(ds):
                raise ValueError(f"blend draws {used} samples from dataset {d} but it holds only {len(ds)}")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int):
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]

    def sample_tokens(self, idx: int) -> np.ndarray:
        d = int(self.dataset_index[idx])
        return self.datasets[d].sample_tokens(int(self.dataset_sample_index[idx]))


def build_train_valid_test_datasets(
    data_path: Sequence[str] | str,
    split: str,
    seq_length: int,
    num_samples: Sequence[int],
    seed: int = 1234,
    cache_dir: str | None = None,
    eod_id: int | None = None,
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
    surplus: float = DEFAULT_SURPLUS,
    rank: int | None = None,
    barrier=None,
) -> list:
    """[train, valid, test] datasets for ``--data-path``/``--split``; ``None`` where 0 samples are asked.

    ``num_samples`` gives the (train, valid, test) sample counts. With one
    prefix the result is a :class:`GPTDataset`; with several, a
    :class:`BlendedDataset` over their same-named splits.
    """
    pairs = parse_data_path(data_path)
    fractions = parse_split(split)
    if len(num_samples) != 3 or any(n < 0 for n in num_samples):
        raise ValueError(f"num_samples must be three non-negative counts (train, valid, test), got {num_samples}")
    indexed = [IndexedDataset(prefix) for _, prefix in pairs]
    weights = [w for w, _ in pairs]
    out = []
    for s, name in enumerate(SPLIT_NAMES):
        wanted = int(num_samples[s])
        if wanted == 0:
            out.append(None)
            continue
        if fractions[s] == 0:
            raise DataError(f"{wanted} {name} samples requested but --split {split!r} gives {name} no data; "
                            f"give {name} a share in --split")

        def component(ds: IndexedDataset, n: int) -> GPTDataset:
            lo, hi = split_ranges(ds.num_documents, fractions)[s]
            seq_lo, seq_hi = int(ds.document_indices[lo]), int(ds.document_indices[hi])
            return GPTDataset(
                ds, seq_length, n, seed, sequence_range=(seq_lo, seq_hi), split_name=name,
                cache_dir=cache_dir, eod_id=eod_id, eod_mask_loss=eod_mask_loss,
                reset_position_ids=reset_position_ids, rank=rank, barrier=barrier,
            )

        if len(indexed) == 1:
            out.append(component(indexed[0], wanted))
            continue
        sizes = [int(math.ceil(w * wanted * (1 + surplus))) + blend_slack(len(weights)) for w in weights]
        parts = [component(ds, n) for ds, n in zip(indexed, sizes)]
        blend_dir = cache_dir if cache_dir is not None else default_cache_dir(pairs[0][1])
        fallbacks = fallback_dirs(blend_dir) if cache_dir is None else ()
        description = [[os.path.abspath(p), w, len(c), name] for (w, p), c in zip(pairs, parts)]
        out.append(BlendedDataset(parts, weights, wanted, blend_dir, description, rank=rank, barrier=barrier,
                                  cache_fallbacks=fallbacks))
    return out
