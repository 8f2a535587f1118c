"""The communicator's accounting: the bytes each operation moved, and the time this rank spent blocked.

:meth:`Traffic.report` documents the model; :class:`hybrid.comm.Communicator`
records every operation here and answers ``report``, ``reset_stats``,
``blocked_seconds`` and ``inter_node_total`` from it. No torch: it counts
byte numbers the communicator works out.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Dict, List, Optional, Tuple

from hybrid.group_table import AxisGroups

# Wire bytes per payload byte that one rank sends in a ring collective over n ranks (Traffic.report's model).
RING_WIRE_FACTOR = {"all_reduce": lambda n: 2.0 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
                    "reduce_scatter": lambda n: (n - 1) / n}


@dataclasses.dataclass
class OpStats:
    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0
    inter_node_bytes: float = 0.0


def profiler_label(op: str, axis: str) -> str:
    """An operation's name in :meth:`Traffic.report` and its span in a profiler trace (``--profile``):
    ``"all_reduce/dp"``."""
    return f"{op}/{axis}"


class Traffic:
    """Bytes per ``(operation, axis)`` since the last :meth:`reset`; bytes sent off the node and seconds
    blocked since it was made. ``groups``: whose ranks and nodes the inter-node bytes are counted with."""

    def __init__(self, groups: AxisGroups):
        self._groups = groups
        self._stats: Dict[Tuple[str, str], OpStats] = collections.defaultdict(OpStats)
        self._inter_node_sent = 0.0
        self._blocked_s = 0.0

    def reset(self) -> None:
        self._stats.clear()

    def report(self) -> Dict[str, Dict[str, float]]:
        """Bytes moved since the last :meth:`reset`, keyed ``"op/axis"``.

        ``payload_bytes`` is the size of the buffer each call reduced or gathered
        (the full buffer, not this rank's share). ``wire_bytes`` is what one
        rank sends under a ring algorithm: ``2(n-1)/n`` of the buffer for
        all-reduce and ``(n-1)/n`` for reduce-scatter and all-gather. Under that
        model an all-reduce costs the same as a reduce-scatter plus an all-gather.
        A point-to-point ``send`` puts its whole tensor on the wire; the matching
        ``recv`` counts the payload it received and no wire bytes (the sender
        counts them), so summing wire bytes over ranks counts each byte once.

        ``inter_node_bytes`` is the part of what this rank sends that leaves
        its node (:class:`~hybrid.grid.Nodes`), as the backend moves it. The
        model: a collective is a ring in group-rank order, each rank sending to
        the next (the last to the first), so its bytes cross when the next rank
        sits on another node; a broadcast's root sends the buffer to every other
        rank; a ``send`` crosses when its peer does. A quantized reduce-scatter
        is an all-to-all: each peer receives its packed chunk straight from this
        rank, so it crosses once per peer on another node (a quantized
        all-reduce is counted as that reduce-scatter plus a ring all-gather).
        Summed over a node's ranks it is what the node's link carries.
        """
        return {profiler_label(op, axis): dataclasses.asdict(s) for (op, axis), s in sorted(self._stats.items())}

    def record(self, op: str, axis: str, nbytes: int, wire_factor: float, peer: Optional[int] = None,
               fan_out: Optional[List[int]] = None, each: Optional[int] = None,
               sends: Optional[Dict[int, int]] = None) -> None:
        """Count one operation. ``peer``: the global rank a point-to-point transfer goes to; ``fan_out``: the
        global ranks that each receive ``each`` bytes (default ``nbytes``) straight from this rank (a
        broadcast's root, every peer of an all-to-all); ``sends``: global rank -> the bytes it receives straight
        from this rank, when they differ (an all-to-all with variable splits; ``wire_factor`` is then unused)."""
        if sends is not None:
            me = self._groups.rank
            to_others = sum(b for r, b in sends.items() if r != me)
            s = self._stats[(op, axis)]
            s.calls += 1
            s.payload_bytes += nbytes
            s.wire_bytes += to_others
            nodes = self._groups.nodes
            crossing = sum(b for r, b in sends.items() if nodes.node_of(r) != nodes.node_of(me))
            s.inter_node_bytes += crossing
            self._inter_node_sent += crossing
            return
        s = self._stats[(op, axis)]
        s.calls += 1
        s.payload_bytes += nbytes
        s.wire_bytes += nbytes * wire_factor
        nodes, me = self._groups.nodes, self._groups.rank
        if fan_out is not None:
            crossing = (nbytes if each is None else each) * sum(nodes.node_of(r) != nodes.node_of(me)
                                                                for r in fan_out)
        elif peer is not None:
            crossing = nbytes * wire_factor if nodes.node_of(peer) != nodes.node_of(me) else 0.0
        else:
            crossing = nbytes * wire_factor if nodes.ring_hop_crosses(self._groups.group_ranks(axis), me) else 0.0
        s.inter_node_bytes += crossing
        self._inter_node_sent += crossing

    def inter_node_total(self) -> float:
        """Bytes this rank has sent off its node since the accounting was made (never reset)."""
        return self._inter_node_sent

    def add_blocked(self, seconds: float) -> None:
        self._blocked_s += seconds

    def blocked_seconds(self) -> float:
        """Seconds this rank's thread has spent waiting for communication since the accounting was made."""
        return self._blocked_s
