"""Run every rank's schedule on paper: deadlocks, transfer order, idle time and in-flight micro-batches.

:func:`simulate` plays the :class:`~hybrid.pipeline.schedule.Action` lists of
all ``p`` ranks against each other the way the executor runs them: each rank
works through its list in order, sends are asynchronous, and an action starts
once its rank is free and its input has arrived (the previous part's forward,
or the next part's backward, of the same micro-batch). Costs are in arbitrary
units per action of one chunk (forward 1, backward 2 by default, divided by
the chunk count so that a rank's work per micro-batch is the same for any
``v``), times ``stage_speed[r]`` on rank ``r`` when given (stages of unequal
speed: 1.02 is a rank whose every action takes 2% longer), or each action's
own duration when ``durations`` is given (a replay of measured action times,
:attr:`~hybrid.pipeline.executor.StepStats.action_s`: the idle time those
very durations imply, their spread included). Transfers take no time.

Besides the timings it checks that the transfers from one rank to another
-- activations and gradients together, as one stream -- are sent in the order
the receiver awaits them: point-to-point messages between two ranks are
matched in order (per tag on gloo; NCCL ignores tags, so there all of them,
which at pp = 2 with interleaving carries both kinds one way), and a schedule
that broke this would silently swap micro-batches.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from hybrid.pipeline.actions import BACKWARD, FORWARD, Action


class ScheduleError(RuntimeError):
    """A schedule that would deadlock or deliver transfers out of order."""


@dataclasses.dataclass
class Simulation:
    makespan: float
    busy: List[float]          # per rank
    max_in_flight: List[int]   # per rank: most micro-batch chunks forwarded but not yet backwarded

    @property
    def idle_fraction(self) -> List[float]:
        return [1.0 - b / self.makespan for b in self.busy]


def bubble_fraction(pp: int, microbatches: int, chunks: int = 1) -> float:
    """The idle fraction of every rank under (interleaved) 1F1B or GPipe: ``(p - 1) / (v m + p - 1)``.

    Exact for the interleaved schedule when the forward and backward of a chunk take the same time per part,
    and for 1F1B and GPipe always (the stage with the most idle time has exactly this much).
    """
    return (pp - 1) / (chunks * microbatches + pp - 1)


def simulate(lists: Sequence[Sequence[Action]], chunks: int = 1, forward_cost: float = 1.0,
             backward_cost: float = 2.0, stage_speed: Optional[Sequence[float]] = None,
             durations: Optional[Sequence[Sequence[float]]] = None) -> Simulation:
    """Play ``lists[r]`` (rank ``r``'s actions) to the end; raise :class:`ScheduleError` on a deadlock or a
    transfer stream whose send and receive orders differ. ``durations[r][i]``, when given, is the time of
    ``lists[r][i]`` (and the cost model is not used)."""
    pp = len(lists)
    if durations is not None and [len(d) for d in durations] != [len(a) for a in lists]:
        raise ValueError(f"durations give {[len(d) for d in durations]} actions per rank, the schedules "
                         f"{[len(a) for a in lists]}")
    parts = pp * chunks
    scale = list(stage_speed) if stage_speed is not None else [1.0] * pp
    done: Dict[Tuple[str, int, int], float] = {}  # (kind, micro-batch, part) -> finish time
    free = [0.0] * pp
    busy = [0.0] * pp
    cursor = [0] * pp
    live = [0] * pp
    peak = [0] * pp
    sent: Dict[Tuple[int, int], List[Tuple[str, int, int]]] = {}
    awaited: Dict[Tuple[int, int], List[Tuple[str, int, int]]] = {}

    def part_of(rank: int, action: Action) -> int:
        return action.chunk * pp + rank

    for rank, actions in enumerate(lists):
        for a in actions:
            k = part_of(rank, a)
            if a.kind == FORWARD and k + 1 < parts:
                sent.setdefault((rank, (k + 1) % pp), []).append(("act", a.microbatch, k + 1))
            if a.kind == FORWARD and k > 0:
                awaited.setdefault(((k - 1) % pp, rank), []).append(("act", a.microbatch, k))
            if a.kind == BACKWARD and k > 0:
                sent.setdefault((rank, (k - 1) % pp), []).append(("grad", a.microbatch, k - 1))
            if a.kind == BACKWARD and k + 1 < parts:
                awaited.setdefault(((k + 1) % pp, rank), []).append(("grad", a.microbatch, k))
    for stream in set(sent) | set(awaited):
        if sent.get(stream, []) != awaited.get(stream, []):
            src, dst = stream
            raise ScheduleError(f"the transfers from pipeline rank {src} to {dst} are sent in the order "
                                f"{sent.get(stream, [])} but received in the order {awaited.get(stream, [])}")

    progressed = True
    while progressed:
        progressed = False
        for rank, actions in enumerate(lists):
            while cursor[rank] < len(actions):
                a = actions[cursor[rank]]
                k = part_of(rank, a)
                needs: Optional[Tuple[str, int, int]] = None
                if a.kind == FORWARD and k > 0:
                    needs = (FORWARD, a.microbatch, k - 1)
                elif a.kind == BACKWARD:
                    if (FORWARD, a.microbatch, k) not in done:
                        raise ScheduleError(f"rank {rank} runs the backward {a!r} before its forward")
                    if k + 1 < parts:
                        needs = (BACKWARD, a.microbatch, k + 1)
                if needs is not None and needs not in done:
                    break
                start = max(free[rank], done[needs] if needs else 0.0)
                if durations is not None:
                    cost = durations[rank][cursor[rank]]
                else:
                    cost = (forward_cost if a.kind == FORWARD else backward_cost) / chunks * scale[rank]
                free[rank] = start + cost
                busy[rank] += cost
                done[(a.kind, a.microbatch, k)] = free[rank]
                live[rank] += 1 if a.kind == FORWARD else -1
                peak[rank] = max(peak[rank], live[rank])
                cursor[rank] += 1
                progressed = True
    stuck = [f"rank {r} at {lists[r][cursor[r]]!r}" for r in range(pp) if cursor[r] < len(lists[r])]
    if stuck:
        raise ScheduleError("the pipeline schedule deadlocks: " + ", ".join(stuck))
    return Simulation(makespan=max(free), busy=busy, max_in_flight=peak)
