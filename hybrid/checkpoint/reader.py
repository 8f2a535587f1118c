"""Reading a checkpoint: no process group, no pickled code.

:class:`CheckpointReader` needs only the files: ``metadata.json`` (JSON),
model shards (safetensors) and optimizer / per-rank files (``torch.load`` with
``weights_only=True``), so the trainer and offline conversion tools share it.
Every file is checked against the size and sha256 recorded in the manifest
before its contents are used; each rank verifies only the files it reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional, Set, Tuple

import safetensors
import safetensors.torch
import torch

from hybrid.checkpoint.atomic import sha256_of_file
from hybrid.checkpoint.directory import resolve_checkpoint_dir
from hybrid.checkpoint.errors import ChecksumMismatchError, CheckpointError, MissingShardError
from hybrid.checkpoint.layout import METADATA_FILE, model_file, optimizer_file, rank_state_file
from hybrid.checkpoint.manifest import Manifest, read_manifest
from hybrid.checkpoint.unreadable import damaged, load_checkpoint_torch_file, open_checkpoint_safetensors
from hybrid.layout import ParallelLayout


class CheckpointReader:
    """One complete iteration of a checkpoint.

    ``path`` is a save directory (resolved through ``latest``) or an iteration
    directory ``DIR/iter_NNNNNNN``. Incomplete directories are refused.
    """

    def __init__(self, path):
        self.path: Path = resolve_checkpoint_dir(path)
        self.manifest: Manifest = read_manifest(self.path)
        self._verified: Set[str] = set()

    # ---- manifest contents ---------------------------------------------------------------
    @property
    def iteration(self) -> int:
        return self.manifest.iteration

    @property
    def layout(self) -> ParallelLayout:
        return self.manifest.layout

    @property
    def consumed_samples(self) -> int:
        return self.manifest.consumed_samples

    @property
    def model_config(self) -> Dict[str, Any]:
        return self.manifest.model_config

    @property
    def param_index(self) -> Any:
        return self.manifest.param_index

    def stage_param_index(self, pp_rank: int) -> Any:
        """The parameter index of pipeline stage ``pp_rank``: metadata.json keeps one per stage when the
        checkpoint was saved with pipeline parallelism, and the one index otherwise."""
        index = self.param_index
        return index[pp_rank] if self.layout.pp > 1 and index is not None else index

    @property
    def trainer_state(self) -> Dict[str, Any]:
        return self.manifest.trainer_state

    @property
    def has_optimizer_state(self) -> bool:
        return self.manifest.has_kind("optimizer")

    @property
    def has_rank_state(self) -> bool:
        return self.manifest.has_kind("rank_state")

    # ---- verification --------------------------------------------------------------------
    def verify(self, name: str) -> Path:
        """Check ``name`` against its recorded size and sha256; returns its path."""
        record = self.manifest.files.get(name)
        if record is None:
            raise MissingShardError(f"{self.path / METADATA_FILE} lists no file {name!r}; its files "
                                    f"are: {', '.join(sorted(self.manifest.files))}")
        path = self.path / name
        if name in self._verified:
            return path
        if not path.is_file():
            raise MissingShardError(f"checkpoint file {path} is missing (listed in metadata.json); "
                                    f"the checkpoint is damaged: restore the file or load another "
                                    f"iteration")
        size = path.stat().st_size
        if size != record.nbytes:
            raise ChecksumMismatchError(f"checkpoint file {path} has {size} bytes but metadata.json "
                                        f"records {record.nbytes}; the file is truncated or damaged")
        digest = sha256_of_file(path)
        if digest.sha256 != record.sha256:
            raise ChecksumMismatchError(f"checksum mismatch for checkpoint file {path}: sha256 is "
                                        f"{digest.sha256}, metadata.json records {record.sha256}; "
                                        f"the file is corrupted: restore it or load another iteration")
        self._verified.add(name)
        return path

    def verify_all(self) -> None:
        for name in sorted(self.manifest.files):
            self.verify(name)

    # ---- model weights -------------------------------------------------------------------
    def model_file(self, tp_rank: int, pp_rank: int = 0) -> str:
        return model_file(self.layout, tp_rank, pp_rank)

    def load_model_shard(self, tp_rank: int, pp_rank: int = 0,
                         device: str = "cpu") -> Dict[str, torch.Tensor]:
        """Every tensor of TP rank ``tp_rank``'s model file, by name (saved local shapes)."""
        path = self.verify(self.model_file(tp_rank, pp_rank))
        try:
            return safetensors.torch.load_file(str(path), device=device)
        except Exception as e:  # noqa: BLE001 - the library raises its own error types
            raise damaged(path, e) from None

    def open_model_shard(self, tp_rank: int, pp_rank: int = 0):
        """A verified ``safetensors.safe_open`` handle, to read one tensor at a time.

        Use as ``with reader.open_model_shard(0) as f: f.get_tensor(name)``.
        """
        return open_checkpoint_safetensors(self.verify(self.model_file(tp_rank, pp_rank)))

    def model_shard_header(self, tp_rank: int, pp_rank: int = 0) -> Dict[str, Tuple[Tuple[int, ...], str]]:
        """Name -> (shape, safetensors dtype code) of one model file, from its header only."""
        with open_checkpoint_safetensors(self.verify(self.model_file(tp_rank, pp_rank))) as f:
            out = {}
            for name in f.keys():
                sl = f.get_slice(name)
                out[name] = (tuple(sl.get_shape()), sl.get_dtype())
            return out

    # ---- optimizer and per-rank state ----------------------------------------------------
    def load_optimizer_shard(self, tp_rank: int, dp_rank: int, pp_rank: int = 0,
                             map_location: Optional[str] = "cpu") -> Any:
        if not self.has_optimizer_state:
            raise CheckpointError(f"{self.path} was saved without optimizer state; load it for "
                                  f"weights only (a fresh optimizer)")
        return self._load_weights_only(optimizer_file(self.layout, tp_rank, dp_rank, pp_rank), map_location)

    def load_rank_state(self, tp_rank: int, dp_rank: int, pp_rank: int = 0) -> Any:
        if not self.has_rank_state:
            raise CheckpointError(f"{self.path} was saved without per-rank state (RNG)")
        return self._load_weights_only(rank_state_file(self.layout, tp_rank, dp_rank, pp_rank), "cpu")

    def _load_weights_only(self, name: str, map_location: Optional[str]) -> Any:
        return load_checkpoint_torch_file(self.verify(name), map_location=map_location)
