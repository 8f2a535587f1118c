"""The random state a training step draws from, as one component that saves and loads itself.

Two kinds of generator: the process-wide ones (Python, NumPy, torch CPU and
CUDA; :mod:`hybrid.checkpoint.rng`) and the model's tensor-parallel streams
(``model.rng_tracker`` of model_zoo models: a stream shared by the TP group
and one per TP rank, for dropout).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from hybrid.checkpoint import capture_rng_state, restore_rng_state
from hybrid.checkpoint.rng import tracker_streams_for


class RandomState:
    """Captures and restores every generator of this rank (``state_dict`` / ``load_state_dict``)."""

    def __init__(self, module: torch.nn.Module):
        self._tracker = getattr(module, "rng_tracker", None)

    def state_dict(self) -> Dict[str, Any]:
        # Keys as "stream/device" strings: checkpoint files hold only weights_only-safe types.
        streams = None
        if self._tracker is not None:
            streams = {f"{stream}/{dev}": t for (stream, dev), t in self._tracker.get_states().items()}
        return {"rng": capture_rng_state(), "tp_rng": streams}

    def load_state_dict(self, state: Dict[str, Any], *, same_tp_size: bool = True) -> None:
        """Restore a :meth:`state_dict`. ``same_tp_size=False`` (another layout's state) keeps this run's
        per-TP-rank dropout stream, which has no counterpart at another TP size."""
        rng = dict(state["rng"])
        if rng.get("torch_cuda") is not None and not torch.cuda.is_available():
            rng["torch_cuda"] = None  # saved on a GPU, resumed without one: nothing to restore it into
        restore_rng_state(rng)
        streams: Optional[dict] = tracker_streams_for(state.get("tp_rng"), same_tp_size)
        if self._tracker is None or not streams:
            return
        self._tracker.set_states({tuple(k.split("/", 1)): t for k, t in streams.items()})
