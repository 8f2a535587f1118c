"""The pieces of one rank's training run that a checkpoint is written from and read into.

:class:`TrainingParts` is what :mod:`hybrid.engine.checkpoint` and
:func:`hybrid.engine.reshard.load_resharded` are given instead of the whole
:class:`~hybrid.engine.Engine`: they read and write these objects' state,
and nothing else of the engine's.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.engine.rng import RandomState
    from hybrid.topology import Topology
    from hybrid.zero import ZeroOptimizer


@dataclasses.dataclass(frozen=True)
class TrainingParts:
    """This rank's model, its optimizer, its random generators and the topology placing them.

    ``module``: the model (this rank's TP shard and pipeline stage), its ``config`` (when it has one) the model
    description a checkpoint records; ``optimizer``: the :class:`~hybrid.zero.ZeroOptimizer` owning its
    partition of the master weights and moments; ``rng``: every generator of this rank; ``topology``: the
    rank's coordinates and the groups its collectives run over.
    """

    module: torch.nn.Module
    optimizer: "ZeroOptimizer"
    rng: "RandomState"
    topology: "Topology"

    @property
    def model_config(self):
        """The model's description (``module.config``, e.g. a :class:`model_zoo.GPTConfig`); None without one."""
        return getattr(self.module, "config", None)
