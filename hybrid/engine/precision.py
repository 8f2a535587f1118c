"""How the engine brings a model to its training precision.

Two paths, chosen by the config key ``autocast``:

* ``autocast: false`` (default): the ZeRO mixed-precision path. The engine
  casts an fp32 model's floating-point parameters and buffers to bf16/fp16
  once; forward, backward and the gradients run in that dtype, and the
  optimizer keeps fp32 master weights. This is what saves memory (2 bytes per
  parameter for weights and gradients) and what DeepSpeed's ``bf16``/``fp16``
  sections do. A model already in the target dtype is used as is.
* ``autocast: true``: parameters and gradients stay fp32 (so do the master
  weights, which alias them) and forward runs under ``torch.autocast``, which
  picks bf16/fp16 per operation. Numerically safest, no memory saving.

With ``precision: fp32`` every floating parameter must be fp32.
"""

from __future__ import annotations

from typing import Optional

import torch

from hybrid.config.errors import ConfigError
from hybrid.dtypes import DTYPES, dtype_name
from hybrid.layout import precision_traits


def _first_param_not(model: torch.nn.Module, allowed) -> Optional[tuple]:
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype not in allowed:
            return name, p.dtype
    return None


def prepare_precision(model: torch.nn.Module, precision: str, autocast: bool) -> Optional[torch.dtype]:
    """Cast ``model`` in place if the config asks for it; return the autocast dtype (None: no autocast).

    What is cast to what is :func:`hybrid.layout.precision_traits`'s rule (the ZeRO stages then allocate their
    gradient stores in the parameters' dtype, the traits' ``grads``)."""
    target = DTYPES[precision]
    traits = precision_traits(precision, autocast)
    if traits.params == "fp32":
        bad = _first_param_not(model, (torch.float32,))
        if bad is not None:
            name, dtype = bad
            why = ("'autocast' is true, which keeps parameters in fp32" if autocast
                   else "'precision' is fp32")
            raise ConfigError(f"parameter '{name}' is {dtype_name(dtype)} but {why}; pass an fp32 model "
                              f"(model.float()) or set precision to {dtype_name(dtype)} with autocast false")
        return None if precision == "fp32" else target
    bad = _first_param_not(model, (torch.float32, target))
    if bad is not None:
        name, dtype = bad
        raise ConfigError(f"parameter '{name}' is {dtype_name(dtype)} but 'precision' is {precision}; pass an "
                          f"fp32 or {precision} model, or set precision to {dtype_name(dtype)}")
    # Parameters and floating-point buffers alike (traits.params, traits.buffers); the Parameter objects (and
    # their TP metadata) are kept, only their data changes.
    model.to(dtype=DTYPES[traits.params])
    return None
