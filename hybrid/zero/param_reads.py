"""The read watch: attribute reads (``module.weight``) of parameters whose values are not in place, reported.

``nn.Module.__getattr__`` serves a parameter from the module's ``_parameters``
dict, so replacing that dict by :class:`_WatchedParameters` sees every read
of the form ``module.weight``: inside the module's own forward, and outside
it (a tied embedding's weight read by the LM head, a position table read by
its parent, a user reading a weight between steps). A parameter kept in a
plain list or a closure is not seen.

Two watchers use it: ZeRO-3's gatherer (:class:`hybrid.zero.param_gather.ParamGatherer`)
gathers a released unit on such a read, and under ``zero.overlap_param_gather``
:class:`hybrid.zero.deferred_gather.DeferredParamGather` waits for the
parameter's all-gather still in flight. A watcher has ``watches(p)`` (whether
``p`` is one of its parameters), ``read(p)`` (called on each attribute read of
one) and ``listed(params)`` (the dict hands its values out in bulk:
``items()``/``values()``, which ``named_parameters``, ``state_dict``,
``load_state_dict`` and ``.to()`` (``nn.Module._apply``) go through).

**Why a watch, and why only while needed** (issue 47, item 7). The
alternative, a forward pre-hook per module plus explicit waits where a
parameter is read outside its module (Megatron's way), was this project's
first version: it missed two such reads (the position table read by its
parent, an untied LM head's weight read by the model), and every new model
family would have to find its own. The watch covers them by construction.
What it must not do is stand in the way of ``torch.compile``: dynamo inlines a
watching dict's ``__getitem__`` and its watcher, and a wait there breaks the
graph once per parameter read (15 breaks in one model-zoo block, measured).
So a module holds a watching dict only while the watch can do something for
it, and an ordinary ``dict`` otherwise (:class:`ParameterReads` swaps the
two, the watchers decide when):

* stages 1-2: from the step that launches the gathers until the last gather
  holding one of the module's parameters landed; a steady-state forward and
  a block whose gathers were waited for before it is entered
  (:meth:`DeferredParamGather.wait_for <hybrid.zero.deferred_gather.DeferredParamGather.wait_for>`)
  see ordinary modules;
* ZeRO-3: while a forward runs, on the modules holding a parameter of a unit
  that no running module holds gathered (a read there gathers it); between
  forwards, and on a module inside its own unit's forward, ordinary dicts.

**Robustness.** Nothing is remembered across installs: each install scans
the module tree afresh (:meth:`ParameterReads.holders`), so a module added,
a parameter registered or assigned (``register_parameter``, ``m.w = p``),
or a parameter moved by ``.to()`` is seen as it is at the next install. The
watchers key their parameters by identity, kept alive by the optimizer's own
lists (no identity can be reused while watched); a parameter they do not know
(a new one) is read without a wait. ``.to()`` in place (the default, or
``torch.__future__`` swap mode) keeps each parameter's identity; ``.to()``
that makes new ``Parameter`` objects (the overwrite mode) leaves the
optimizer's behind, so nothing of the model is in flight any more. A
conversion reads every value through ``items()``, so under stages 1-2 it
lands the module's gathers first and never converts the last step's
weights; likewise ``state_dict`` and ``named_parameters`` while gathers are in
flight. Limits: a parameter assigned, while gathers are in flight, to a
module that holds none of them is not watched until the next install.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Protocol, Tuple

from torch import nn


class ReadWatcher(Protocol):
    def watches(self, param: nn.Parameter) -> bool: ...

    def read(self, param: nn.Parameter) -> None: ...

    def listed(self, params: Iterable[nn.Parameter]) -> None: ...


class _WatchedParameters(dict):
    """A module's ``_parameters`` that reports each read of a watched parameter to ``watcher``: one by name
    (``read``), or all of them in bulk (``listed``). Copies and pickles are plain dicts of landed values."""

    __slots__ = ("watcher",)

    def __getitem__(self, name):
        p = dict.__getitem__(self, name)
        if p is not None and self.watcher.watches(p):
            self.watcher.read(p)
        return p

    def _list(self) -> None:
        self.watcher.listed([p for p in dict.values(self) if p is not None and self.watcher.watches(p)])

    def items(self):
        self._list()
        return dict.items(self)

    def values(self):
        self._list()
        return dict.values(self)

    def __reduce__(self):
        self._list()
        return dict, (dict(dict.items(self)),)


def _params_of(module: nn.Module) -> Dict[str, nn.Parameter]:
    """``module._parameters`` without reporting a read."""
    return module.__dict__["_parameters"]


class ParameterReads:
    """Gives chosen modules of ``model`` a watching ``_parameters`` (reporting to ``watcher``) and the plain
    dicts back; which modules, and when, the watcher decides."""

    def __init__(self, model: nn.Module, watcher: ReadWatcher):
        self.model = model
        self.watcher = watcher
        self._watched: Dict[int, nn.Module] = {}  # id(module) -> module holding a watching dict now

    def holders(self) -> List[Tuple[nn.Module, List[nn.Parameter]]]:
        """Every module of ``model`` that holds a watched parameter now, with those parameters (tied ones in each
        holder), in ``model.modules()`` order: a fresh scan, nothing cached."""
        out = []
        for m in self.model.modules():
            params = self.watched_params(m)
            if params:
                out.append((m, params))
        return out

    def watched_params(self, module: nn.Module) -> List[nn.Parameter]:
        """The watched parameters ``module`` holds itself (not its children's), read without a report."""
        return [p for p in dict.values(_params_of(module)) if p is not None and self.watcher.watches(p)]

    def watch(self, module: nn.Module) -> None:
        if type(_params_of(module)) is not _WatchedParameters:
            watched = _WatchedParameters(dict.items(_params_of(module)))
            watched.watcher = self.watcher
            module.__dict__["_parameters"] = watched
        self._watched[id(module)] = module

    def unwatch(self, module: nn.Module) -> None:
        """Give ``module`` an ordinary ``dict`` again (the same entries, in order)."""
        current = _params_of(module)
        if type(current) is _WatchedParameters:
            module.__dict__["_parameters"] = dict(dict.items(current))
        self._watched.pop(id(module), None)

    def is_watched(self, module: nn.Module) -> bool:
        return type(_params_of(module)) is _WatchedParameters

    def remove(self) -> None:
        """Ordinary dicts everywhere."""
        for m in list(self._watched.values()):
            self.unwatch(m)
