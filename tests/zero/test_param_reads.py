"""The read watch (:mod:`hybrid.zero.param_reads`): robust to ``.to()`` and new parameters, and out of the way
of ``torch.compile`` once nothing is in flight.

Most tests drive :class:`~hybrid.zero.deferred_gather.DeferredParamGather` with stand-in flat groups (one
segment per parameter, in registration order) and stand-in gathers whose ``wait()`` writes the segment's
"landed" value into its parameters, so a read that did not wait sees the old value. The last ones run the
real optimizers on the model zoo's GPT in one process.
"""

import contextlib
import types

import pytest
import torch
from torch import nn

from hybrid.zero.deferred_gather import DeferredParamGather


class _Table(nn.Module):
    """A parameter its parent reads (as the GPT's position table)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 8))


class _Net(nn.Module):
    """Embedding, a table read by the parent, two layers, an untied head read by the model."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.pos = _Table()
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        self.head = nn.Linear(8, 10, bias=False)

    def forward(self, ids):
        x = self.emb(ids) + self.pos.weight[: ids.shape[-1]]
        return self.layers(x) @ self.head.weight.t()


class _Group:
    """A flat group as :class:`DeferredParamGather` reads it: one segment per parameter, in order."""

    index = 0

    def __init__(self, params):
        self.params = list(params)
        self.records = [types.SimpleNamespace(segment=k) for k in range(len(self.params))]
        self.segments = self.params

    def segment_first_position(self, segment):
        return segment


class _Gathers:
    """Stand-in gathers: launch ``n`` writes nothing; the wait of segment ``k`` writes ``value`` into its
    parameter (what the all-gather brings) and is logged."""

    def __init__(self, params):
        self.params, self.waited, self.value = list(params), [], 0.0

    def launch(self, deferred, value):
        deferred.wait_all()  # the last launch's gathers land with the last value
        self.waited, self.value = [], value
        deferred.launch(lambda key: types.SimpleNamespace(wait=lambda k=key[1]: self._land(k)))

    def _land(self, k):
        self.waited.append(k)
        with torch.no_grad():
            self.params[k].fill_(self.value)


def _setup():
    model = _Net()
    params = list(model.parameters())
    deferred = DeferredParamGather(model, [_Group(params)])
    gathers = _Gathers(params)
    place = {id(p): k for k, p in enumerate(params)}
    return model, deferred, gathers, place


def _plain(model):
    return all(type(m.__dict__["_parameters"]) is dict for m in model.modules())


def test_a_read_waits_for_its_gather_and_the_earlier_ones_only_and_modules_turn_ordinary_as_theirs_land():
    model, deferred, gathers, place = _setup()
    gathers.launch(deferred, 1.0)
    assert not _plain(model)
    w = model.layers[0].weight  # the 3rd segment: emb, pos, then layers.0.weight
    assert gathers.waited == [0, 1, 2] and (w == 1.0).all()
    assert type(model.emb._parameters) is dict and type(model.pos._parameters) is dict
    assert type(model.layers[0]._parameters) is not dict  # its bias is still in flight
    assert type(model.head._parameters) is not dict
    model.layers[0].weight  # landed: no new wait
    assert gathers.waited == [0, 1, 2]
    model(torch.tensor([[1, 2, 3]]))
    assert gathers.waited == list(range(len(place))) and deferred.in_flight == 0
    assert _plain(model)


@contextlib.contextmanager
def _conversion_mode(mode):
    """``nn.Module._apply``'s three ways: set ``.data`` (default), swap the tensors, overwrite the Parameter."""
    swap, overwrite = torch.__future__.get_swap_module_params_on_conversion(), \
        torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(mode == "swap")
    torch.__future__.set_overwrite_module_params_on_conversion(mode == "overwrite")
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)


