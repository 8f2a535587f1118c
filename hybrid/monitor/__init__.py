"""Training monitoring: console lines, TensorBoard events and W&B, TFLOP/s, MFU and memory.

* :class:`TrainingMonitor` - what the trainer calls every iteration;
* :class:`ScalarStream` - what is logged, handed the same to each sink (:class:`TensorBoardSink`,
  ``hybrid.monitor.wandb_writer.WandbSink``);
* :func:`resolve_peak_flops`, :class:`MatmulProbe` - the peak MFU refers to;
* :func:`read_memory_stats` - CUDA allocator or process RSS;
* :class:`MoELayerReport` - an MoE layer's routing over a log interval (:mod:`hybrid.monitor.moe`).

See ``docs/monitoring.md``.
"""

from hybrid.monitor.flops import (MatmulProbe, PeakFlops, model_flops_utilization,
                                  resolve_peak_flops, table_peak_tflops, tflops_per_device)
from hybrid.monitor.interval import IntervalAccumulator, IntervalSummary, IterationMetrics
from hybrid.monitor.memory import MemoryStats, read_memory_stats
from hybrid.monitor.moe import (MOE_LAYER_FIELDS, MOE_TOTAL_TAGS, MoELayerReport, collapse_threshold,
                                moe_layer_tag)
from hybrid.monitor.scalars import CHECKPOINT_TAGS, HPARAMS_TAG, TEST_TAGS, TRAIN_TAGS, VALID_TAGS, ScalarStream
from hybrid.monitor.tensorboard_writer import TensorBoardSink, TensorBoardWriter
from hybrid.monitor.training_monitor import TrainingMonitor

__all__ = [
    "TrainingMonitor", "IterationMetrics", "IntervalSummary", "IntervalAccumulator",
    "PeakFlops", "MatmulProbe", "resolve_peak_flops", "table_peak_tflops", "tflops_per_device",
    "model_flops_utilization", "MemoryStats", "read_memory_stats", "TensorBoardWriter",
    "TensorBoardSink", "ScalarStream",
    "TRAIN_TAGS", "VALID_TAGS", "TEST_TAGS", "CHECKPOINT_TAGS", "HPARAMS_TAG",
    "MoELayerReport", "collapse_threshold", "moe_layer_tag", "MOE_LAYER_FIELDS", "MOE_TOTAL_TAGS",
]
