"""GPT training samples: fixed-length windows over shuffled documents, epoch by epoch.

Let a dataset (or one split of it) hold ``n`` documents and ``T`` tokens. For
each epoch ``e`` the documents are put in a seeded random order and
concatenated into a stream of ``T`` tokens. Sample ``i`` of that epoch is the
tokens ``[i*L, (i+1)*L]`` of the stream (``L = seq_length``: ``L + 1`` tokens,
so neighbouring samples share one token, the last label of one being the first
input of the next). An epoch holds ``S = (T - 1) // L`` samples; the at most
``L`` tokens left at the end of an epoch's stream are not used in that epoch.

Epochs do not mix: the shuffle index permutes samples *within* each epoch, and
epoch ``e`` occupies dataset indices ``[e*S, (e+1)*S)``. Every token of the
split (but that short tail) is therefore seen once before any token repeats.

Three index arrays, all vectorized numpy (no per-sample Python loop):

- ``doc_index``: int32 [E * n], epoch ``e``'s document order in row ``e``;
- ``sample_index``: int32 [E * (S + 1), 2], for each epoch the (position in
  the epoch's document order, token offset) of the tokens ``j * L``, j = 0..S;
- ``shuffle_index``: [num_samples], dataset index -> (epoch-major) sample id.

Random draws are laid out epoch by epoch, so asking for more samples adds
epochs without changing the earlier ones.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

from .errors import SplitTooSmallError
from .index_cache import fallback_dirs, load_or_build
from .indexed import IndexedDataset

INDEX_FORMAT_VERSION = 1
_DOC_STREAM, _SHUFFLE_STREAM = 0, 1


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def samples_per_epoch(num_tokens: int, seq_length: int) -> int:
    return max(num_tokens - 1, 0) // seq_length


def build_document_index(num_documents: int, num_epochs: int, seed: int) -> np.ndarray:
    """int32 [num_epochs, num_documents]: a seeded permutation of the documents per epoch."""
    keys = _rng(seed, _DOC_STREAM).random((num_epochs, num_documents))
    return np.argsort(keys, axis=1, kind="stable").astype(np.int32)


def build_sample_index(epoch_lengths: np.ndarray, seq_length: int, num_samples_per_epoch: int) -> np.ndarray:
    """int32 [E * (S + 1), 2]: where each sample boundary falls in its epoch's stream.

    ``epoch_lengths`` is int64 [E, n], the document lengths in each epoch's
    order. Row ``e * (S + 1) + j`` holds (document position, offset) of token
    ``j * seq_length`` of epoch ``e``'s stream.
    """
    num_epochs, n = epoch_lengths.shape
    ends = np.cumsum(epoch_lengths, axis=1)
    total = int(ends[0, -1])
    # Shift epoch e by e*total so that one sorted 1-D search serves every epoch.
    shift = np.arange(num_epochs, dtype=np.int64)[:, None] * total
    flat_ends = (ends + shift).ravel()
    targets = (np.arange(num_samples_per_epoch + 1, dtype=np.int64)[None, :] * seq_length + shift).ravel()
    pos = np.searchsorted(flat_ends, targets, side="right")
    offsets = targets - (flat_ends[pos] - epoch_lengths.ravel()[pos])
    epoch_of = np.repeat(np.arange(num_epochs, dtype=np.int64), num_samples_per_epoch + 1)
    out = np.empty((targets.size, 2), dtype=np.int32)
    out[:, 0] = pos - epoch_of * n
    out[:, 1] = offsets
    return out


def build_shuffle_index(num_epochs: int, num_samples_per_epoch: int, num_samples: int, seed: int) -> np.ndarray:
    """[num_samples]: samples shuffled within each epoch, epochs in order."""
    keys = _rng(seed, _SHUFFLE_STREAM).random((num_epochs, num_samples_per_epoch))
    order = np.argsort(keys, axis=1, kind="stable").astype(np.int64)
    order += np.arange(num_epochs, dtype=np.int64)[:, None] * num_samples_per_epoch
    dtype = np.int32 if num_epochs * num_samples_per_epoch < 2**31 else np.int64
    return order.ravel()[:num_samples].astype(dtype)


def build_gpt_indices(lengths: np.ndarray, seq_length: int, num_samples: int, seed: int) -> dict[str, np.ndarray]:
    """The three index arrays for documents of ``lengths`` (see the module docstring)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    per_epoch = samples_per_epoch(int(lengths.sum()), seq_length)
    num_epochs = max(1, -(-num_samples // per_epoch))
    doc_index = build_document_index(lengths.size, num_epochs, seed)
    sample_index = build_sample_index(lengths[doc_index], seq_length, per_epoch)
    shuffle_index = build_shuffle_index(num_epochs, per_epoch, num_samples, seed)
    return {"doc_index": doc_index.ravel(), "sample_index": sample_index, "shuffle_index": shuffle_index}


def document_ids(is_eod):
    """The document of each token, numbered from 0 in each sample (along the last dim), from where the
    end-of-document tokens are (``is_eod``: a boolean numpy array or torch tensor ``[..., s]``; int64 of the same
    kind and shape back). Megatron's rule (``--reset-attention-mask``, ``--reset-position-ids``): a token after an
    end-of-document token starts the next document, and the end-of-document token belongs to the one it ends."""
    eod = is_eod.astype(np.int64) if isinstance(is_eod, np.ndarray) else is_eod.to(torch.int64)
    return eod.cumsum(-1) - eod  # the end-of-document tokens strictly before each token


def make_sample(tokens: np.ndarray, eod_id: int | None, eod_mask_loss: bool, reset_position_ids: bool) -> dict:
    """The training dict for ``seq_length + 1`` tokens.

    - ``tokens``: int64 [L], inputs; ``labels``: int64 [L], the next tokens;
    - ``loss_mask``: float32 [L], 0 where the input is EOD (with ``eod_mask_loss``):
      the token after a document end cannot be predicted from the previous document;
    - ``position_ids``: int64 [L], restarting after each EOD with ``reset_position_ids``.
    """
    # Built in numpy and wrapped once: per-call torch op overhead dominates at these sizes.
    data = np.asarray(tokens, dtype=np.int64)
    inputs, labels = data[:-1].copy(), data[1:].copy()
    length = inputs.size
    loss_mask = np.ones(length, dtype=np.float32)
    position_ids = np.arange(length, dtype=np.int64)
    if eod_mask_loss or reset_position_ids:
        is_eod = inputs == eod_id
        if eod_mask_loss:
            loss_mask[is_eod] = 0.0
        if reset_position_ids:  # each document's positions from 0: less the index of its first token
            doc = document_ids(is_eod)
            position_ids -= np.searchsorted(doc, doc)  # doc never decreases: its first index per document
    return {
        "tokens": torch.from_numpy(inputs),
        "labels": torch.from_numpy(labels),
        "loss_mask": torch.from_numpy(loss_mask),
        "position_ids": torch.from_numpy(position_ids),
    }


def default_cache_dir(prefix: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "index-cache")


class GPTDataset(torch.utils.data.Dataset):
    """``num_samples`` samples of ``seq_length + 1`` tokens from sequences ``sequence_range`` of ``indexed``.

    Each sequence of the ``.idx`` counts as one document. ``num_samples=None``
    means one epoch. Index arrays are cached under ``cache_dir`` (default:
    ``index-cache/`` beside the data, or a fallback under the user's cache
    directory when that is not writable; ``use_cache=False`` builds in memory):
    rank 0 builds, all ranks pass ``barrier`` (default: a world barrier when
    ``torch.distributed`` is initialized) and memory-map the files.

    ``ds[i]`` is a dict (see :func:`make_sample`); :meth:`sample_tokens` gives
    the raw int64 [seq_length + 1] window.
    """

    def __init__(
        self,
        indexed: IndexedDataset | str,
        seq_length: int,
        num_samples: int | None = None,
        seed: int = 1234,
        *,
        sequence_range: tuple[int, int] | None = None,
        split_name: str = "train",
        cache_dir: str | None = None,
        use_cache: bool = True,
        eod_id: int | None = None,
        eod_mask_loss: bool = False,
        reset_position_ids: bool = False,
        rank: int | None = None,
        barrier=None,
    ):
        self.indexed = indexed if isinstance(indexed, IndexedDataset) else IndexedDataset(indexed)
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        if (eod_mask_loss or reset_position_ids) and eod_id is None:
            raise ValueError("eod_mask_loss and reset_position_ids need eod_id (the tokenizer's end-of-document id)")
        start, end = sequence_range if sequence_range is not None else (0, len(self.indexed))
        if not 0 <= start <= end <= len(self.indexed):
            raise ValueError(f"sequence_range {(start, end)} outside [0, {len(self.indexed)}] of {self.indexed.prefix}")
        self.seq_length, self.seed, self.split_name = seq_length, seed, split_name
        self.sequence_start, self.sequence_end = start, end
        self.eod_id, self.eod_mask_loss, self.reset_position_ids = eod_id, eod_mask_loss, reset_position_ids
        lengths = self.indexed.sequence_lengths[start:end]
        self.tokens_per_epoch = int(lengths.sum(dtype=np.int64))
        self.samples_per_epoch = samples_per_epoch(self.tokens_per_epoch, seq_length)
        if self.samples_per_epoch == 0:
            raise SplitTooSmallError(
                f"the {split_name} split of {self.indexed.prefix} (sequences {start}..{end}) has "
                f"{self.tokens_per_epoch} tokens, fewer than seq_length + 1 = {seq_length + 1}: the dataset is "
                f"too small; use more data (--data-path), a larger {split_name} share of --split, or a shorter "
                f"--seq-length"
            )
        self.num_samples = self.samples_per_epoch if num_samples is None else int(num_samples)
        if self.num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.num_epochs = max(1, -(-self.num_samples // self.samples_per_epoch))
        description = {
            "class": "GPTDataset",
            "format_version": INDEX_FORMAT_VERSION,
            "prefix": os.path.abspath(self.indexed.prefix),
            "num_sequences": len(self.indexed),
            "num_tokens": self.indexed.num_tokens,
            # The indices depend only on the lengths: a rewritten dataset with other lengths
            # gets a new key rather than stale indices.
            "lengths_sha1": hashlib.sha1(np.ascontiguousarray(lengths).tobytes()).hexdigest(),
            "sequence_range": [start, end],
            "split": split_name,
            "seq_length": seq_length,
            "num_samples": self.num_samples,
            "seed": seed,
        }
        fallbacks = ()
        if use_cache and cache_dir is None:
            cache_dir = default_cache_dir(self.indexed.prefix)
            fallbacks = fallback_dirs(cache_dir)
        arrays = load_or_build(
            cache_dir if use_cache else None,
            description,
            ("doc_index", "sample_index", "shuffle_index"),
            lambda: build_gpt_indices(lengths, seq_length, self.num_samples, seed),
            rank=rank,
            barrier=barrier,
            fallbacks=fallbacks,
        )
        # np.asarray keeps cached arrays memory-mapped but drops the np.memmap subclass,
        # whose slicing costs more per call.
        self.doc_index = np.asarray(arrays["doc_index"])
        self.sample_index = np.asarray(arrays["sample_index"])
        self.shuffle_index = np.asarray(arrays["shuffle_index"])
        self._num_docs = end - start
        self._map_views()

    def _map_views(self) -> None:
        self._itemsize = self.indexed.dtype.itemsize
        self._tokens = np.asarray(self.indexed.tokens)
        self._pointers = np.asarray(self.indexed.sequence_pointers)
        self._lengths = np.asarray(self.indexed.sequence_lengths)

    def __getstate__(self) -> dict:
        # The token views would pickle as copies of the whole .bin; they are re-derived instead.
        return {k: v for k, v in self.__dict__.items() if k not in ("_tokens", "_pointers", "_lengths")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._map_views()

    def __len__(self) -> int:
        return self.num_samples

    def epoch_of(self, idx: int) -> int:
        """The epoch that dataset index ``idx`` belongs to."""
        return int(self.shuffle_index[idx]) // self.samples_per_epoch

    def sample_tokens(self, idx: int) -> np.ndarray:
        """int64 [seq_length + 1]: the token window of dataset index ``idx``."""
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for a dataset of {self.num_samples} samples")
        epoch, i = divmod(int(self.shuffle_index[idx]), self.samples_per_epoch)
        row = epoch * (self.samples_per_epoch + 1) + i
        (p0, o0), (p1, o1) = self.sample_index[row : row + 2].tolist()
        base = epoch * self._num_docs
        # The window's documents, their first token in the .bin, and the span used of each.
        seqs = self.doc_index[base + p0 : base + p1 + 1].astype(np.int64) + self.sequence_start
        begins = self._pointers[seqs] // self._itemsize
        if p0 == p1:
            start = int(begins[0]) + o0
            return self._tokens[start : start + o1 - o0 + 1].astype(np.int64)
        lengths = self._lengths[seqs].astype(np.int64)
        begins[0] += o0
        lengths[0] -= o0
        lengths[-1] = o1 + 1
        pieces = [self._tokens[b : b + n] for b, n in zip(begins.tolist(), lengths.tolist())]
        return np.concatenate(pieces).astype(np.int64, copy=False)

    def __getitem__(self, idx: int) -> dict:
        return make_sample(self.sample_tokens(int(idx)), self.eod_id, self.eod_mask_loss, self.reset_position_ids)

    def __repr__(self) -> str:
        return (
            f"GPTDataset({self.indexed.prefix!r}, split={self.split_name}, seq_length={self.seq_length}, "
            f"samples={self.num_samples}, epochs={self.num_epochs})"
        )
