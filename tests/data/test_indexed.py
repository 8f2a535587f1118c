"""The .bin/.idx format: round trips, golden header bytes, merging, and every corruption case."""

import os
import struct

import numpy as np
import pytest

from hybrid.data.indexed import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetWriter,
    IndexFormatError,
    best_dtype,
    merge_datasets,
    write_dataset,
)

EXPECTED_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                  7: np.float32, 8: np.uint16}


def _docs(dtype, n=7, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 20, size=n)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return [rng.integers(info.min, info.max, size=k, endpoint=True).astype(dtype) for k in lengths]
    return [rng.standard_normal(k).astype(dtype) for k in lengths]


def test_dtype_code_table_matches_the_format():
    assert {c: d.type for c, d in DTYPE_CODES.items()} == EXPECTED_CODES
    assert best_dtype(65499) == np.uint16 and best_dtype(65500) == np.int32 and best_dtype(32000) == np.uint16


@pytest.mark.parametrize("code", sorted(EXPECTED_CODES))
def test_round_trip_and_golden_header(tmp_path, code):
    dtype = np.dtype(EXPECTED_CODES[code])
    docs = _docs(dtype, seed=code)
    prefix = tmp_path / "ds"
    ds = write_dataset(prefix, docs, dtype=dtype)
    raw = (tmp_path / "ds.idx").read_bytes()
    n = len(docs)
    # Header, field by field.
    assert raw[0:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)
    assert raw[17] == code
    assert struct.unpack("<Q", raw[18:26]) == (n,)
    assert struct.unpack("<Q", raw[26:34]) == (n + 1,)  # document indices include the leading 0
    lengths = np.frombuffer(raw, "<i4", n, 34)
    pointers = np.frombuffer(raw, "<i8", n, 34 + 4 * n)
    doc_idx = np.frombuffer(raw, "<i8", n + 1, 34 + 12 * n)
    assert len(raw) == 34 + 4 * n + 8 * n + 8 * (n + 1)
    want_lengths = [len(d) for d in docs]
    assert lengths.tolist() == want_lengths
    assert pointers.tolist() == (np.concatenate([[0], np.cumsum(want_lengths)[:-1]]) * dtype.itemsize).tolist()
    assert doc_idx.tolist() == list(range(n + 1))
    assert (tmp_path / "ds.bin").read_bytes() == b"".join(d.astype(dtype.newbyteorder("<")).tobytes() for d in docs)
    # Reader.
    assert ds.dtype == dtype and len(ds) == n and ds.num_documents == n
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
    if len(docs[1]) > 2:
        np.testing.assert_array_equal(ds.get(1, 1, 2), docs[1][1:3])


def test_reader_is_zero_copy(tmp_path):
    ds = write_dataset(tmp_path / "z", [[1, 2, 3], [4, 5]])
    assert isinstance(ds.tokens, np.memmap)
    for arr in (ds.sequence_lengths, ds.sequence_pointers, ds.document_indices, ds[0]):
        assert not arr.flags.owndata  # views over the mapped files, not copies


def test_multi_sequence_documents(tmp_path):
    with IndexedDatasetWriter(tmp_path / "m", np.int32) as w:
        w.add_item([1, 2])
        w.add_item([3])
        w.end_document()
        w.add_document([4, 5, 6])
        w.end_document()  # a document with no sequences is legal in the format
        w.add_documents(np.array([7, 8, 9]), [1, 2])
    ds = IndexedDataset(tmp_path / "m")
    assert ds.document_indices.tolist() == [0, 2, 3, 3, 4, 5]
    assert [d.tolist() for d in ds.document(0)] == [[1, 2], [3]]
    assert ds.document(2) == [] and ds[4].tolist() == [8, 9]


def test_merge(tmp_path):
    a = [np.array([1, 2, 3]), np.array([4])]
    b = [np.array([5, 6]), np.array([], dtype=np.int64), np.array([7, 8, 9, 10])]
    write_dataset(tmp_path / "a", a)
    write_dataset(tmp_path / "b", b)
    merged = merge_datasets([tmp_path / "a", tmp_path / "b"], tmp_path / "ab")
    assert [merged[i].tolist() for i in range(len(merged))] == [d.tolist() for d in a + b]
    assert merged.document_indices.tolist() == [0, 1, 2, 3, 4, 5]
    assert (tmp_path / "ab.bin").read_bytes() == (tmp_path / "a.bin").read_bytes() + (tmp_path / "b.bin").read_bytes()
    # Byte-identical to writing the concatenation directly.
    write_dataset(tmp_path / "direct", a + b)
    assert (tmp_path / "ab.idx").read_bytes() == (tmp_path / "direct.idx").read_bytes()


