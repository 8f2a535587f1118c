"""hybrid: tensor-model parallelism and the ZeRO optimizer for pretraining large language models."""

from hybrid.distributed import DistInfo, DistributedEnvError, init_distributed
from hybrid.topology import Grid, Topology, TopologyError

__all__ = ["init_distributed", "DistInfo", "DistributedEnvError", "Topology", "Grid", "TopologyError",
           "initialize"]

__version__ = "0.1.0"


def initialize(model, config=None, topology=None, **kwargs):
    """Wrap ``model`` in a training engine (ZeRO, mixed precision, clipping, schedule).

    See :func:`hybrid.engine.initialize`.
    """
    from hybrid.engine import initialize as _initialize

    return _initialize(model, config, topology=topology, **kwargs)
