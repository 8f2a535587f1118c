"""Typed configuration: one dataclass tree for a whole run, its loaders, flags and validation.

    from hybrid.config import apply_overrides, load_config
    cfg = load_config("ds_config.json")            # native or DeepSpeed style, detected
    cfg = apply_overrides(cfg, {"optimizer.lr": 3e-4})
    sizes = cfg.resolve_batch(dp_size=8)

    from hybrid.config import config_from_command_line
    cfg = config_from_command_line(["--zero-stage", "3", "--bf16"])   # hybrid-train's flags

Every key, its flag and its default: ``docs/config.md``. This package imports
nothing of hybrid's runtime (only :mod:`hybrid.layout`), so configurations can
be checked without torch.
"""

from hybrid.config.batch import BatchSizes, resolve_batch
from hybrid.config.cli import build_parser, config_from_command_line
from hybrid.config.deepspeed import deepspeed_settings, from_deepspeed
from hybrid.config.derive import derive_for_training
from hybrid.config.errors import ConfigError
from hybrid.config.load import is_deepspeed_style, load_config, load_config_file, read_config_file
from hybrid.config.parse import apply_overrides, config_from_dict, to_plain
from hybrid.config.saved import saved_setting, saved_tree
from hybrid.config.schema import (CheckpointConfig, DataConfig, DistributedConfig, EvalConfig, HybridConfig,
                                  LoggingConfig, LossScalingConfig, ModelConfig, OptimizerConfig, RunConfig,
                                  SchedulerConfig, TensorBoardConfig, ZeroConfig)
from hybrid.config.validate import validate, validate_for_training, validate_world

__all__ = ["HybridConfig", "LossScalingConfig", "ZeroConfig", "OptimizerConfig", "SchedulerConfig",
           "TensorBoardConfig", "ModelConfig", "DataConfig", "CheckpointConfig", "RunConfig", "EvalConfig",
           "LoggingConfig", "DistributedConfig", "ConfigError", "BatchSizes", "resolve_batch", "load_config",
           "load_config_file", "read_config_file", "config_from_dict", "apply_overrides", "to_plain",
           "from_deepspeed", "deepspeed_settings", "is_deepspeed_style",
           "validate", "validate_world", "validate_for_training", "derive_for_training", "build_parser",
           "config_from_command_line", "saved_setting", "saved_tree"]
