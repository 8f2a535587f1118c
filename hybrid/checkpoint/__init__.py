"""Checkpoint storage: crash-safe, checksummed, readable without a process group.

The trainer and engine decide *what* to save; this package decides *how*:

* :func:`save_checkpoint` - every rank writes its shards, the coordinator
  seals the iteration with ``metadata.json`` and moves ``latest``;
* :class:`CheckpointReader` - resolves ``DIR`` / ``DIR/iter_N``, verifies
  checksums, loads shards (safetensors, ``weights_only`` files, JSON only);
* :class:`CheckpointWriter` - the phases of a save, for tools that write a
  checkpoint from one process;
* :class:`BackgroundSaver` - the same save on a host copy of the state, in a
  thread, while training goes on (``--async-save``); :class:`SaveReport`;
* :func:`capture_rng_state` / :func:`restore_rng_state` - per-rank RNG state;
* :func:`find_resume_point` - where ``--load DIR`` resumes (None: nothing to
  resume; an unclear ``latest`` is an error, never a silent fresh start);
* :class:`SaveDirLock` / :func:`lock_save_dir` - one job per save directory;
* :func:`model_file`, :func:`optimizer_file`, :func:`rank_state_file` - the
  name of each rank's file for a :class:`hybrid.layout.ParallelLayout` (the
  layout type every checkpoint records; ``topology.layout(...)`` builds it).

See ``docs/checkpoints.md`` for the on-disk format.
"""

from hybrid.checkpoint.background import BackgroundSaver, SaveReport
from hybrid.checkpoint.directory import (find_resume_point, has_checkpoint, list_iterations,
                                         resolve_checkpoint_dir)
from hybrid.checkpoint.errors import (CheckpointError, CheckpointFormatError, CheckpointLockedError,
                                      CheckpointNotFoundError, ChecksumMismatchError,
                                      IncompleteCheckpointError, MissingShardError)
from hybrid.checkpoint.layout import (LATEST_FILE, METADATA_FILE, iteration_dir_name, model_file,
                                      model_positions, optimizer_file, rank_positions, rank_state_file)
from hybrid.checkpoint.lock import SaveDirLock, lock_save_dir
from hybrid.checkpoint.manifest import FORMAT_VERSION, FileRecord, Manifest, checkpoint_bytes
from hybrid.checkpoint.reader import CheckpointReader
from hybrid.checkpoint.rng import capture_rng_state, restore_rng_state
from hybrid.checkpoint.safetensors_stream import TensorSource, write_safetensors
from hybrid.checkpoint.save import gather_single_process, save_checkpoint
from hybrid.checkpoint.writer import CheckpointWriter

__all__ = [
    "save_checkpoint", "gather_single_process", "BackgroundSaver", "SaveReport", "CheckpointReader", "CheckpointWriter",
    "model_file", "optimizer_file", "rank_state_file", "model_positions", "rank_positions",
    "Manifest", "FileRecord", "checkpoint_bytes", "FORMAT_VERSION", "TensorSource", "write_safetensors",
    "capture_rng_state", "restore_rng_state", "has_checkpoint", "list_iterations",
    "resolve_checkpoint_dir", "find_resume_point", "iteration_dir_name", "LATEST_FILE", "METADATA_FILE",
    "SaveDirLock", "lock_save_dir",
    "CheckpointError", "CheckpointFormatError", "CheckpointLockedError", "CheckpointNotFoundError",
    "ChecksumMismatchError", "IncompleteCheckpointError", "MissingShardError",
]
