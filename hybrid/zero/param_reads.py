"""Every attribute read of a watched parameter (``module.weight``) reported to a watcher, whichever code reads it.

``nn.Module.__getattr__`` serves a parameter from the module's ``_parameters``
dict, so replacing that dict by :class:`_WatchedParameters` sees every read
of the form ``module.weight``: inside the module's own forward, and outside
it (a tied embedding's weight read by the LM head, a position table read by
its parent, a user reading a weight between steps). Iteration
(``named_parameters``, ``state_dict``) goes through ``items()`` and is not
seen. A parameter kept in a plain list or a closure is not seen either.

Two watchers use it: ZeRO-3's gatherer (:class:`hybrid.zero.param_gather.ParamGatherer`)
gathers a released unit on such a read, and under ``zero.overlap_param_gather``
:class:`hybrid.zero.deferred_gather.DeferredParamGather` waits for the
parameter's all-gather still in flight. A watcher has ``watches(p)`` (whether
``p`` is one of its parameters) and ``read(p)`` (called on each read of one).
"""

from __future__ import annotations

from typing import Protocol

from torch import nn


class ReadWatcher(Protocol):
    def watches(self, param: nn.Parameter) -> bool: ...

    def read(self, param: nn.Parameter) -> None: ...


class _WatchedParameters(dict):
    """A module's ``_parameters`` that reports each read of a watched parameter. Copies and pickles are plain
    dicts."""

    __slots__ = ("watcher",)

    def __getitem__(self, name):
        p = dict.__getitem__(self, name)
        if p is not None:
            self.watcher.read(p)
        return p

    def __reduce__(self):
        return dict, (dict(self),)


class ParameterReads:
    """Reports the attribute reads of ``watcher``'s parameters in every module of ``model`` that holds one (tied
    ones in each holder); :meth:`remove` gives the modules plain dicts back."""

    def __init__(self, model: nn.Module, watcher: ReadWatcher):
        self.modules = [m for m in model.modules()
                        if any(p is not None and watcher.watches(p) for p in m._parameters.values())]
        for m in self.modules:
            watched = _WatchedParameters(m._parameters)
            watched.watcher = watcher
            m.__dict__["_parameters"] = watched

    def remove(self) -> None:
        for m in self.modules:
            if isinstance(m._parameters, _WatchedParameters):
                m.__dict__["_parameters"] = dict(m._parameters)
        self.modules = []
