"""``--profile``: a torch.profiler trace of chosen iterations on chosen ranks (Megatron-LM's flags).

Iterations ``[--profile-step-start, --profile-step-end)``, numbered as the log line numbers them (a resumed run
continues the count), are traced on the global ranks ``--profile-ranks`` (default ``[0]``). Each traced rank
writes one Chrome trace JSON, ``rank{R}.<time>.pt.trace.json``, into ``--tensorboard-dir`` through
``torch.profiler.tensorboard_trace_handler``: TensorBoard's profiler plugin, Perfetto (ui.perfetto.dev) and
``chrome://tracing`` open it. Iteration ``N`` is the span ``ProfilerStep#N``; every collective and transfer of
the communicator is a span ``{op}/{axis}`` (``all_reduce/dp``, ``reduce_scatter/dp``, ``send to rank 1/pp``;
:func:`hybrid.comm_accounting.profiler_label`), around the call that launches it and around each wait for it.

The profiler follows torch's schedule: the iteration before the first traced one warms it up (when the run
has it), the traced ones record, and the trace is written once the last traced iteration ends (or when
training stops before it). Tracing costs time (CPU ops and their input shapes are recorded): the traced
iterations are slower than the rest, and the ``run profile`` line's medians include them.
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence

import torch

from hybrid.config.errors import ConfigError, one_error_for_all
from hybrid.config.flags import key_error
from hybrid.config.schema import HybridConfig
from hybrid.monitor.wandb_writer import wandb_problem


def settings_problems(config: HybridConfig, world_size: int) -> List[ConfigError]:
    """What makes ``--profile`` or ``--wandb-project`` impossible in a world of ``world_size`` ranks: the trace's
    window or ranks, a trace folder, the ``wandb`` package."""
    log = config.logging
    problems: List[ConfigError] = []
    missing = wandb_problem(log.wandb_project)
    if missing:
        problems.append(key_error(HybridConfig, missing, "logging.wandb_project"))
    if not log.profile:
        return problems
    if log.profile_step_end <= log.profile_step_start:
        problems.append(key_error(HybridConfig, f"logging.profile traces iterations [profile_step_start, "
                                                f"profile_step_end) = [{log.profile_step_start}, "
                                                f"{log.profile_step_end}), which holds none; give an end above the "
                                                f"start", "logging.profile_step_start", "logging.profile_step_end"))
    outside = [r for r in log.profile_ranks if not 0 <= r < world_size]
    if outside or not log.profile_ranks:
        problems.append(key_error(HybridConfig, f"logging.profile_ranks {log.profile_ranks}: give global ranks of "
                                                f"this job, 0 to {world_size - 1}", "logging.profile_ranks"))
    if log.tensorboard_dir is None:
        problems.append(key_error(HybridConfig, "logging.profile writes its traces into logging.tensorboard_dir: "
                                                "give one", "logging.profile", "logging.tensorboard_dir"))
    return problems


def check_settings(config: HybridConfig, world_size: int) -> None:
    """Raise one :class:`~hybrid.config.ConfigError` naming every problem of :func:`settings_problems`."""
    problems = settings_problems(config, world_size)
    if problems:
        raise one_error_for_all(problems, "config keys")


class TorchProfiler:
    """The trace of iterations ``[start, end)`` on this rank, when ``rank`` is in ``ranks`` (else it does nothing).

    Call :meth:`step` with each iteration's number just before the iteration runs, and :meth:`close` when
    training stops (it writes the trace of a window training left early; a second call does nothing).
    ``first_iteration``: the iteration the run starts after (a resumed run's checkpoint iteration).
    """

    def __init__(self, *, start: int, end: int, ranks: Sequence[int], rank: int, trace_dir: Optional[str],
                 first_iteration: int = 0):
        self.start, self.end = start, end
        self.trace_dir = trace_dir
        # nothing to do on a rank not asked for, or when the run starts past the window
        self.enabled = rank in ranks and trace_dir is not None and first_iteration + 1 < end
        self._prof: Optional[torch.profiler.profile] = None
        if not self.enabled:
            return
        os.makedirs(trace_dir, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(
            activities=activities, schedule=self._action, record_shapes=True,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir, worker_name=f"rank{rank}"))
        # The profiler counts its steps from 0 and names them ProfilerStep#<count>; starting the count at the
        # iteration before this run's first makes the names the log line's iteration numbers.
        self._prof.step_num = first_iteration
        self._prof.start()

    def _action(self, iteration: int) -> "torch.profiler.ProfilerAction":
        """torch's schedule, by iteration number: warm up one iteration before the window, record inside it,
        and save at its last iteration."""
        actions = torch.profiler.ProfilerAction
        if iteration == self.start - 1:
            return actions.WARMUP
        if self.start <= iteration < self.end - 1:
            return actions.RECORD
        return actions.RECORD_AND_SAVE if iteration == self.end - 1 else actions.NONE

    def step(self, iteration: int) -> None:
        """Iteration ``iteration`` starts now (the previous one has ended)."""
        if self._prof is None:
            return
        if self._prof.step_num != iteration - 1:
            raise RuntimeError(f"TorchProfiler.step({iteration}) after iteration {self._prof.step_num}: call it once "
                               f"per iteration, in order")
        self._prof.step()
        if iteration >= self.end:  # the window's trace was written by this step: nothing more to record
            self.close()

    def close(self) -> None:
        """Stop profiling, writing the trace of a window still open."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()
