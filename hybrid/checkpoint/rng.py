"""Random-number-generator state in a form ``torch.load(weights_only=True)`` accepts.

Exact resume needs every generator a training step draws from: Python's
``random``, NumPy's legacy global generator, torch's CPU generator and, when
present, the CUDA generator of this process's current device. NumPy's state is an array, which weights_only
loading refuses, so it is stored as an int64 tensor.
"""

from __future__ import annotations

import random
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from hybrid.checkpoint.errors import CheckpointFormatError
from hybrid.layout import ParallelLayout

_KEYS = ("python", "numpy", "torch_cpu", "torch_cuda")


def capture_rng_state() -> Dict[str, Any]:
    """This process's generator states (tensors, ints, floats, lists, dicts only)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def restore_rng_state(state: Dict[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` returned (CUDA state into the current device)."""
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise CheckpointFormatError(f"RNG state lacks {missing}; it was not made by capture_rng_state")
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state((npst["kind"], npst["keys"].numpy().astype(np.uint32), npst["pos"],
                         npst["has_gauss"], npst["cached_gaussian"]))
    torch.set_rng_state(state["torch_cpu"])
    if state["torch_cuda"] is not None:
        if not torch.cuda.is_available():
            raise CheckpointFormatError("the checkpoint holds a CUDA RNG state but CUDA is not "
                                        "available; resume on a CUDA device")
        torch.cuda.set_rng_state(state["torch_cuda"])


# ---- random state across layouts -------------------------------------------------------------------------
# The model tracker's per-TP-rank dropout stream (saved under "tp/<device>"): meaningful only at the TP size
# that drew it.
PER_TP_RANK_STREAM = "tp"


def restored_rank(saved: ParallelLayout, tp_size: int, tp_rank: int, dp_rank: int,
                  pp_rank: int) -> Tuple[int, int, int]:
    """The saved rank ``(tp, dp, pp)`` whose random state rank ``(tp_rank, dp_rank, pp_rank)`` of a job with
    ``tp_size`` restores when the checkpoint was saved in layout ``saved``: the same rank where it existed,
    else rank 0 along that axis (the TP rank too when the TP size changed). A new layout has no exact
    counterpart of every saved rank: only a same-layout resume is bit-exact."""
    same_tp = saved.tp == tp_size
    return (tp_rank if same_tp else 0, dp_rank if dp_rank < saved.dp else 0, pp_rank if pp_rank < saved.pp else 0)


def tracker_streams_for(streams: Optional[Dict[str, Any]], same_tp_size: bool) -> Optional[Dict[str, Any]]:
    """The saved tracker streams (``{"stream/device": state}``) a rank restores: all of them at the TP size
    that saved them, all but the per-TP-rank stream at another (that stream then restarts from the seed)."""
    if not streams or same_tp_size:
        return streams
    return {k: v for k, v in streams.items() if k.split("/", 1)[0] != PER_TP_RANK_STREAM}
