"""What ``--load`` names when it is not a hybrid checkpoint: a file of one, a Hugging Face model, nothing.

A run that meant to continue from weights must never quietly train from
random ones instead. The rules, in the order the trainer applies them:

* a *file* inside a save folder (``DIR/latest``, ``DIR/iter_N/metadata.json``)
  is refused, naming the folder to give (:func:`file_instead_of_folder`);
* a folder holding a Hugging Face model (``config.json`` and its weights) is
  refused with how to import it (:func:`is_hf_model_folder`, :data:`HF_FOLDER`);
* ``--finetune`` (and ``--skip-train``) with nothing to load is refused;
* otherwise an empty ``--load`` starts from scratch, quietly only where it is
  also the ``--save`` folder (:func:`same_folder`: the first launch of a job
  that saves and resumes in one place), with a warning anywhere else.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from hybrid.checkpoint import LATEST_FILE, METADATA_FILE
from hybrid.checkpoint.layout import parse_iteration_dir_name

HF_FOLDER = "this is a Hugging Face model folder; import it with `tools/convert_checkpoint.py from-hf`"
# what save_pretrained writes: model.safetensors (or shards with their index), pytorch_model.bin (or shards)
_HF_WEIGHTS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model*.bin.index.json")


def same_folder(a: Optional[str], b: Optional[str]) -> bool:
    """Whether two path settings (``--load``, ``--save``) name one folder (both set, compared absolute)."""
    return a is not None and b is not None and os.path.abspath(a) == os.path.abspath(b)


def is_hf_model_folder(path) -> bool:
    """Whether ``path`` is a directory holding a Hugging Face model: its ``config.json`` and weight files."""
    path = Path(path)
    return (path / "config.json").is_file() and any(
        next(path.glob(pattern), None) is not None for pattern in _HF_WEIGHTS)


def hf_model_message(load: str) -> str:
    """The refusal of a ``--load`` that is a Hugging Face model folder, with the import command."""
    return (f"{load} holds no hybrid checkpoint: {HF_FOLDER} (--input {load} --save DIR), then train with --load DIR "
            f"--finetune")


def file_instead_of_folder(load: str) -> Optional[str]:
    """The refusal of a ``--load`` that names a file where a folder is meant, with the folder to give; None
    when ``load`` is no such file."""
    path = Path(load)
    if not path.is_file():
        return None
    if path.name == LATEST_FILE:
        return (f"{load} is the file that names a save folder's latest checkpoint; give the folder: --load "
                f"{path.parent} (it resumes the iteration {LATEST_FILE} names)")
    if parse_iteration_dir_name(path.parent.name) is not None:
        # DIR/iter_N/metadata.json, or any other file of one iteration
        what = "the manifest" if path.name == METADATA_FILE else "a file"
        return (f"{load} is {what} of the checkpoint {path.parent}; give its save folder, --load "
                f"{path.parent.parent} (its {LATEST_FILE}), or --load {path.parent} for that iteration")
    return f"{load} is a file; --load takes a save folder (DIR, its {LATEST_FILE}) or one iteration's (DIR/iter_N)"
