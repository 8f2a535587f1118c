"""hybrid: tensor-model parallelism and the ZeRO optimizer for pretraining large language models.

Names are imported on first use, so that tools which need only numpy (data
preprocessing) start without importing torch.
"""

from hybrid.lazy_exports import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "init_distributed": "hybrid.distributed",
    "DistInfo": "hybrid.distributed",
    "DistributedEnvError": "hybrid.distributed",
    "Topology": "hybrid.topology",
    "Grid": "hybrid.grid",
    "TopologyError": "hybrid.grid",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS, eager=["initialize"])


def initialize(model, config=None, topology=None, **kwargs):
    """Wrap ``model`` in a training engine (ZeRO, mixed precision, clipping, schedule).

    See :func:`hybrid.engine.initialize`.
    """
    from hybrid.engine import initialize as _initialize

    return _initialize(model, config, topology=topology, **kwargs)

