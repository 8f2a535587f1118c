"""The save directory as a whole: ``latest``, finding, cleaning up and pruning iterations.

Invariant kept by every function here: ``DIR/latest``, when present, names a
complete iteration directory (one that holds ``metadata.json``). Removals
first delete ``metadata.json`` (making the directory incomplete, hence
ignored) and only then the rest, so a removal cut short by a crash never
leaves a directory that looks complete but lacks files.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import List, Optional

from hybrid.checkpoint.atomic import fsync_dir, is_temp_name, write_bytes_atomic
from hybrid.checkpoint.errors import CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError
from hybrid.checkpoint.layout import LATEST_FILE, METADATA_FILE, parse_iteration_dir_name
from hybrid.checkpoint.manifest import read_manifest

_LISTED = 8  # complete checkpoints named in an error


@dataclasses.dataclass(frozen=True)
class IterationDir:
    iteration: int
    path: Path

    @property
    def complete(self) -> bool:
        return (self.path / METADATA_FILE).is_file()


def list_iterations(save_dir: Path) -> List[IterationDir]:
    """Every ``iter_NNNNNNN`` directory under ``save_dir``, by increasing iteration."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    found = []
    for entry in save_dir.iterdir():
        it = parse_iteration_dir_name(entry.name)
        if it is not None and entry.is_dir():
            found.append(IterationDir(it, entry))
    return sorted(found, key=lambda d: d.iteration)


def _latest_text(save_dir: Path) -> Optional[str]:
    """What ``save_dir/latest`` holds, stripped (undecodable bytes replaced), or None if absent."""
    try:
        data = (Path(save_dir) / LATEST_FILE).read_bytes()
    except FileNotFoundError:
        return None
    return data.decode("utf-8", errors="replace").strip()


def read_latest(save_dir: Path) -> Optional[str]:
    """The iteration directory name recorded in ``save_dir/latest``, or None if absent."""
    path = Path(save_dir) / LATEST_FILE
    name = _latest_text(save_dir)
    if name is None:
        return None
    if parse_iteration_dir_name(name) is None:
        raise CheckpointNotFoundError(
            f"{path} contains {name[:80]!r}, not an iteration directory name like 'iter_0000200'; "
            f"fix or delete it, or load an iteration directory explicitly")
    return name


def write_latest(save_dir: Path, iter_dir_name: str) -> None:
    """Atomically point ``save_dir/latest`` at ``iter_dir_name`` and make it durable."""
    write_bytes_atomic(Path(save_dir) / LATEST_FILE, (iter_dir_name + "\n").encode("utf-8"))
    fsync_dir(save_dir)