@pytest.mark.parametrize("mode", ["set_data", "swap"])
@pytest.mark.parametrize("target", [torch.float64, "cpu"])
def test_after_to_the_watch_waits_for_and_only_for_the_parameters_in_flight(mode, target):
    model, deferred, gathers, place = _setup()
    gathers.launch(deferred, 1.0)
    with _conversion_mode(mode):
        model.to(target)
    # the conversion read every value: it waited for every gather first, so nothing converted stale weights
    assert gathers.waited == list(range(len(place))) and _plain(model)
    assert all((p == 1.0).all() for p in model.parameters())
    gathers.params = list(model.parameters())  # the same objects: the optimizer's keys still name them
    assert [id(p) for p in gathers.params] == list(place)
    gathers.launch(deferred, 2.0)
    assert model.pos.weight.dtype == (torch.float64 if target == torch.float64 else torch.float32)
    assert (model.pos.weight == 2.0).all() and gathers.waited == [0, 1]
    assert (model.layers[1].bias == 2.0).all() and gathers.waited == [0, 1, 2, 3, 4, 5]
    assert model.head.weight is not None and gathers.waited == list(range(len(place)))


def test_to_that_makes_new_parameters_leaves_nothing_in_flight():
    """Overwrite mode: new ``Parameter`` objects, which no gather writes; the old values were landed first."""
    model, deferred, gathers, place = _setup()
    gathers.launch(deferred, 1.0)
    with _conversion_mode("overwrite"):
        model.to(torch.float64)
    assert all(id(p) not in place for p in model.parameters())
    assert all(p.dtype == torch.float64 and (p == 1.0).all() for p in model.parameters())
    gathers.launch(deferred, 2.0)  # writes the optimizer's (old) parameters only
    assert _plain(model)  # none of the model's parameters is in flight: nothing to watch
    assert (model.layers[1].weight == 1.0).all() and gathers.waited == []


def test_a_parameter_registered_while_gathers_are_in_flight_is_read_without_a_wait():
    model, deferred, gathers, place = _setup()
    gathers.launch(deferred, 1.0)
    extra = nn.Parameter(torch.full((8,), 5.0))
    model.layers[1].register_parameter("scale", extra)
    model.pos.extra = nn.Parameter(torch.ones(2))  # the attribute way, on another watched module
    assert model.layers[1].scale is extra and (model.pos.extra == 1.0).all()
    assert gathers.waited == []
    assert (model.layers[1].weight == 1.0).all() and gathers.waited == [0, 1, 2, 3, 4]
    deferred.wait_all()
    assert _plain(model) and model.layers[1].scale is extra  # the plain dict kept the new entry
    gathers.launch(deferred, 2.0)  # the next launch sees the new parameters and still waits only for the old
    assert (model.layers[1].scale == 5.0).all() and gathers.waited == []
    assert (model.layers[1].bias == 2.0).all() and gathers.waited == [0, 1, 2, 3, 4, 5]


def test_a_new_parameter_replacing_a_watched_one_is_not_waited_for():
    model, deferred, gathers, place = _setup()
    gathers.launch(deferred, 1.0)
    fresh = nn.Parameter(torch.full((8, 8), 7.0))
    model.layers[0].weight = fresh  # torch's register_parameter reads the old one (hasattr): its gather lands
    assert gathers.waited == [0, 1, 2]
    assert model.layers[0].weight is fresh and (fresh == 7.0).all() and gathers.waited == [0, 1, 2]
    assert type(model.layers[0]._parameters) is not dict  # its bias is still in flight
    assert (model.layers[0].bias == 1.0).all() and gathers.waited == [0, 1, 2, 3]
    assert type(model.layers[0]._parameters) is dict
    deferred.wait_all()
    assert (fresh == 7.0).all() and _plain(model)  # no gather writes it


