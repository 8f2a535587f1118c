"""Memory-mapped indexed datasets: the Megatron-compatible ``.bin``/``.idx`` pair.

A dataset lives under a *prefix*: ``{prefix}.bin`` holds the tokens of every
sequence back to back, ``{prefix}.idx`` describes them. The ``.idx`` layout
(all little-endian) is::

    offset  size            field
    0       9               magic  b"MMIDIDX\\x00\\x00"
    9       8   uint64      version, always 1
    17      1   uint8       dtype code (see DTYPE_CODES)
    18      8   uint64      sequence count  S
    26      8   uint64      document count  D  (= number of documents + 1)
    34      4*S int32       sequence lengths, in tokens
    ...     8*S int64       sequence pointers, byte offsets into the .bin
    ...     8*D int64       document indices: 0, then the sequence count at the
                            end of each document

A document is a run of consecutive sequences; ``tools/preprocess_data.py``
writes one sequence per document. Data written here is readable by
Megatron-LM's ``IndexedDataset`` and vice versa.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .errors import DataError, DataFileNotFoundError

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # 34 bytes

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_CODES.items()}

# Token ids up to this bound fit uint16 with room for a few added special tokens.
UINT16_VOCAB_LIMIT = 65500


class IndexFormatError(DataError):
    """A ``.bin``/``.idx`` pair is malformed; the message names the file and the problem."""


def best_dtype(vocab_size: int) -> np.dtype:
    """The token dtype for a vocabulary: uint16 below 65,500 ids, else int32."""
    if vocab_size is not None and vocab_size < UINT16_VOCAB_LIMIT:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def dtype_code(dtype) -> int:
    """The ``.idx`` code of a numpy dtype, or a clear error for unsupported ones."""
    dtype = np.dtype(dtype)
    if dtype not in _CODE_OF_DTYPE:
        supported = ", ".join(str(d) for d in DTYPE_CODES.values())
        raise ValueError(f"dtype {dtype} cannot be stored in an indexed dataset; use one of: {supported}")
    return _CODE_OF_DTYPE[dtype]


def bin_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.bin"


def idx_path(prefix: str | os.PathLike) -> str:
    return f"{os.fspath(prefix)}.idx"


def encode_index_header(dtype, sequence_count: int, document_count: int) -> bytes:
    """The 34 header bytes of an ``.idx`` file (``document_count`` includes the leading 0)."""
    return (
        INDEX_MAGIC
        + struct.pack("<Q", INDEX_VERSION)
        + struct.pack("<B", dtype_code(dtype))
        + struct.pack("<Q", sequence_count)
        + struct.pack("<Q", document_count)
    )


def strip_extension(prefix: str) -> str:
    """A dataset prefix without a trailing ``.bin``/``.idx``: ``--data-path corpus.bin`` means ``corpus``.

    The files of a prefix are always ``{prefix}.bin`` and ``{prefix}.idx``, so a
    path that ends in either extension names one of them, not a prefix.
    """
    return prefix[:-4] if prefix.endswith((".bin", ".idx")) else prefix


def _check_prefix_spelling(prefix: str) -> str:
    if prefix.endswith((".bin", ".idx")):
        return f" (pass the prefix without the extension, e.g. {prefix[:-4]!r})"
    return ""


class IndexedDataset:
    """Zero-copy reader of a ``.bin``/``.idx`` pair.

    Opening maps both files with numpy and builds three array *views* over the
    index (no per-sequence Python objects):

    - ``sequence_lengths``: int32 [S]
    - ``sequence_pointers``: int64 [S], byte offsets into the ``.bin``
    - ``document_indices``: int64 [D + 1]

    ``tokens`` is the whole ``.bin`` as a 1-D memmap of ``dtype``; ``ds[i]`` is
    a view of sequence ``i``. With ``validate=True`` (the default) opening checks
    magic, version, dtype code, the ``.idx`` size, document indices, that the
    pointers are monotone and consistent with the lengths, and that the ``.bin``
    size equals the last pointer plus its length; each failure raises
    :class:`IndexFormatError` naming the file.
    """

    def __init__(self, prefix: str | os.PathLike, validate: bool = True):
        self.prefix = os.fspath(prefix)
        self.idx_file = idx_path(self.prefix)
        self.bin_file = bin_path(self.prefix)
        hint = _check_prefix_spelling(self.prefix)
        for path, what in ((self.idx_file, "index"), (self.bin_file, "data")):
            if not os.path.isfile(path):
                raise DataFileNotFoundError(
                    f"{what} file {path} not found: an indexed dataset is the pair "
                    f"{self.prefix}.bin/.idx written by tools/preprocess_data.py{hint}"
                )
        self._idx = np.memmap(self.idx_file, dtype=np.uint8, mode="r") if os.path.getsize(self.idx_file) else None
        self._read_header()
        self._map_index_arrays()
        self._map_tokens()
        if validate:
            self.validate()

    def __getstate__(self) -> dict:
        # Pickle by prefix (e.g. for DataLoader workers): never copy the mapped files.
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"], validate=False)

    # -- opening -----------------------------------------------------------------
    def _read_header(self) -> None:
        size = 0 if self._idx is None else self._idx.shape[0]
        if size < HEADER_SIZE:
            raise IndexFormatError(
                f"{self.idx_file}: truncated header ({size} bytes, need {HEADER_SIZE}); the file is not a complete .idx"
            )
        header = bytes(self._idx[:HEADER_SIZE])
        magic = header[: len(INDEX_MAGIC)]
        if magic != INDEX_MAGIC:
            raise IndexFormatError(
                f"{self.idx_file}: bad magic {magic!r}, expected {INDEX_MAGIC!r}; not an mmap indexed-dataset index"
            )
        (version,) = struct.unpack_from("<Q", header, 9)
        if version != INDEX_VERSION:
            raise IndexFormatError(f"{self.idx_file}: unsupported version {version}, expected {INDEX_VERSION}")
        (code,) = struct.unpack_from("<B", header, 17)
        if code not in DTYPE_CODES:
            raise IndexFormatError(
                f"{self.idx_file}: unknown dtype code {code}; valid codes are {sorted(DTYPE_CODES)}"
            )
        self.dtype = DTYPE_CODES[code]
        self.sequence_count, self.document_count = struct.unpack_from("<QQ", header, 18)

    def _map_index_arrays(self) -> None:
        s, d = self.sequence_count, self.document_count
        expected = HEADER_SIZE + 4 * s + 8 * s + 8 * d
        size = self._idx.shape[0]
        # Multimodal Megatron indices append one int8 mode per sequence; those are ignored.
        if size not in (expected, expected + s):
            raise IndexFormatError(
                f"{self.idx_file}: size {size} bytes does not match its header "
                f"({s} sequences, {d} document indices need {expected} bytes); the file is truncated or corrupt"
            )
        buf = self._idx
        self.sequence_lengths = np.frombuffer(buf, dtype="<i4", count=s, offset=HEADER_SIZE)
        self.sequence_pointers = np.frombuffer(buf, dtype="<i8", count=s, offset=HEADER_SIZE + 4 * s)
        self.document_indices = np.frombuffer(buf, dtype="<i8", count=d, offset=HEADER_SIZE + 12 * s)

    def _map_tokens(self) -> None:
        self.bin_size = os.path.getsize(self.bin_file)
        if self.bin_size == 0:
            self.tokens = np.empty(0, dtype=self.dtype)
        else:
            usable = self.bin_size - self.bin_size % self.dtype.itemsize
            self.tokens = np.memmap(self.bin_file, dtype=self.dtype, mode="r", shape=(usable // self.dtype.itemsize,))

    def validate(self) -> None:
        """Check the index against itself and the ``.bin`` (vectorized, O(S))."""
        lengths, pointers, docs = self.sequence_lengths, self.sequence_pointers, self.document_indices
        itemsize = self.dtype.itemsize
        if self.document_count < 1 or docs[0] != 0 or docs[-1] != self.sequence_count:
            raise IndexFormatError(
                f"{self.idx_file}: document indices must start at 0 and end at the sequence count "
                f"{self.sequence_count}"
            )
        if np.any(np.diff(docs) < 0):
            raise IndexFormatError(f"{self.idx_file}: document indices are not monotone")
        if self.sequence_count == 0:
            expected_bin = 0
        else:
            bad = np.flatnonzero(lengths < 0)
            if bad.size:
                raise IndexFormatError(f"{self.idx_file}: sequence {bad[0]} has negative length {lengths[bad[0]]}")
            steps = np.diff(pointers)
            bad = np.flatnonzero(steps < 0)
            if bad.size:
                i = int(bad[0]) + 1
                raise IndexFormatError(
                    f"{self.idx_file}: sequence pointers are not monotone: pointer {i} "
                    f"({pointers[i]}) is below pointer {i - 1} ({pointers[i - 1]})"
                )
            bad = np.flatnonzero(steps != lengths[:-1].astype(np.int64) * itemsize)
            if pointers[0] != 0 or bad.size:
                i = 0 if pointers[0] != 0 else int(bad[0]) + 1
                want = 0 if i == 0 else int(pointers[i - 1]) + int(lengths[i - 1]) * itemsize
                raise IndexFormatError(
                    f"{self.idx_file}: pointer mismatch at sequence {i}: found {pointers[i]}, "
                    f"expected {want} from the previous pointer and length"
                )
            expected_bin = int(pointers[-1]) + int(lengths[-1]) * itemsize
        if self.bin_size != expected_bin:
            raise IndexFormatError(
                f"{self.bin_file}: size {self.bin_size} bytes, but {self.idx_file} expects {expected_bin} "
                f"(last pointer + last length x {itemsize}-byte {self.dtype}); the .bin is truncated or "
                f"belongs to another index"
            )

    # -- access ------------------------------------------------------------------
    def __len__(self) -> int:
        return self.sequence_count

    @property
    def num_documents(self) -> int:
        return self.document_count - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def token_offset(self, i: int) -> int:
        """Position of sequence ``i``'s first token in :attr:`tokens`."""
        return int(self.sequence_pointers[i]) // self.dtype.itemsize

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """A view of ``length`` tokens of sequence ``i`` starting at ``offset``."""
        if not -self.sequence_count <= i < self.sequence_count:
            raise IndexError(f"sequence {i} out of range for {self.prefix} with {self.sequence_count} sequences")
        i %= max(self.sequence_count, 1)
        seq_len = int(self.sequence_lengths[i])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"slice [{offset}, {offset + length}) out of range for sequence {i} of length {seq_len}")
        start = self.token_offset(i) + offset
        return self.tokens[start : start + length]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def document(self, d: int) -> list[np.ndarray]:
        """The sequences of document ``d`` (a list of views)."""
        lo, hi = int(self.document_indices[d]), int(self.document_indices[d + 1])
        return [self.get(i) for i in range(lo, hi)]

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, dtype={self.dtype}, sequences={self.sequence_count}, "
            f"documents={self.num_documents})"
        )


