"""Where the data tools write: the one rule for an output path whose folder cannot be made."""

from __future__ import annotations

import os


def make_output_dir(path: str | os.PathLike, flag: str) -> None:
    """Create the folder ``path`` is written into; a ValueError naming ``flag`` and the cause if it cannot be
    (a file where a folder of the path should be, or no permission)."""
    out_dir = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        blocker = out_dir
        while not os.path.exists(blocker) and os.path.dirname(blocker) != blocker:
            blocker = os.path.dirname(blocker)
        why = f"{blocker} is a file, not a directory" if os.path.isfile(blocker) else \
            f"cannot create directory {out_dir} ({e.strerror})"
        raise ValueError(f"{flag} {path}: {why}; choose another {flag}") from None