def test_a_watched_parameter_assigned_to_another_module_is_waited_for_there():
    model, deferred, gathers, place = _setup()
    model.layers.append(nn.Linear(8, 8, bias=False))
    model.layers[2].weight = model.layers[0].weight  # tied after the optimizer was built: a module it never saw
    gathers.launch(deferred, 1.0)
    assert (model.layers[2].weight == 1.0).all() and gathers.waited == [0, 1, 2]
    # while in flight, into a watched module whose own gathers land first: it stays watched until this one does
    gathers.launch(deferred, 2.0)
    model.pos.late = gathers.params[6]  # the head's weight, taken without a read
    model.pos.weight
    assert gathers.waited == [0, 1] and type(model.pos._parameters) is not dict
    assert (model.pos.late == 2.0).all() and gathers.waited == list(range(len(place)))
    assert _plain(model)


def test_listing_parameters_while_in_flight_gives_the_landed_values():
    model, deferred, gathers, place = _setup()
    gathers.launch(deferred, 3.0)
    state = model.state_dict()
    assert all((t == 3.0).all() for t in state.values())
    gathers.launch(deferred, 4.0)
    first = next(model.parameters())  # lists the first module only
    assert (first == 4.0).all() and gathers.waited == [0]
    deferred.remove_hooks()
    assert _plain(model)


# ---- the real optimizers on the model zoo's GPT, one process ---------------------------------------------
def _gpt():
    from hybrid import Topology
    from model_zoo import GPTModel, get_preset

    cfg = get_preset("tiny").replace(num_layers=2, seq_length=16, vocab_size=256)
    return cfg, GPTModel(cfg, Topology.local())


def _step(model, opt, cfg, step):
    from tests.zero.common import token_batch

    x, y = token_batch(step, 2, cfg.vocab_size, cfg.seq_length, False)
    opt.backward(model(x, y))
    opt.step()
    return x, y


def test_stage_1_steady_state_blocks_are_ordinary_modules_and_compile_without_a_graph_break():
    from hybrid import Topology
    from tests.zero.common import make_zero

    cfg, model = _gpt()
    opt = make_zero(model, Topology.local(), stage=1, bucket_size=2_000, overlap_param_gather=True)
    deferred = opt._deferred
    x, y = _step(model, opt, cfg, 0)
    block0, block1 = model.layers.by_index(0), model.layers.by_index(1)
    assert deferred.in_flight == len(deferred.order)
    assert not _plain(block0) and not _plain(block1)
    deferred.wait_for(block0)  # the explicit wait before entering a compiled region
    assert _plain(block0) and not _plain(block1) and deferred.in_flight > 0
    model(x, y)  # the forward lands the rest
    assert deferred.in_flight == 0 and _plain(model)

    torch._dynamo.reset()
    hidden = torch.randn(cfg.seq_length, 2, cfg.hidden_size)
    explained = torch._dynamo.explain(block1)(hidden)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    opt.remove_hooks()


def test_stage_3_watches_only_during_forward_and_only_where_a_read_would_gather():
    from hybrid import Topology
    from hybrid.zero.param_reads import _WatchedParameters
    from tests.zero.common import make_zero

    cfg, model = _gpt()
    opt = make_zero(model, Topology.local(), stage=3, persistence_threshold=0)
    seen = {}

    def inside(name):
        def hook(module, args):  # registered after the optimizer's: the module's unit is gathered and held
            seen[name] = (type(module._parameters), module.weight.numel() > 0)
        return hook

    linear = model.layers.by_index(0).mlp.in_proj
    linear.register_forward_pre_hook(inside("in_proj"))
    model.layers.by_index(1).register_forward_pre_hook(
        lambda m, a: seen.__setitem__("later", type(model.layers.by_index(1).mlp.in_proj._parameters)))
    x, y = _step(model, opt, cfg, 0)
    assert seen["in_proj"] == (dict, True)
    assert seen["later"] is _WatchedParameters  # not running yet: a read there would gather
    assert _plain(model)  # between forwards
    # a parameter registered between steps: the next forward's scan finds the modules as they are
    linear.register_parameter("extra", nn.Parameter(torch.ones(3)))
    _step(model, opt, cfg, 1)
    assert seen["in_proj"] == (dict, True) and _plain(model)
    opt.remove_hooks()