class IndexedDatasetWriter:
    """Streams sequences into ``{prefix}.bin`` and writes ``{prefix}.idx`` on :meth:`finalize`.

    Both files are written under temporary names and renamed into place at the
    end, so an aborted run leaves no half-written dataset behind. Use as a
    context manager: an exception inside the block removes the temporary files.

    - :meth:`add_document` writes one single-sequence document;
    - :meth:`add_documents` writes many at once from a flat token array and
      their lengths (vectorized, for large synthetic data);
    - :meth:`add_item` + :meth:`end_document` write multi-sequence documents;
    - :meth:`add_index` appends a whole existing dataset (used by :func:`merge_datasets`).
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.uint16):
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)
        parent = os.path.dirname(os.path.abspath(self.prefix))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"output directory {parent} does not exist (from prefix {self.prefix!r})")
        self._tmp_bin = bin_path(self.prefix) + ".partial"
        self._tmp_idx = idx_path(self.prefix) + ".partial"
        self._bin = open(self._tmp_bin, "wb")
        self._length_chunks: list[np.ndarray] = []
        self._doc_end_chunks: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self._pending_lengths: list[int] = []
        self._pending_doc_ends: list[int] = []
        self._sequence_count = 0
        self._document_open = False
        self._finalized = False

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()

    def _as_tokens(self, tokens) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
        if arr.dtype != self.dtype:
            if arr.size and np.issubdtype(arr.dtype, np.integer) and np.issubdtype(self.dtype, np.integer):
                info = np.iinfo(self.dtype)
                lo, hi = arr.min(), arr.max()
                if lo < info.min or hi > info.max:
                    raise ValueError(
                        f"token ids in [{lo}, {hi}] do not fit {self.dtype} of {self.prefix}; "
                        f"write with dtype=best_dtype(vocab_size)"
                    )
            arr = arr.astype(self.dtype)
        return arr

    def add_item(self, tokens) -> None:
        """Append one sequence to the current (open) document."""
        arr = self._as_tokens(tokens)
        self._bin.write(np.ascontiguousarray(arr).tobytes())
        self._pending_lengths.append(arr.size)
        self._sequence_count += 1
        self._document_open = True

    def end_document(self) -> None:
        """Close the current document after the sequences added so far."""
        self._pending_doc_ends.append(self._sequence_count)
        self._document_open = False

    def add_document(self, tokens) -> None:
        self.add_item(tokens)
        self.end_document()

    def _flush_pending(self) -> None:
        if self._pending_lengths:
            self._length_chunks.append(np.asarray(self._pending_lengths, dtype=np.int32))
            self._pending_lengths = []
        if self._pending_doc_ends:
            self._doc_end_chunks.append(np.asarray(self._pending_doc_ends, dtype=np.int64))
            self._pending_doc_ends = []

    def add_documents(self, tokens, lengths) -> None:
        """Append ``len(lengths)`` single-sequence documents.

        ``tokens`` is 1-D, the concatenation of the documents; ``lengths`` [N]
        gives each document's token count and must sum to ``len(tokens)``.
        """
        if self._document_open:
            raise ValueError("call end_document() before add_documents(): a document is still open")
        arr = self._as_tokens(tokens)
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1 or (lengths.size and lengths.min() < 0):
            raise ValueError("lengths must be a 1-D array of non-negative token counts")
        if int(lengths.sum()) != arr.size:
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {arr.size} tokens were given")
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError("a sequence longer than 2**31-1 tokens cannot be indexed")
        self._flush_pending()
        self._bin.write(np.ascontiguousarray(arr).tobytes())
        self._length_chunks.append(lengths.astype(np.int32))
        self._doc_end_chunks.append(self._sequence_count + np.arange(1, lengths.size + 1, dtype=np.int64))
        self._sequence_count += lengths.size

    def add_index(self, prefix: str | os.PathLike) -> None:
        """Append every document of the dataset at ``prefix`` (its dtype must match)."""
        src = IndexedDataset(prefix)
        if src.dtype != self.dtype:
            raise ValueError(
                f"cannot merge {src.prefix} (dtype {src.dtype}) into {self.prefix} (dtype {self.dtype}); "
                f"all inputs must share one dtype"
            )
        if self._document_open:
            raise ValueError("call end_document() before add_index(): a document is still open")
        self._flush_pending()
        with open(src.bin_file, "rb") as f:
            shutil.copyfileobj(f, self._bin, length=16 << 20)
        self._length_chunks.append(np.array(src.sequence_lengths, dtype=np.int32))
        self._doc_end_chunks.append(self._sequence_count + np.array(src.document_indices[1:], dtype=np.int64))
        self._sequence_count += src.sequence_count

    def finalize(self) -> None:
        """Write the ``.idx`` and move both files into place."""
        if self._finalized:
            return
        if self._document_open:
            self.end_document()
        self._flush_pending()
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        lengths = np.concatenate(self._length_chunks) if self._length_chunks else np.zeros(0, np.int32)
        doc_ends = np.concatenate(self._doc_end_chunks)
        pointers = np.zeros(lengths.size, dtype=np.int64)
        if lengths.size > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(self._tmp_idx, "wb") as f:
            f.write(encode_index_header(self.dtype, lengths.size, doc_ends.size))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_ends.astype("<i8").tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(self._tmp_idx, idx_path(self.prefix))
        self._finalized = True

    def abort(self) -> None:
        """Drop everything written so far."""
        if self._finalized:
            return
        if not self._bin.closed:
            self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)
        self._finalized = True


def write_dataset(prefix: str | os.PathLike, documents: Iterable[Sequence[int]], dtype=np.uint16) -> IndexedDataset:
    """Write single-sequence documents to ``prefix`` and open the result."""
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in documents:
            writer.add_document(doc)
    return IndexedDataset(prefix)


def merge_datasets(prefixes: Sequence[str | os.PathLike], output_prefix: str | os.PathLike) -> IndexedDataset:
    """Concatenate the datasets at ``prefixes`` (in order) into ``output_prefix``."""
    if not prefixes:
        raise ValueError("merge_datasets needs at least one input prefix")
    out = Path(os.fspath(output_prefix)).resolve()
    for p in prefixes:
        if Path(os.fspath(p)).resolve() == out:
            raise ValueError(f"output prefix {output_prefix} is also an input; choose a new prefix")
    first = IndexedDataset(prefixes[0])
    with IndexedDatasetWriter(output_prefix, first.dtype) as writer:
        for p in prefixes:
            writer.add_index(p)
    return IndexedDataset(output_prefix)
