"""hybrid: tensor-model parallelism and the ZeRO optimizer for pretraining large language models.

Names are imported on first use, so that tools which need only numpy (data
preprocessing) start without importing torch.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "init_distributed": "hybrid.distributed",
    "DistInfo": "hybrid.distributed",
    "DistributedEnvError": "hybrid.distributed",
    "Topology": "hybrid.topology",
    "Grid": "hybrid.topology",
    "TopologyError": "hybrid.topology",
}

__all__ = sorted(_EXPORTS) + ["initialize"]


def initialize(model, config=None, topology=None, **kwargs):
    """Wrap ``model`` in a training engine (ZeRO, mixed precision, clipping, schedule).

    See :func:`hybrid.engine.initialize`.
    """
    from hybrid.engine import initialize as _initialize

    return _initialize(model, config, topology=topology, **kwargs)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hybrid' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
