import hashlib

import pytest
import torch

from hybrid.checkpoint.atomic import AtomicHashedFile, is_temp_name, sha256_of_file, write_bytes_atomic


def test_digest_is_of_the_bytes_on_disk(tmp_path):
    path = tmp_path / "f.bin"
    with AtomicHashedFile(path) as f:
        f.write(b"abc")
        f.write(memoryview(bytearray(range(256))))
        f.write(torch.arange(10, dtype=torch.float32).numpy())
    data = path.read_bytes()
    assert f.digest.sha256 == hashlib.sha256(data).hexdigest()
    assert f.digest.nbytes == len(data) == 3 + 256 + 40
    assert sha256_of_file(path) == f.digest
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]  # no temp file left


def test_torch_save_through_the_hashing_file(tmp_path):
    path = tmp_path / "o.pt"
    state = {"m": torch.randn(1000), "step": 7, "groups": [{"lr": 0.1}]}
    with AtomicHashedFile(path) as f:
        torch.save(state, f)
    assert f.digest == sha256_of_file(path)
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["m"], state["m"]) and loaded["step"] == 7


def test_failure_keeps_the_old_file_and_removes_the_temp(tmp_path):
    path = tmp_path / "latest"
    write_bytes_atomic(path, b"iter_0000001\n")
    with pytest.raises(RuntimeError, match="boom"):
        with AtomicHashedFile(path) as f:
            f.write(b"iter_00")
            raise RuntimeError("boom")
    assert path.read_bytes() == b"iter_0000001\n"
    assert not any(is_temp_name(p.name) for p in tmp_path.iterdir())


def test_visible_only_after_commit(tmp_path):
    path = tmp_path / "x"
    f = AtomicHashedFile(path)
    f.write(b"partial")
    assert not path.exists() and f.temp_path.exists()
    f.commit()
    assert path.read_bytes() == b"partial" and not f.temp_path.exists()
