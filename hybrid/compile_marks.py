"""Marks for ``torch.compile`` that do not import ``torch._dynamo`` until something compiles.

``torch.compiler.disable`` and ``torch.compiler.assume_constant_result`` import ``torch._dynamo`` as they
decorate: about 70 MB of resident memory and 0.75 s per process here, paid by every rank of every job at import
although most jobs never compile. hybrid marks its functions at import time, so its marks wait:

* :func:`eager`: ``fn`` runs eagerly inside a compiled region, nothing beneath it traced, one graph break
  (``torch.compiler.disable``). While no ``torch._dynamo`` is loaded in the process nothing can be tracing, and
  ``fn`` is called directly; once it is, through ``torch.compiler.disable(fn)``.
* :func:`constant_result`: ``assume_constant_result``'s mark, the attribute dynamo reads
  (``torch/_dynamo/decorators.py``), set without importing dynamo.

:func:`prepare` must run before the first ``torch.compile`` over hybrid code (``model_zoo.compile.compile_blocks``
calls it): it makes each marked function's disabled twin, so a trace sees fixed state, and tells dynamo never to
compile the wrappers' own frame (a frame dynamo compiles would be specialised on the function it wraps: a
recompile per marked function until dynamo's limit).
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Callable, List, Tuple, TypeVar

import torch

F = TypeVar("F", bound=Callable)

_DYNAMO = "torch._dynamo"
# (function, its disabled twin once made) of every eager() mark: prepare() makes the twins before anything traces.
# Marks are made at import (module-level functions and methods), so the list is as long as the marked code.
_MARKED: List[Tuple[Callable, List[Callable]]] = []


def _twin(fn: Callable, disabled: List[Callable]) -> Callable:
    """``fn``'s ``torch.compiler.disable`` twin, made into ``disabled`` the first time."""
    if not disabled:
        disabled.append(torch.compiler.disable(fn))
    return disabled[0]


def eager(fn: F) -> F:
    """``fn`` wrapped to run eagerly under ``torch.compile`` (see the module docstring); a method decorator too."""
    disabled: List[Callable] = []  # torch.compiler.disable(fn), once made

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if _DYNAMO not in sys.modules:  # nothing has compiled in this process, so nothing is tracing
            return fn(*args, **kwargs)
        return _twin(fn, disabled)(*args, **kwargs)

    _MARKED.append((fn, disabled))
    return run  # type: ignore[return-value]


def constant_result(fn: F) -> F:
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does: called once while tracing, its result a
    constant of the graph."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


_RUN_CODE = next(c for c in eager.__code__.co_consts if isinstance(c, types.CodeType) and c.co_name == "run")


def prepare() -> None:
    """Before compiling hybrid code: every marked function's disabled twin made, the wrappers' frame never
    compiled. Idempotent; imports ``torch._dynamo``."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(_RUN_CODE)
    for fn, disabled in _MARKED:
        _twin(fn, disabled)
