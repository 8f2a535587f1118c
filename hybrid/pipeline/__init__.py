"""Pipeline parallelism: stage splits, schedules (GPipe, 1F1B, interleaved 1F1B) and their executor.

* :mod:`hybrid.pipeline.split`: which layers each stage builds (uneven splits allowed);
* :mod:`hybrid.pipeline.schedule` and one module per schedule: the order of work on each rank;
* :mod:`hybrid.pipeline.simulate`: those orders played against each other (deadlocks, bubble, memory);
* :mod:`hybrid.pipeline.executor`: runs one step, moving activations and gradients over the ``"pp"`` axis;
* :mod:`hybrid.pipeline.stage_compute`: what the executor calls for the computation of one part.
"""

from hybrid.pipeline.executor import PipelineExecutor, StepStats
from hybrid.pipeline.actions import Action
from hybrid.pipeline.simulate import ScheduleError, bubble_fraction, simulate
from hybrid.pipeline.stage_compute import AutogradStage, StageCompute
from hybrid.pipeline.split import StageSplit, balanced_layer_counts, split_layers

__all__ = ["Action", "AutogradStage", "PipelineExecutor", "ScheduleError", "StageCompute", "StageSplit", "StepStats",
           "balanced_layer_counts", "bubble_fraction", "simulate", "split_layers"]
