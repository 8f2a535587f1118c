"""Where a run's iterations went: compute, exposed communication, and memory, as one closing line.

Every iteration is timed on every rank together with the time the rank spent
blocked in communication (:meth:`hybrid.comm.Communicator.blocked_seconds`):
what the backward pass did not hide. The first iteration of a run is left out
of the medians (it builds buffers and warms caches), and so are the AdamW
warm-up steps of ``onebit_adam`` (:func:`steady_state_start`): the medians
describe the steady state. At the end rank 0 prints

``run profile: {"iterations_measured": ..., "iteration_ms_median": ..., "exposed_comm_ms_median": ...,
"compute_ms_median": ..., "peak_rss_mib": [one per global rank]}``

``iteration_ms_median`` is rank 0's; ``exposed_comm_ms_median`` is each rank's
median over iterations, averaged over ranks; ``compute_ms_median`` is their
difference. Benchmarks parse this line.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from typing import List, Optional

from hybrid.compression import ONEBIT_ADAM

PROFILE_PREFIX = "run profile: "
WARMUP_ITERATIONS = 1  # left out of the medians


def steady_state_start(optimizer_type: str, freeze_step: int, first_iteration: int = 0) -> int:
    """Iterations a run that starts after ``first_iteration`` leaves out of its profile: its first, and under
    1-bit Adam what is left of the uncompressed warm-up (the first compressed step is ``freeze_step + 1``)."""
    if optimizer_type != ONEBIT_ADAM:
        return WARMUP_ITERATIONS
    return max(WARMUP_ITERATIONS, freeze_step - first_iteration)


def peak_rss_mib() -> float:
    """This process's peak resident set size in MiB (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0


class StepProfile:
    """Per-iteration wall time and blocked-communication time of this rank."""

    def __init__(self, comm, skip: int = WARMUP_ITERATIONS):
        self._comm = comm
        self.skip = skip  # iterations left out of the medians
        self.iteration_s: List[float] = []
        self.blocked_s: List[float] = []
        self._start: Optional[float] = None
        self._blocked_start = 0.0

    def begin(self) -> None:
        self._start = time.perf_counter()
        self._blocked_start = self._comm.blocked_seconds()

    def end(self) -> None:
        if self._start is None:
            return
        self.iteration_s.append(time.perf_counter() - self._start)
        self.blocked_s.append(self._comm.blocked_seconds() - self._blocked_start)
        self._start = None

    def _measured(self, values: List[float]) -> List[float]:
        return values[self.skip:] if len(values) > self.skip else values

    def summary(self) -> Optional[dict]:
        """The profile over every rank (collective over the world: every rank must call it); None if no
        iteration ran. Only rank 0's figures are complete."""
        mine = {"blocked": statistics.median(self._measured(self.blocked_s)) if self.blocked_s else None,
                "rss": peak_rss_mib()}
        everyone = self._comm.all_gather_object(mine, "world")
        if not self.iteration_s or any(r["blocked"] is None for r in everyone):
            return None
        iteration = statistics.median(self._measured(self.iteration_s))
        exposed = statistics.fmean(r["blocked"] for r in everyone)
        return {"iterations_measured": len(self._measured(self.iteration_s)),
                "iteration_ms_median": round(1e3 * iteration, 3),
                "exposed_comm_ms_median": round(1e3 * exposed, 3),
                "compute_ms_median": round(1e3 * max(0.0, iteration - exposed), 3),
                "peak_rss_mib": [round(r["rss"], 1) for r in everyone]}


def profile_line(summary: dict) -> str:
    return PROFILE_PREFIX + json.dumps(summary, sort_keys=True)
