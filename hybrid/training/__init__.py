"""The pretraining driver: settings, the training loop, checkpoints and text generation.

    from hybrid.training import Trainer, parse_args, validate
    config = parse_args(argv)                 # a hybrid.config.HybridConfig
    validate(config, world_size=4)
    Trainer(config).train()

Names are imported on first use, so that reading settings does not import torch.
"""

import importlib

_EXPORTS = {
    "parse_args": "hybrid.training.cli",
    "validate": "hybrid.training.cli",
    "Trainer": "hybrid.training.trainer",
    "main": "hybrid.training.trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hybrid.training' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__():
    return __all__
