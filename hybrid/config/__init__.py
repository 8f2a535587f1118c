"""Typed configuration: dataclasses, loaders (dict, JSON, YAML, DeepSpeed JSON), validation.

    from hybrid.config import load_config
    cfg = load_config("ds_config.json")            # native or DeepSpeed style, detected
    cfg = cfg.with_overrides({"optimizer.lr": 3e-4})
    sizes = cfg.resolve_batch(dp_size=8)

Every key and its default: ``docs/config.md``.
"""

from hybrid.config.batch import BatchSizes, resolve_batch
from hybrid.config.deepspeed import from_deepspeed
from hybrid.config.errors import ConfigError
from hybrid.config.load import is_deepspeed_style, load_config, load_config_file, read_config_file
from hybrid.config.schema import (HybridConfig, LossScalingConfig, OptimizerConfig, SchedulerConfig,
                                  TensorBoardConfig, ZeroConfig)
from hybrid.config.validate import validate

__all__ = ["HybridConfig", "LossScalingConfig", "ZeroConfig", "OptimizerConfig", "SchedulerConfig",
           "TensorBoardConfig", "ConfigError", "BatchSizes", "resolve_batch", "load_config",
           "load_config_file", "read_config_file", "from_deepspeed", "is_deepspeed_style", "validate"]