def resolve_checkpoint_dir(path) -> Path:
    """The complete iteration directory that ``path`` designates.

    ``path`` is either an iteration directory (``DIR/iter_0000200``) or a save
    directory, which is resolved through its ``latest`` file.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"checkpoint path {path} does not exist")
    if not path.is_dir():
        raise CheckpointNotFoundError(f"checkpoint path {path} is not a directory")
    if parse_iteration_dir_name(path.name) is not None or (path / METADATA_FILE).exists():
        _require_complete(path)
        return path
    name = read_latest(path)
    if name is None:
        complete = [d.path.name for d in list_iterations(path) if d.complete]
        if complete:
            raise CheckpointNotFoundError(
                f"{path} has no '{LATEST_FILE}' file, so which checkpoint to resume is unclear; "
                f"load one iteration directory explicitly, e.g. {path / complete[-1]} "
                f"(complete ones: {', '.join(complete)})")
        raise CheckpointNotFoundError(f"{path} holds no checkpoint (no '{LATEST_FILE}' file and no "
                                      f"complete iter_NNNNNNN directory)")
    target = path / name
    if not target.is_dir():
        raise CheckpointNotFoundError(f"{path / LATEST_FILE} points at {name}, which does not "
                                      f"exist; the directory was removed by hand?")
    _require_complete(target)
    return target


def _require_complete(iter_dir: Path) -> None:
    if not (iter_dir / METADATA_FILE).is_file():
        parent = iter_dir.parent
        latest = None
        try:
            latest = read_latest(parent)
        except CheckpointNotFoundError:
            pass
        hint = f"; {parent / LATEST_FILE} points at {latest}" if latest else ""
        raise IncompleteCheckpointError(
            f"{iter_dir} has no {METADATA_FILE}: the save that wrote it did not finish (the job "
            f"was killed or failed mid-save), so its files cannot be trusted. Load the save "
            f"directory {parent} to resume from the newest complete checkpoint{hint}")


def find_resume_point(path) -> Optional[Path]:
    """Where a run started with ``--load path`` resumes: a complete iteration directory, or None.

    None (start from scratch) only when nothing could be lost by doing so:
    ``path`` does not exist, or it holds neither ``latest`` nor a complete
    ``iter_*`` directory (an empty folder, or the leftovers of a first save
    that never finished). An iteration directory must be complete. A save
    directory whose ``latest`` is missing, empty, garbled, or names a missing
    or incomplete directory while checkpoints are there raises
    :class:`CheckpointNotFoundError` listing the complete ones and how to pick
    one: starting over would save new checkpoints next to them and prune them.
    """
    path = Path(path)
    if parse_iteration_dir_name(path.name) is not None or (path / METADATA_FILE).exists():
        if not path.exists():
            raise CheckpointNotFoundError(f"checkpoint path {path} does not exist; "
                                          f"{_choices(path.parent)}")
        return resolve_checkpoint_dir(path)
    if not path.exists():
        return None
    if not path.is_dir():
        raise CheckpointNotFoundError(f"checkpoint path {path} is not a directory")
    complete = [d for d in list_iterations(path) if d.complete]
    name = _latest_text(path)
    if name is None and not complete:
        return None
    if name is None:
        problem = "is missing"
    elif not name:
        problem = "is empty"
    elif parse_iteration_dir_name(name) is None:
        problem = f"holds {name[:80]!r}, not an iteration directory name like 'iter_0000200'"
    elif not (path / name).is_dir():
        problem = f"names {name}, which does not exist"
    elif not (path / name / METADATA_FILE).is_file():
        problem = f"names {name}, whose save did not finish (it has no {METADATA_FILE})"
    else:
        return path / name
    raise CheckpointNotFoundError(
        f"{path / LATEST_FILE} {problem}, so which checkpoint to resume is unclear; not starting from "
        f"scratch, which would save and prune next to the checkpoints there. {_choices(path)}")


def _choices(save_dir: Path) -> str:
    """How to go on from ``save_dir``: the complete checkpoints and how to pick one, or how to start over."""
    if not save_dir.is_dir():
        return f"{save_dir} is not a directory either: check the path"
    complete = [d.path.name for d in list_iterations(save_dir) if d.complete]
    if not complete:
        return (f"{save_dir} holds no complete checkpoint; to start from scratch, remove {save_dir / LATEST_FILE} "
                f"or pass a new --load/--save folder")
    shown = ", ".join(complete[-_LISTED:])
    listing = f"{shown} (newest {_LISTED} of {len(complete)})" if len(complete) > _LISTED else shown
    return (f"Complete checkpoints: {listing}; resume one with --load {save_dir / complete[-1]} "
            f"(or write its name into {save_dir / LATEST_FILE})")


def has_checkpoint(save_dir) -> bool:
    """True when ``save_dir`` has a ``latest`` file, i.e. a resumable checkpoint."""
    try:
        return read_latest(Path(save_dir)) is not None
    except CheckpointNotFoundError:
        return False


def remove_iteration_dir(iter_dir: Path) -> None:
    """Delete an iteration directory so that no crash can leave it looking complete."""
    meta = iter_dir / METADATA_FILE
    if meta.exists():
        meta.unlink()
        fsync_dir(iter_dir)
    shutil.rmtree(iter_dir)


def remove_incomplete(save_dir: Path) -> List[Path]:
    """Delete leftovers of interrupted saves: incomplete iteration dirs and temp files."""
    save_dir = Path(save_dir)
    removed = []
    for d in list_iterations(save_dir):
        if not d.complete:
            shutil.rmtree(d.path)
            removed.append(d.path)
    for entry in save_dir.iterdir():
        if is_temp_name(entry.name) and entry.is_file():
            entry.unlink()
            removed.append(entry)
    if removed:
        fsync_dir(save_dir)
    return removed


def is_healthy(iter_dir: Path) -> bool:
    """Whether a complete checkpoint was saved from a healthy state (one whose manifest cannot be read is not)."""
    try:
        return read_manifest(iter_dir).healthy
    except (CheckpointError, OSError):
        return False


def prune_old(save_dir: Path, keep_last: int, newest_iteration: int) -> List[Path]:
    """Keep the ``keep_last`` newest complete checkpoints up to ``newest_iteration``.

    Also kept, whatever ``keep_last`` says: the one ``latest`` names, and the
    newest checkpoint saved from a healthy state, so that a run which went on
    saving while it diverged still has a state worth resuming from.
    Checkpoints with a higher iteration than ``newest_iteration`` (left by a
    run that was rolled back to an earlier checkpoint) are never removed here:
    which timeline the user wants to keep is theirs to decide.
    """
    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
    latest = read_latest(save_dir)
    candidates = [d for d in list_iterations(save_dir)
                  if d.complete and d.iteration <= newest_iteration]
    older = candidates[:-keep_last] if len(candidates) > keep_last else []
    kept = candidates[len(older):]
    healthy_kept = any(is_healthy(d.path) for d in reversed(kept))  # usually the new one: one read
    doomed = []
    for d in reversed(older):  # newest first, to find the newest healthy one
        keep = d.path.name == latest
        if not healthy_kept and is_healthy(d.path):
            healthy_kept = keep = True
        if not keep:
            doomed.append(d)
    doomed.reverse()
    for d in doomed:
        remove_iteration_dir(d.path)
    if doomed:
        fsync_dir(save_dir)
    return [d.path for d in doomed]


def step_back_latest(save_dir: Path, iteration: int) -> None:
    """Before replacing iteration ``iteration``, make ``latest`` not point at it.

    ``latest`` moves to the newest complete checkpoint below ``iteration``, or
    is removed when there is none, so that a crash during the replacement
    cannot leave ``latest`` naming a half-written directory.
    """
    save_dir = Path(save_dir)
    latest = read_latest(save_dir)
    if latest is None or parse_iteration_dir_name(latest) != iteration:
        return
    older = [d for d in list_iterations(save_dir) if d.complete and d.iteration < iteration]
    if older:
        write_latest(save_dir, older[-1].path.name)
    else:
        os.unlink(save_dir / LATEST_FILE)
        fsync_dir(save_dir)
