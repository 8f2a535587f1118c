"""Build lock, JIT builder, cache keys, fallback policy and the report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import hybrid.kernels as hk
from hybrid.kernels.build_lock import BuildLock, BuildLockTimeout, LockOwner
from hybrid.kernels.builder import OpSpec, build_and_load, plan_build
from hybrid.kernels.modes import KernelBuildError, KernelMode, KernelUnavailableError, kernel_mode
from hybrid.kernels.registry import KernelRegistry

TINY_SOURCE = r"""
#include <Python.h>
#define HYB_STR2(x) #x
#define HYB_STR(x) HYB_STR2(x)
#define HYB_CAT2(a, b) a##b
#define HYB_CAT(a, b) HYB_CAT2(a, b)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(ANSWER); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, "test"}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef def = {PyModuleDef_HEAD_INIT, HYB_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods,
                          nullptr, nullptr, nullptr, nullptr};
PyMODINIT_FUNC HYB_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&def); }
"""


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_lock(path: Path, pid: int, created: float, host: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    owner = LockOwner(host or __import__("socket").gethostname(), pid, None, created)
    path.write_text(owner.to_json())


def _tiny_op(tmp_path: Path, answer: int = 42, broken: bool = False) -> tuple[OpSpec, Path]:
    csrc = tmp_path / "csrc"
    (csrc / "tiny").mkdir(parents=True, exist_ok=True)
    body = TINY_SOURCE.replace("ANSWER", str(answer))
    if broken:
        body += "\nthis is not C++;\n"
    (csrc / "tiny" / "tiny.cpp").write_text(body)
    return OpSpec(name="tiny", sources=("tiny/tiny.cpp",), device="cpu"), csrc


# ------------------------------------------------------------------ lock --

def test_lock_of_dead_pid_is_broken(tmp_path):
    path = tmp_path / "x.lock"
    dead = _dead_pid()
    _write_lock(path, dead, time.time())
    lock = BuildLock(path, timeout_s=5)
    with lock:
        owner = LockOwner.parse(path.read_text())
        assert owner is not None and owner.pid == os.getpid()
    assert [o.pid for o in lock.broken_owners] == [dead]
    assert not path.exists()


def test_old_lock_of_live_process_is_broken(tmp_path):
    path = tmp_path / "x.lock"
    _write_lock(path, os.getppid(), time.time() - 3600)
    with BuildLock(path, stale_after_s=60, timeout_s=5) as lock:
        assert len(lock.broken_owners) == 1


def test_fresh_lock_of_live_process_is_respected(tmp_path):
    path = tmp_path / "x.lock"
    _write_lock(path, os.getppid(), time.time())
    with pytest.raises(BuildLockTimeout, match="delete that file"):
        BuildLock(path, timeout_s=0.3, poll_s=0.05).acquire()
    assert LockOwner.parse(path.read_text()).pid == os.getppid()


def test_unreadable_lock_is_broken(tmp_path):
    path = tmp_path / "x.lock"
    path.write_text("{not json")
    with BuildLock(path, timeout_s=5):
        pass
    assert not path.exists()


def test_lock_serialises_threads(tmp_path):
    path = tmp_path / "x.lock"
    inside, overlaps = [], []

    def worker():
        with BuildLock(path, timeout_s=20, poll_s=0.01):
            inside.append(1)
            if len(inside) > 1:
                overlaps.append(1)
            time.sleep(0.05)
            inside.pop()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not overlaps and not path.exists()


def test_release_leaves_a_lock_that_someone_else_took(tmp_path):
    path = tmp_path / "x.lock"
    lock = BuildLock(path)
    lock.acquire()
    _write_lock(path, os.getppid(), time.time())  # as if ours had been broken and retaken
    lock.release()
    assert LockOwner.parse(path.read_text()).pid == os.getppid()


# --------------------------------------------------------------- builder --

def test_build_proceeds_past_a_stale_lock_and_then_loads_from_cache(tmp_path):
    spec, csrc = _tiny_op(tmp_path)
    plan = plan_build(spec, csrc, tmp_path / "cache")
    _write_lock(plan.lock_path, _dead_pid(), time.time())  # a build killed mid-way
    (plan.directory).mkdir(parents=True)
    (plan.directory / "lock").write_text("")  # torch's own baton, left behind by the same crash
    module = build_and_load(plan, lock_timeout_s=60)
    assert module.answer() == 42
    assert plan.is_built() and not plan.lock_path.exists()
    assert json.loads(plan.ok_marker.read_text())["module"] == plan.module_name
    # A finished build is imported without taking the lock, even while someone holds it.
    _write_lock(plan.lock_path, os.getppid(), time.time())
    assert build_and_load(plan, lock_timeout_s=0.1).answer() == 42


def test_source_change_gives_a_new_build_directory(tmp_path):
    spec, csrc = _tiny_op(tmp_path, answer=1)
    first = plan_build(spec, csrc, tmp_path / "cache")
    (csrc / "tiny" / "extra.h").write_text("// a header next to the source counts too\n")
    second = plan_build(spec, csrc, tmp_path / "cache")
    assert first.directory != second.directory and first.module_name != second.module_name
    assert "torch" + torch.__version__.split("+")[0] in second.directory.name


def test_failed_build_is_reported_and_remembered(tmp_path):
    spec, csrc = _tiny_op(tmp_path, broken=True)
    plan = plan_build(spec, csrc, tmp_path / "cache")
    with pytest.raises(KernelBuildError, match="failed to build"):
        build_and_load(plan)
    assert plan.failed_marker.is_file() and not plan.lock_path.exists()
    started = time.perf_counter()
    with pytest.raises(KernelBuildError, match="failed to build earlier"):
        build_and_load(plan)
    assert time.perf_counter() - started < 1.0  # no second compile


def test_a_compiler_that_never_finishes_is_killed_at_the_deadline(tmp_path, monkeypatch):
    spec, csrc = _tiny_op(tmp_path)
    source = csrc / "tiny" / "tiny.cpp"
    # the compiler blocks reading this pipe, which no one writes (not a source suffix: the build key skips it)
    source.write_text('#include "stuck.inc"\n' + source.read_text())
    os.mkfifo(csrc / "tiny" / "stuck.inc")
    monkeypatch.setenv("HYBRID_KERNELS_LOCK_STALE_S", "4")
    plan = plan_build(spec, csrc, tmp_path / "cache")
    started = time.perf_counter()
    with pytest.raises(KernelBuildError, match=r"did not finish within 4 s \(HYBRID_KERNELS_LOCK_STALE_S"):
        build_and_load(plan)
    assert time.perf_counter() - started < 90
    assert plan.failed_marker.is_file() and not plan.lock_path.exists()
    left = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and str(source) in (entry / "cmdline").read_text():
                left.append(entry.name)
        except OSError:
            continue
    assert not left, f"compiler processes outlived the build: {left}"


def test_missing_source_is_named(tmp_path):
    spec = OpSpec(name="ghost", sources=("ghost/ghost.cpp",), device="cpu")
    with pytest.raises(FileNotFoundError, match="ghost/ghost.cpp.*HYBRID_CSRC_DIR"):
        plan_build(spec, tmp_path, tmp_path / "cache")


# -------------------------------------------------------- fallback policy --

def test_missing_op_falls_back_with_one_warning(tmp_path):
    registry = KernelRegistry(KernelMode.AUTO, tmp_path / "cache", tmp_path / "empty-csrc")
    with pytest.warns(RuntimeWarning, match="cpu_adam.*pure-torch") as record:
        assert registry.get("cpu_adam") is None
        assert registry.get("cpu_adam") is None
    assert len([w for w in record if "cpu_adam" in str(w.message)]) == 1


def test_require_mode_turns_the_fallback_into_an_error(tmp_path):
    registry = KernelRegistry(KernelMode.REQUIRE, tmp_path / "cache", tmp_path / "empty-csrc")
    with pytest.raises(KernelUnavailableError, match="(?s)adam.cpp not found.*HYBRID_KERNELS=require forbids"):
        registry.get("cpu_adam")


def test_off_mode_never_builds_or_warns(tmp_path):
    registry = KernelRegistry(KernelMode.OFF, tmp_path / "cache", tmp_path / "empty-csrc")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert registry.get("cpu_adam") is None
    assert not (tmp_path / "cache").exists()


def test_adam_step_falls_back_when_sources_are_missing(kernel_env, tmp_path):
    kernel_env.setenv("HYBRID_CSRC_DIR", str(tmp_path / "nowhere"))
    p, g = torch.randn(100), torch.randn(100)
    ref = p.clone()
    opt = torch.optim.AdamW([ref], lr=1e-3, foreach=False)
    ref.grad = g
    opt.step()
    m, v = torch.zeros(100), torch.zeros(100)
    with pytest.warns(RuntimeWarning, match="unavailable"):
        hk.adam_step(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=1)
    assert torch.equal(p, ref)
    kernel_env.setenv("HYBRID_KERNELS", "require")
    with pytest.raises(KernelUnavailableError, match="not found"):
        hk.adam_step(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=2)


def test_missing_compiler_is_the_reason(kernel_env, tmp_path):
    kernel_env.setenv("CXX", str(tmp_path / "no-such-compiler"))
    kernel_env.setenv("HYBRID_KERNELS", "require")
    with pytest.raises(KernelUnavailableError, match="C\\+\\+ compiler .*no-such-compiler"):
        hk.adam_step(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3), lr=1e-3, beta1=0.9,
                     beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    rows = {r.name: r for r in hk.status()}
    assert not rows["cpu_adam"].available and "no-such-compiler" in rows["cpu_adam"].reason


def test_invalid_mode_names_the_variable():
    with pytest.raises(ValueError, match="HYBRID_KERNELS='sometimes'.*auto, require, off"):
        kernel_mode({"HYBRID_KERNELS": "sometimes"})
    assert kernel_mode({}) is KernelMode.AUTO


# ----------------------------------------------------------------- report --

def test_report_lists_every_op_with_a_reason(cpu_adam_op, kernel_env, capsys):
    from hybrid.kernels.__main__ import main

    assert main(["report"]) == 0
    text = capsys.readouterr().out
    for name in ("cpu_adam", "cuda_adam", "cuda_norm"):
        assert name in text
    rows = {r.name: r for r in hk.status()}
    assert rows["cpu_adam"].available and rows["cpu_adam"].built
    if torch.version.cuda is None:
        assert "CPU-only build" in rows["cuda_norm"].reason and not rows["cuda_norm"].available


def test_loaded_lists_the_ops_this_registry_loaded(cpu_adam_op):
    from hybrid.kernels.builder import default_cache_root, default_csrc_dir

    registry = KernelRegistry(KernelMode.REQUIRE, default_cache_root(), default_csrc_dir())
    assert registry.loaded() == []
    assert registry.get("cpu_adam") is not None  # from the session's cache
    assert registry.loaded() == ["cpu_adam"]
