"""When to stop early: SIGTERM/SIGINT (preemption, a SLURM time limit), --exit-interval, --exit-duration-in-mins.

Every rank must take the same decision, or the ranks that stop would leave the
others blocked in a collective: each check reduces the local reasons over the
whole world (one tiny all-reduce per iteration).
"""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Iterator, Optional

import torch

_REASONS = ("", "received a termination signal", "reached --exit-interval", "reached --exit-duration-in-mins")


class ExitConditions:
    def __init__(self, exit_interval: Optional[int], exit_duration_in_mins: Optional[float]):
        self.exit_interval = exit_interval
        self.deadline = time.monotonic() + exit_duration_in_mins * 60 if exit_duration_in_mins else None
        self.signalled: Optional[int] = None
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        # Only note it: the loop saves at the end of the current iteration, when the state is consistent.
        self.signalled = signum

    @contextlib.contextmanager
    def signals_end_the_process(self) -> Iterator[None]:
        """Inside, SIGTERM and SIGINT act as they did before training (SIGTERM ends the process at once).

        For the rendezvous: a rank waiting there has nothing to save and no peer to tell, and the wait is
        one blocking call that a noting handler would only run after, so a stopped job would wait out the
        whole rendezvous timeout.
        """
        noting = {sig: signal.signal(sig, previous) for sig, previous in self._previous.items()}
        try:
            yield
        finally:
            for sig, handler in noting.items():
                signal.signal(sig, handler)

    def check(self, iteration: int, topology) -> Optional[str]:
        """The reason to stop after ``iteration``, agreed by every rank, or None to go on."""
        code = 0
        if self.signalled is not None:
            code = 1
        elif self.exit_interval and iteration % self.exit_interval == 0:
            code = 2
        elif self.deadline is not None and time.monotonic() >= self.deadline:
            code = 3
        flag = torch.tensor([float(code)], device=topology.device)
        topology.comm.all_reduce(flag, "world", op="max")
        return _REASONS[int(flag.item())] or None

    def restore(self) -> None:
        """Put back the signal handlers that were installed before training."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
