"""``metadata.json``: the plain-JSON manifest of one checkpoint iteration.

It holds everything needed to interpret the tensor files without a process
group: the layout, the model configuration, the iteration and consumed
samples, the caller's parameter index (TP partition metadata and flat
offsets), the caller's trainer state (LR schedule, loss scaler, ...), and the
size and sha256 of every file. The storage layer treats ``model_config``,
``param_index`` and ``trainer_state`` as opaque JSON.

The manifest also covers itself: ``metadata_sha256`` is the sha256 of the
rest of the document in canonical form (sorted keys, no spaces), so a changed
value anywhere in it (an edited setting, a flipped digit) is refused on load
instead of being trusted. Manifests written before the digest existed have no
such key and load as they are. ``healthy`` records whether the state was
saved from a healthy run (finite weights, not diverging); absent means true.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

from hybrid.checkpoint.errors import CheckpointFormatError
from hybrid.checkpoint.layout import (METADATA_FILE, model_file, model_positions, optimizer_file,
                                      parse_iteration_dir_name, rank_positions, rank_state_file)
from hybrid.checkpoint.value_checks import check_json_value
from hybrid.layout import LayoutError, ParallelLayout

FORMAT_NAME = "hybrid-checkpoint"
FORMAT_VERSION = 1

FILE_KINDS = ("model", "optimizer", "rank_state")
DIGEST_KEY = "metadata_sha256"


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """One file of an iteration directory, as written by one rank."""

    name: str
    kind: str  # one of FILE_KINDS
    sha256: str
    nbytes: int
    tp_rank: int
    pp_rank: int
    dp_rank: Optional[int]  # None for model files (one per TP rank, shared by the DP group)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or "/" in self.name or "\\" in self.name \
                or self.name in ("", ".", ".."):
            raise CheckpointFormatError(f"file name {self.name!r} must be a plain name inside the "
                                        f"iteration directory")
        if self.kind not in FILE_KINDS:
            raise CheckpointFormatError(f"file {self.name!r}: kind {self.kind!r} is not one of "
                                        f"{FILE_KINDS}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "FileRecord":
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class Manifest:
    iteration: int
    layout: ParallelLayout
    files: Dict[str, FileRecord]
    consumed_samples: int = 0
    model_config: Dict[str, Any] = dataclasses.field(default_factory=dict)
    param_index: Any = None
    trainer_state: Dict[str, Any] = dataclasses.field(default_factory=dict)
    created_utc: str = ""
    format_version: int = FORMAT_VERSION
    healthy: bool = True  # saved from a healthy state; pruning always keeps the newest such checkpoint

    def has_kind(self, kind: str) -> bool:
        return any(r.kind == kind for r in self.files.values())

    def to_json(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "iteration": self.iteration,
            "consumed_samples": self.consumed_samples,
            "created_utc": self.created_utc,
            "layout": self.layout.to_json(),
            "model_config": self.model_config,
            "param_index": self.param_index,
            "trainer_state": self.trainer_state,
            "healthy": self.healthy,
            "files": {name: rec.to_json() for name, rec in sorted(self.files.items())},
        }

    def dumps(self) -> bytes:
        doc = self.to_json()
        check_json_value(doc, "metadata")
        # Digest what a reader will parse (tuples as lists, number subclasses as plain numbers).
        doc[DIGEST_KEY] = document_digest(json.loads(json.dumps(doc, allow_nan=False)))
        return (json.dumps(doc, indent=1, allow_nan=False) + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, doc: Any, source: str) -> "Manifest":
        """Parse a manifest; ``source`` (the file path) appears in every error."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CheckpointFormatError(f"{source} is not a hybrid checkpoint manifest "
                                        f"(missing \"format\": \"{FORMAT_NAME}\")")
        version = doc.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointFormatError(
                f"{source} has format_version {version!r}; this version of hybrid reads version "
                f"{FORMAT_VERSION}. Use the hybrid release that wrote it, or convert it")
        missing = [k for k in ("iteration", "layout", "files") if k not in doc]
        if missing:
            raise CheckpointFormatError(f"{source} lacks required keys {missing}")
        healthy = doc.get("healthy", True)  # absent: written before the flag existed, counted healthy
        if not isinstance(healthy, bool):
            raise CheckpointFormatError(f"{source}: \"healthy\" must be true or false, got {healthy!r}")
        try:
            files = {name: FileRecord.from_json(rec) for name, rec in doc["files"].items()}
            manifest = cls(iteration=int(doc["iteration"]), layout=ParallelLayout.from_json(doc["layout"]),
                           files=files, consumed_samples=int(doc.get("consumed_samples", 0)),
                           model_config=doc.get("model_config") or {},
                           param_index=doc.get("param_index"),
                           trainer_state=doc.get("trainer_state") or {},
                           created_utc=doc.get("created_utc", ""), format_version=version, healthy=healthy)
        except (CheckpointFormatError, LayoutError) as e:
            raise CheckpointFormatError(f"{source}: {e}") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise CheckpointFormatError(f"{source} is malformed: {e}") from None
        _check_files_match_layout(manifest, source)
        # Last, so that a specific complaint (a bad layout, a file name) wins over this catch-all.
        _check_digest(doc, source)
        return manifest


