"""Build the ZeRO optimizer a configuration asks for: the one place that picks a sibling by stage."""

from __future__ import annotations

from typing import Any, Optional

import torch

from hybrid.config.schema import OptimizerConfig, ZeroConfig
from hybrid.layout import PRECISION_DTYPES, STAGE_TRAITS
from hybrid.topology import Topology
from hybrid.zero.base import ZeroOptimizer, check_zero_config
from hybrid.zero.expert_split import ExpertSplitOptimizer, has_expert_parameters
from hybrid.zero.flat import FlatZeroOptimizer
from hybrid.zero.stage3 import Stage3Optimizer


def build_zero_optimizer(model: torch.nn.Module, topology: Topology, zero: Optional[ZeroConfig] = None,
                         optimizer: Optional[OptimizerConfig] = None, **runtime: Any) -> ZeroOptimizer:
    """The ZeRO optimizer of ``model`` over ``topology``'s DP group, for the ``zero`` and ``optimizer`` sections.

    A stage that partitions the parameters gets :class:`~hybrid.zero.stage3.Stage3Optimizer`;
    the others :class:`~hybrid.zero.flat.FlatZeroOptimizer`. A model with expert parameters under expert
    parallelism (``topology.ep_size > 1``) gets :class:`~hybrid.zero.expert_split.ExpertSplitOptimizer`, one
    of those over the dense parameters and ``dp`` and one over the experts and ``edp``. ``runtime`` holds the engine's
    run-time choices (``loss_scaler``, ``clip_grad``, ``gradient_accumulation_steps``,
    ``no_weight_decay``, ``use_fused_kernels``, ``master_dtype``; for stage 3 also
    ``verify_order`` and ``partition_init``). Sections default to the config's defaults.
    """
    zero = zero if zero is not None else ZeroConfig()
    optimizer = optimizer if optimizer is not None else OptimizerConfig()
    stage = check_zero_config(zero)
    # zero.master_precision: the masters' dtype, and so the optimizer state's (an explicit master_dtype wins)
    runtime.setdefault("master_dtype", getattr(torch, PRECISION_DTYPES[zero.master_precision]))
    if topology.ep_size > 1 and has_expert_parameters(model):
        # experts reduce and partition over edp, the rest over dp (at ep = 1 edp is dp: one optimizer does)
        return ExpertSplitOptimizer(model, topology, zero, optimizer, **runtime)
    cls = Stage3Optimizer if STAGE_TRAITS[stage].parameters else FlatZeroOptimizer
    return cls(model, topology, zero, optimizer, **runtime)
