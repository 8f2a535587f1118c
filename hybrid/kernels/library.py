"""hybrid's kernels as ``torch.library`` custom ops, all in one namespace.

Each op is defined once, where its Python glue lives (:mod:`hybrid.kernels.quantize`,
:mod:`hybrid.kernels.layer_norm`), through :func:`custom_op` below: one implementation for
CPU and CUDA tensors that picks the compiled op of the tensor's device from the registry
(or the torch path when it is missing), a fake implementation that gives the outputs'
shapes, dtypes and strides without running anything, and an autograd formula where the op
is differentiable. ``torch.compile`` then keeps each call as one node of its graph (no
graph break at the pybind call), and ``torch.library.opcheck`` can test the registration.
See docs/kernels.md, "Custom ops".
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

NAMESPACE = "hybrid"

# Every op defined through custom_op in this process: short name -> the op object (its
# ``torch.ops.hybrid.<name>`` overload packet is the same op). The tests opcheck each one.
REGISTERED: dict[str, torch.library.CustomOpDef] = {}


def custom_op(name: str, *, mutates_args: Iterable[str] = ()) -> Callable:
    """Decorator: define ``hybrid::<name>`` from a type-annotated function (see ``torch.library.custom_op``)."""

    def define(fn: Callable) -> torch.library.CustomOpDef:
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", fn, mutates_args=tuple(mutates_args))
        REGISTERED[name] = op
        return op

    return define
