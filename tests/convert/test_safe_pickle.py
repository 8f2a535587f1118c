"""hybrid.convert.safe_pickle: other frameworks' .pt files read as plain data, hostile ones refused unrun."""

import argparse
import enum
import os
import sys
import types

import pytest
import torch

from hybrid.convert import safe_pickle
from hybrid.convert.safe_pickle import DEEPSPEED, EnumValue, PlainGlobals, UnsafePickleError


class _Thing:
    """A plain class of no framework: not on the allowlist."""


class _RunsCode:
    """Unpickling this runs ``touch MARKER`` (through os.system)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _hostile(tmp_path, protocol=2):
    marker = tmp_path / "ran"
    path = tmp_path / "hostile.pt"
    torch.save({"module": {"w": torch.ones(2)}, "args": _RunsCode(marker)}, path, pickle_protocol=protocol)
    return path, marker


@pytest.mark.parametrize("protocol", [2, 4])  # 4: the global is named by STACK_GLOBAL from two pushed strings
def test_a_file_that_runs_code_is_refused_in_one_line_and_nothing_runs(tmp_path, protocol):
    path, marker = _hostile(tmp_path, protocol)
    with pytest.raises(UnsafePickleError) as err:
        safe_pickle.load(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    assert f"the global {os.system.__module__}.system" in message  # posix.system on Linux
    assert not marker.exists()
    # The control: an unrestricted load of the same file does run it, so the file is really hostile.
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_an_unknown_class_is_refused_by_name(tmp_path):
    path = tmp_path / "thing.pt"
    torch.save({"x": _Thing()}, path)
    with pytest.raises(UnsafePickleError, match=r"thing\.pt: refused to load: it names the global "
                                                r"tests\.convert\.test_safe_pickle\._Thing, "):
        safe_pickle.load(path)


@pytest.fixture
def fake_deepspeed(monkeypatch):
    """Modules at DeepSpeed's paths holding look-alike classes, so that torch.save names DeepSpeed's globals
    without DeepSpeed installed."""
    config = types.ModuleType("deepspeed.runtime.zero.config")
    scaler = types.ModuleType("deepspeed.runtime.fp16.loss_scaler")

    class ZeroStageEnum(int, enum.Enum):
        gradients = 2

    class LossScaler:
        def __init__(self, scale):
            self.cur_scale = scale
            self.dynamic = False

    for cls, mod in ((ZeroStageEnum, config), (LossScaler, scaler)):
        cls.__module__, cls.__qualname__ = mod.__name__, cls.__name__
        setattr(mod, cls.__name__, cls)
        parts = mod.__name__.split(".")
        for i in range(1, len(parts)):  # the packages above, for pickle's import of the module
            parent = ".".join(parts[:i])
            monkeypatch.setitem(sys.modules, parent, sys.modules.get(parent) or types.ModuleType(parent))
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return ZeroStageEnum, LossScaler


def test_allowed_globals_become_plain_data(tmp_path, fake_deepspeed):
    ZeroStageEnum, LossScaler = fake_deepspeed
    path = tmp_path / "optim.pt"
    scaler = LossScaler(4.0)
    args = argparse.Namespace(tensor_model_parallel_size=2, params_dtype=torch.bfloat16)
    torch.save({"zero_stage": ZeroStageEnum.gradients, "loss_scaler": scaler, "again": scaler, "args": args,
                "flat": [torch.arange(3.0)]}, path)
    for name in list(sys.modules):  # what the file names is never imported by the reader
        if name.startswith("deepspeed"):
            del sys.modules[name]
    got = safe_pickle.load(path)
    assert got["zero_stage"] == EnumValue("deepspeed.runtime.zero.config.ZeroStageEnum", 2)
    assert got["loss_scaler"] == {"cur_scale": 4.0, "dynamic": False} and type(got["loss_scaler"]) is dict
    assert got["again"] is got["loss_scaler"]  # one object in the file stays one object
    assert vars(got["args"]) == {"tensor_model_parallel_size": 2, "params_dtype": torch.bfloat16}
    assert torch.equal(got["flat"][0], torch.arange(3.0))
    # Without DeepSpeed's names on the list the same file is refused.
    with pytest.raises(UnsafePickleError, match="ZeroStageEnum"):
        safe_pickle.load(path, allowed=PlainGlobals(classes=(argparse.Namespace,)))
    assert "deepspeed.runtime.fp16.loss_scaler.LossScaler" in DEEPSPEED.records


def test_scan_names_every_global_without_unpickling():
    import pickle

    # protocol 4: STACK_GLOBAL; the second function's module string is fetched from the memo
    data = pickle.dumps([os.system, os.path.join, os.getcwd], protocol=4)
    assert data.count(b"\x05" + os.getcwd.__module__.encode() + b"\x94") == 1
    assert list(safe_pickle.pickle_globals(data)) == [f"{os.system.__module__}.system",
                                                      f"{os.path.join.__module__}.join",
                                                      f"{os.getcwd.__module__}.getcwd"]


def test_a_missing_file_is_one_line(tmp_path):
    with pytest.raises(safe_pickle.CheckpointError, match=r"nope\.pt: no such file"):
        safe_pickle.load(tmp_path / "nope.pt")
