"""The pretraining driver: settings, the training loop, checkpoints and text generation.

    from hybrid.training import Trainer, parse_args, validate
    config = parse_args(argv)                 # a hybrid.config.HybridConfig
    validate(config, world_size=4)
    Trainer(config).train()

Names are imported on first use, so that reading settings does not import torch.
"""

from hybrid.lazy_exports import lazy_exports

_EXPORTS = {
    "parse_args": "hybrid.training.cli",
    "validate": "hybrid.training.cli",
    "Trainer": "hybrid.training.trainer",
    "main": "hybrid.training.trainer",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