def test_merge_rejects_mixed_dtypes(tmp_path):
    write_dataset(tmp_path / "u16", [[1, 2]], dtype=np.uint16)
    write_dataset(tmp_path / "i32", [[1, 2]], dtype=np.int32)
    with pytest.raises(ValueError, match="share one dtype"):
        merge_datasets([tmp_path / "u16", tmp_path / "i32"], tmp_path / "out")
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.bin.partial").exists()


def test_writer_rejects_ids_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match="do not fit uint16"):
        with IndexedDatasetWriter(tmp_path / "x", np.uint16) as w:
            w.add_document([1, 70000])
    assert os.listdir(tmp_path) == []  # aborted writes leave nothing behind


# -- corrupted files --------------------------------------------------------------------


@pytest.fixture
def good(tmp_path):
    write_dataset(tmp_path / "g", [np.arange(5), np.arange(3), np.arange(4)], dtype=np.uint16)
    return tmp_path / "g"


def _patch(path, offset, data):
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def test_missing_idx(good):
    os.remove(f"{good}.idx")
    with pytest.raises(FileNotFoundError, match=r"index file .*g\.idx not found"):
        IndexedDataset(good)


def test_missing_bin(good):
    os.remove(f"{good}.bin")
    with pytest.raises(FileNotFoundError, match=r"data file .*g\.bin not found"):
        IndexedDataset(good)


def test_prefix_with_extension_gets_a_hint(good):
    with pytest.raises(FileNotFoundError, match="without the extension"):
        IndexedDataset(f"{good}.bin")


def test_wrong_magic(good):
    _patch(good.with_suffix(".idx"), 0, b"NOTANIDX!")
    with pytest.raises(IndexFormatError, match=r"g\.idx: bad magic"):
        IndexedDataset(good)


def test_wrong_version(good):
    _patch(good.with_suffix(".idx"), 9, struct.pack("<Q", 2))
    with pytest.raises(IndexFormatError, match="unsupported version 2"):
        IndexedDataset(good)


def test_unknown_dtype_code(good):
    _patch(good.with_suffix(".idx"), 17, bytes([9]))
    with pytest.raises(IndexFormatError, match="unknown dtype code 9"):
        IndexedDataset(good)


def test_truncated_header(good):
    good.with_suffix(".idx").write_bytes(b"MMIDIDX\x00\x00\x01")
    with pytest.raises(IndexFormatError, match="truncated header"):
        IndexedDataset(good)


def test_truncated_idx(good):
    path = good.with_suffix(".idx")
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(IndexFormatError, match="does not match its header"):
        IndexedDataset(good)


def test_truncated_bin(good):
    path = good.with_suffix(".bin")
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(IndexFormatError, match=r"g\.bin: size 22 bytes, but .* expects 24"):
        IndexedDataset(good)


def test_pointer_mismatch(good):
    # Sequence 2 claims to start 2 bytes later than sequence 1 ends.
    _patch(good.with_suffix(".idx"), 34 + 4 * 3 + 8 * 2, struct.pack("<q", 18))
    with pytest.raises(IndexFormatError, match="pointer mismatch at sequence 2: found 18, expected 16"):
        IndexedDataset(good)


def test_pointers_not_monotone(good):
    _patch(good.with_suffix(".idx"), 34 + 4 * 3 + 8 * 2, struct.pack("<q", 4))
    with pytest.raises(IndexFormatError, match="not monotone"):
        IndexedDataset(good)


def test_bad_document_indices(good):
    _patch(good.with_suffix(".idx"), 34 + 12 * 3 + 8 * 3, struct.pack("<q", 2))
    with pytest.raises(IndexFormatError, match="document indices"):
        IndexedDataset(good)


# -- the reference implementation, when installed ------------------------------------------


def test_megatron_core_reads_ours_and_we_read_theirs(tmp_path):
    mcore = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    docs = _docs(np.dtype(np.uint16), n=9, seed=3)
    write_dataset(tmp_path / "ours", docs)
    theirs = mcore.IndexedDataset(str(tmp_path / "ours"))
    assert len(theirs) == len(docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], d)
    builder = mcore.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.uint16)
    for d in docs:
        builder.add_document(d.astype(np.int64), [len(d)])
    builder.finalize(str(tmp_path / "theirs.idx"))
    ours = IndexedDataset(tmp_path / "theirs")
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ours[i], d)
    assert (tmp_path / "theirs.idx").read_bytes() == (tmp_path / "ours.idx").read_bytes()
    assert (tmp_path / "theirs.bin").read_bytes() == (tmp_path / "ours.bin").read_bytes()
