"""Reading the trainer settings a checkpoint stored (``client_state["args"]`` in ``metadata.json``).

Today's trainer stores the nested tree (:func:`hybrid.config.parse.to_plain`);
checkpoints of earlier releases stored the flat trainer arguments
(``zero_bucket_size``, ``tokenizer_model``, ``bf16``...). Both read the same
way here, through the flat names of :mod:`hybrid.config.spellings`, so offline
tools (resharding, export) ask for a key and get it from either form.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from hybrid.config.flags import Given, apply_given, get_path
from hybrid.config.spellings import FLAT_NAMES, SECTIONS


def saved_tree(saved: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """The stored settings as a (possibly partial) nested tree; ``{}`` when nothing was stored."""
    if not saved:
        return {}
    if any(isinstance(saved.get(section), Mapping) for section in SECTIONS):
        return dict(saved)
    tree: Dict[str, Any] = {}
    # Flat form: unset settings were stored as null; names no longer spelled (e.g. 'config') carry no setting.
    apply_given(tree, [Given(FLAT_NAMES[k], v) for k, v in saved.items() if k in FLAT_NAMES and v is not None])
    return tree


def saved_setting(saved: Optional[Mapping[str, Any]], key: str, default: Any = None) -> Any:
    """The stored value of dotted ``key`` (``"zero.bucket_size"``), or ``default`` when it was not stored."""
    value = get_path(saved_tree(saved), key)
    return default if value is None else value
