"""TP-aware random streams for dropout, and recomputation that replays them.

An :class:`RNGTracker` belongs to one model (no module-level state). It holds
two named streams, each a saved generator state per device type:

* ``"tp"``: seeded per TP rank. Dropout on TP-partitioned activations (the
  attention probabilities, split by heads) and on sequence-parallel shards
  uses it, so different ranks drop different elements.
* ``"shared"``: the same on every TP rank. Dropout on replicated activations
  uses it, so every TP rank drops the same elements and the replicas stay
  identical.

``with tracker.fork("tp", device): ...`` swaps the stream into the device's
default generator (the one ``F.dropout`` and ``F.scaled_dot_product_attention``
draw from), runs the block, saves the advanced stream and puts the previous
default state back.

:func:`checkpoint` recomputes a function in the backward pass with the same
tracker streams (and default generator) it saw in the forward pass, so
recomputed dropout masks are identical.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import TYPE_CHECKING, Dict, Iterator, Tuple

import torch
import torch.utils.checkpoint

from hybrid.compile_marks import eager

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.topology import Topology

STREAMS = ("tp", "shared")

_Key = Tuple[str, str]  # (stream, device string)


def _stream_seed(seed: int, stream: str, topology: "Topology") -> int:
    # Pipeline stages hold different layers, so they get different streams too.
    rank_part = f"tp{topology.tp_rank}" if stream == "tp" else "shared"
    text = f"{seed}:dropout:{stream}:{rank_part}:pp{topology.pp_rank}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def _device_key(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _get_default_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    if device.type == "cpu":
        return torch.get_rng_state()
    raise ValueError(f"dropout random streams support cpu and cuda devices, not {device}")


def _set_default_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Per-model dropout streams: ``"tp"`` (differs per TP rank) and ``"shared"`` (same on all TP ranks)."""

    def __init__(self, seed: int, topology: "Topology"):
        self.seed = int(seed)
        self._seeds = {s: _stream_seed(self.seed, s, topology) for s in STREAMS}
        self._states: Dict[_Key, torch.Tensor] = {}
        # True while a checkpointed call is recomputed in backward: what a forward counts (an MoE layer's routing
        # statistics) is counted once, in the forward pass
        self.recomputing = False

    def _initial_state(self, stream: str, device: torch.device) -> torch.Tensor:
        gen = torch.Generator(device=device)
        gen.manual_seed(self._seeds[stream])
        return gen.get_state()

    @contextlib.contextmanager
    def fork(self, stream: str, device="cpu") -> Iterator[None]:
        """Run the block with ``stream`` as ``device``'s default generator."""
        if stream not in STREAMS:
            raise ValueError(f"unknown random stream {stream!r}; expected one of {', '.join(STREAMS)}")
        device = _device_key(device)
        key = (stream, str(device))
        state = self._states.get(key)
        if state is None:
            state = self._initial_state(stream, device)
        outer = _get_default_state(device)
        _set_default_state(device, state)
        try:
            yield
        finally:
            self._states[key] = _get_default_state(device)
            _set_default_state(device, outer)

    def get_states(self) -> Dict[_Key, torch.Tensor]:
        """A snapshot of every stream's state (copies)."""
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: Dict[_Key, torch.Tensor]) -> None:
        """Restore a snapshot from :meth:`get_states`; streams absent from it restart from the seed."""
        self._states = {k: v.clone() for k, v in states.items()}


def _replay_contexts(tracker: RNGTracker):
    """Context managers for the forward pass and for the recompute of one checkpointed call."""
    captured: Dict[str, Dict[_Key, torch.Tensor]] = {}

    @contextlib.contextmanager
    def forward_ctx():
        captured["states"] = tracker.get_states()
        yield

    @contextlib.contextmanager
    def recompute_ctx():
        # By backward time the streams have moved on (later layers drew from them):
        # replay from the forward-time snapshot, then put the current states back.
        current = tracker.get_states()
        tracker.set_states(captured["states"])
        tracker.recomputing = True
        try:
            yield
        finally:
            tracker.recomputing = False
            tracker.set_states(current)

    return forward_ctx(), recompute_ctx()


# torch.compile's checkpoint operator takes no RNG-replay context: a compiled block (model_zoo.compile) runs this
# checkpoint eagerly, as one graph break; a compiled block checkpointed whole (full recompute) still runs compiled.
@eager
def checkpoint(function, *args, tracker: RNGTracker, **kwargs):
    """``function(*args, **kwargs)`` without keeping its activations; recomputed in backward.

    The recompute sees the default generators and the ``tracker`` streams as
    they were in the forward pass, so dropout inside ``function`` draws the
    same masks. Collectives inside ``function`` run again during backward, in
    the same order on every rank.
    """
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True,
        context_fn=lambda: _replay_contexts(tracker), **kwargs)