def document_digest(doc: dict) -> str:
    """sha256 of ``doc`` without its digest key, in canonical JSON (what :data:`DIGEST_KEY` records)."""
    body = {k: v for k, v in doc.items() if k != DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _check_digest(doc: dict, source: str) -> None:
    if DIGEST_KEY not in doc:
        return  # written before manifests carried a digest
    try:
        actual = document_digest(doc)
    except ValueError as e:  # NaN or infinity: never written by the writer
        raise CheckpointFormatError(f"{source} is malformed: {e}") from None
    if doc[DIGEST_KEY] != actual:
        raise CheckpointFormatError(
            f"{source} was changed after it was written: its contents do not match the {DIGEST_KEY} it "
            f"records; restore the file or load another iteration (to edit it on purpose, delete the "
            f"{DIGEST_KEY} key)")


def _check_files_match_layout(manifest: "Manifest", source: str) -> None:
    """The listed files must be exactly those a save in the recorded layout writes (a changed layout or list)."""
    expected = expected_file_names(manifest.layout, {r.kind for r in manifest.files.values()})
    missing = sorted(set(expected) - set(manifest.files))
    extra = sorted(set(manifest.files) - set(expected))
    wrong_kind = sorted(n for n, r in manifest.files.items() if n in expected and expected[n] != r.kind)
    if missing or extra or wrong_kind:
        parts = [f"{label} {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
                 for label, names in (("missing", missing), ("unexpected", extra), ("of the wrong kind", wrong_kind))
                 if names]
        raise CheckpointFormatError(
            f"{source} lists files that do not match its layout {manifest.layout.describe()} "
            f"({'; '.join(parts)}); the file was edited or damaged: restore it or load another iteration")


def read_manifest(iter_dir: Path) -> Manifest:
    path = Path(iter_dir) / METADATA_FILE
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointFormatError(f"{path} is not valid JSON ({e}); the file is damaged: restore it or load "
                                    f"another iteration") from None
    manifest = Manifest.from_json(doc, str(path))
    named = parse_iteration_dir_name(Path(iter_dir).name)
    if named is not None and named != manifest.iteration:
        raise CheckpointFormatError(f"{path} records iteration {manifest.iteration} but sits in "
                                    f"{Path(iter_dir).name}; the file was edited or moved: restore it or load "
                                    f"another iteration")
    return manifest


def checkpoint_bytes(iter_dir) -> int:
    """The size of a complete checkpoint: every file its ``metadata.json`` lists (the manifest itself aside)."""
    return sum(r.nbytes for r in read_manifest(Path(iter_dir)).files.values())


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def expected_file_names(layout: ParallelLayout, kinds: Iterable[str]) -> Dict[str, str]:
    """Every file name a complete save of ``kinds`` must contain, mapped to its kind."""
    names: Dict[str, str] = {}
    kinds = set(kinds)
    if "model" in kinds:
        for t, p in model_positions(layout):
            names[model_file(layout, t, p)] = "model"
    for kind, name_of in (("optimizer", optimizer_file), ("rank_state", rank_state_file)):
        if kind in kinds:
            for t, d, p in rank_positions(layout):
                names[name_of(layout, t, d, p)] = kind
    return names
