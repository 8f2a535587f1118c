"""Writing one iteration directory: prepare, write shards, commit.

The three phases, and who runs them::

    coordinator (TP 0, DP 0, PP 0)   every rank                       coordinator
    prepare()  ──── sync ────>  write_model_shard (DP rank 0)  ── gather ──>  commit(records)
                                write_optimizer_shard                         metadata.json
                                write_rank_state                              latest, pruning

Nothing here communicates: :func:`hybrid.checkpoint.save_checkpoint` runs the
phases over a process group, and an offline tool can run all of them in one
process (for example writing every TP shard of a converted model).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, Iterable, Mapping, Optional

import torch

from hybrid.checkpoint import directory
from hybrid.checkpoint.atomic import AtomicHashedFile, FileDigest, fsync_dir, write_bytes_atomic
from hybrid.checkpoint.errors import CheckpointError
from hybrid.checkpoint.layout import (METADATA_FILE, iteration_dir_name, model_file, optimizer_file,
                                      rank_state_file)
from hybrid.checkpoint.manifest import FileRecord, Manifest, expected_file_names, utc_now
from hybrid.checkpoint.safetensors_stream import TensorLike, write_safetensors
from hybrid.checkpoint.value_checks import check_json_value, check_weights_only_value
from hybrid.layout import ParallelLayout

log = logging.getLogger(__name__)


def check_keep_last(keep_last: Optional[int]) -> None:
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last (--keep-last) must be an integer >= 1 or unset, "
                              f"got {keep_last!r}")


def check_layout(layout) -> None:
    """Refuse anything but a :class:`~hybrid.layout.ParallelLayout` (it is what metadata.json stores)."""
    if not isinstance(layout, ParallelLayout):
        raise CheckpointError(f"a checkpoint's layout must be a hybrid.layout.ParallelLayout (e.g. "
                              f"topology.layout(zero_stage, precision)), got {type(layout).__name__}")


class CheckpointWriter:
    """Writes ``save_dir/iter_{iteration:07d}`` for a checkpoint saved in ``layout``."""

    def __init__(self, save_dir, iteration: int, layout: ParallelLayout):
        check_layout(layout)
        self.save_dir = Path(save_dir)
        self.iteration = iteration
        self.layout = layout
        self.iter_dir = self.save_dir / iteration_dir_name(iteration)

    # ---- phase 1: coordinator ------------------------------------------------------------
    def prepare(self) -> None:
        """Clear leftovers of interrupted saves and create the (empty) iteration directory.

        Must finish before any rank writes a file. A complete checkpoint of the
        same iteration (left by a run that was rolled back) is replaced; if
        ``latest`` names it, ``latest`` first steps back to an older one.
        """
        self.save_dir.mkdir(parents=True, exist_ok=True)
        if self.iter_dir.exists() and (self.iter_dir / METADATA_FILE).exists():
            log.warning("replacing the existing checkpoint %s", self.iter_dir)
            directory.step_back_latest(self.save_dir, self.iteration)
            directory.remove_iteration_dir(self.iter_dir)
        directory.remove_incomplete(self.save_dir)
        self.iter_dir.mkdir()
        fsync_dir(self.save_dir)

    # ---- phase 2: every rank ---------------------------------------------------------------
    def write_model_shard(self, tensors: Mapping[str, TensorLike], tp_rank: int,
                          pp_rank: int = 0) -> FileRecord:
        """Write the model weights held by TP rank ``tp_rank`` (its local shards, any device).

        Tensors are streamed one at a time; pass :class:`TensorSource` values to
        also produce them one at a time.
        """
        name = model_file(self.layout, tp_rank, pp_rank)
        meta = {"format": "pt", "tp_rank": str(tp_rank), "tp_size": str(self.layout.tp),
                "pp_rank": str(pp_rank), "iteration": str(self.iteration)}
        digest = self._write(name, lambda f: write_safetensors(f, tensors, meta))
        return FileRecord(name, "model", digest.sha256, digest.nbytes, tp_rank, pp_rank, None)

    def write_optimizer_shard(self, state: Any, tp_rank: int, dp_rank: int,
                              pp_rank: int = 0) -> FileRecord:
        """Write this rank's optimizer partition (tensors, numbers, strings, lists, dicts)."""
        name = optimizer_file(self.layout, tp_rank, dp_rank, pp_rank)
        return self._write_weights_only("optimizer", name, state, tp_rank, dp_rank, pp_rank)

    def write_rank_state(self, state: Any, tp_rank: int, dp_rank: int,
                         pp_rank: int = 0) -> FileRecord:
        """Write state that differs per rank, such as RNG states (see :mod:`hybrid.checkpoint.rng`)."""
        name = rank_state_file(self.layout, tp_rank, dp_rank, pp_rank)
        return self._write_weights_only("rank_state", name, state, tp_rank, dp_rank, pp_rank)

    def _write_weights_only(self, kind: str, name: str, state: Any, tp_rank: int, dp_rank: int,
                            pp_rank: int) -> FileRecord:
        check_weights_only_value(state, f"{kind} state for {name}")
        digest = self._write(name, lambda f: torch.save(state, f))
        return FileRecord(name, kind, digest.sha256, digest.nbytes, tp_rank, pp_rank, dp_rank)

    def _write(self, name: str, fill) -> FileDigest:
        if not self.iter_dir.is_dir():
            raise CheckpointError(f"{self.iter_dir} does not exist: the coordinator's prepare() must "
                                  f"finish before ranks write their files")
        with AtomicHashedFile(self.iter_dir / name) as f:
            try:
                fill(f)
            except Exception:
                # torch.save turns a refused write into "[enforce fail at inline_container.cc...] unexpected
                # pos": report the disk's own error (errno 28 on a full disk), naming the file, instead
                f.raise_write_error()
                raise
        fsync_dir(self.iter_dir)
        return f.digest  # type: ignore[return-value]

    # ---- phase 3: coordinator ------------------------------------------------------------
    def commit(self, records: Iterable[FileRecord], *, consumed_samples: int = 0,
               model_config: Optional[Mapping[str, Any]] = None, param_index: Any = None,
               trainer_state: Optional[Mapping[str, Any]] = None,
               keep_last: Optional[int] = None, healthy: bool = True) -> Manifest:
        """Seal the iteration: write ``metadata.json``, then ``latest``, then prune.

        ``records`` are the :class:`FileRecord` of every file every rank wrote.
        ``model_config``, ``param_index`` and ``trainer_state`` are stored as
        given and must be plain JSON. ``healthy`` records whether the state
        came from a healthy run; pruning always keeps the newest healthy one.
        """
        check_keep_last(keep_last)
        if not isinstance(healthy, bool):
            raise CheckpointError(f"healthy must be True or False, got {healthy!r}")
        files = self._check_records(records)
        for label, value in (("model_config", model_config), ("param_index", param_index),
                             ("trainer_state", trainer_state)):
            check_json_value(value, label)
        if not isinstance(consumed_samples, int) or consumed_samples < 0:
            raise CheckpointError(f"consumed_samples must be an integer >= 0, got {consumed_samples!r}")
        manifest = Manifest(iteration=self.iteration, layout=self.layout, files=files,
                            consumed_samples=consumed_samples,
                            model_config=dict(model_config or {}), param_index=param_index,
                            trainer_state=dict(trainer_state or {}), created_utc=utc_now(),
                            healthy=healthy)
        write_bytes_atomic(self.iter_dir / METADATA_FILE, manifest.dumps())
        fsync_dir(self.iter_dir)
        directory.write_latest(self.save_dir, self.iter_dir.name)
        if keep_last is not None:
            removed = directory.prune_old(self.save_dir, keep_last, self.iteration)
            for path in removed:
                log.info("removed old checkpoint %s (keep_last=%d)", path, keep_last)
        return manifest

    def _check_records(self, records: Iterable[FileRecord]) -> Dict[str, FileRecord]:
        files: Dict[str, FileRecord] = {}
        for rec in records:
            if rec.name in files and files[rec.name] != rec:
                raise CheckpointError(f"{rec.name} was reported twice with different contents; two "
                                      f"ranks wrote the same file")
            files[rec.name] = rec
        kinds = {r.kind for r in files.values()}
        if "model" not in kinds:
            raise CheckpointError(f"no model weights were written for {self.iter_dir}; DP rank 0 of "
                                  f"every TP group must pass its model state")
        expected = expected_file_names(self.layout, kinds)
        missing = sorted(set(expected) - set(files))
        if missing:
            raise CheckpointError(
                f"checkpoint {self.iter_dir} is missing {len(missing)} file(s): {', '.join(missing)}. "
                f"Every rank must write the same kinds of state ({', '.join(sorted(kinds))})")
        extra = sorted(set(files) - set(expected))
        if extra:
            raise CheckpointError(f"unexpected files for layout {self.layout.describe()}: {', '.join(extra)}")
        return files
