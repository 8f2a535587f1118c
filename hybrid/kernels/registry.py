"""Per-process access to the compiled ops, with the fallback policy applied.

A :class:`KernelRegistry` builds (or loads from the cache) each op on first use, keeps
the loaded modules, and remembers failures so a missing op costs one check and one
warning per process. ``default_registry()`` returns the registry for the current
environment (``HYBRID_KERNELS``, ``HYBRID_KERNELS_CACHE``, ``HYBRID_CSRC_DIR``, ``CXX``);
it is memoised on those values, so changing them (as tests do) yields a fresh registry.
"""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from hybrid.kernels import ops
from hybrid.kernels.build_lock import BuildLockTimeout
from hybrid.kernels.builder import (BuildPlan, build_and_load, cxx_compiler, default_cache_root, default_csrc_dir,
                                    plan_build)
from hybrid.kernels.modes import CACHE_ENV, CSRC_ENV, MODE_ENV, KernelBuildError, KernelMode, KernelUnavailableError, kernel_mode


@dataclass(frozen=True)
class OpStatus:
    """One row of ``python -m hybrid.kernels report``."""

    name: str
    device: str
    available: bool  # usable now or buildable on first use
    built: bool      # a finished build for the current sources is in the cache
    reason: str      # why not available / not built, or where the build lives


class KernelRegistry:
    def __init__(self, mode: KernelMode, cache_root: Path, csrc: Path):
        self.mode = mode
        self.cache_root = cache_root
        self.csrc = csrc
        self._modules: dict[str, ModuleType] = {}
        self._failures: dict[str, str] = {}
        self._warned: set[str] = set()
        self._lock = threading.RLock()

    # ---------------------------------------------------------------- build --
    def plan(self, name: str) -> BuildPlan:
        spec = ops.ALL_OPS[name]
        return plan_build(spec, self.csrc, self.cache_root, ops.key_extras(spec))

    def load(self, name: str, *, retry_failed: bool = False, verbose: bool = False) -> ModuleType:
        """Build or load ``name`` now, raising on any problem (used by ``build`` and ``get``)."""
        if name not in ops.ALL_OPS:
            raise KeyError(f"unknown op {name!r}; known ops: {', '.join(ops.ALL_OPS)}")
        with self._lock:
            if name in self._modules:
                return self._modules[name]
            problem = ops.requirement_problem(ops.ALL_OPS[name])
            if problem is not None:
                raise KernelUnavailableError(problem)
            module = build_and_load(self.plan(name), retry_failed=retry_failed, verbose=verbose)
            self._modules[name] = module
            self._failures.pop(name, None)
            return module

    # ----------------------------------------------------------- fallbacks --
    def get(self, name: str) -> ModuleType | None:
        """The op's module, or None when the caller should use its torch fallback.

        ``off`` returns None silently; ``auto`` warns once per op; ``require`` raises
        :class:`KernelUnavailableError`.
        """
        if self.mode is KernelMode.OFF:
            return None
        module = self._modules.get(name)
        if module is not None:
            return module
        with self._lock:
            if name in self._modules:
                return self._modules[name]
            reason = self._failures.get(name)
            if reason is None:
                try:
                    return self.load(name)
                except (KernelUnavailableError, KernelBuildError, BuildLockTimeout, FileNotFoundError,
                        OSError, ImportError) as exc:
                    reason = str(exc)
                    self._failures[name] = reason
            return self._fallback(name, reason)

    def _fallback(self, name: str, reason: str) -> None:
        if self.mode is KernelMode.REQUIRE:
            raise KernelUnavailableError(
                f"hybrid.kernels op '{name}' is unavailable: {reason}\n"
                f"{MODE_ENV}=require forbids the pure-torch fallback; set {MODE_ENV}=auto to allow it "
                f"or {MODE_ENV}=off to disable every compiled kernel."
            )
        if name not in self._warned:
            self._warned.add(name)
            first_line = reason.strip().splitlines()[0] if reason.strip() else "unknown reason"
            warnings.warn(
                f"hybrid.kernels op '{name}' is unavailable ({first_line}); using the pure-torch implementation. "
                f"Run `python -m hybrid.kernels report` for details; set {MODE_ENV}=off to silence this.",
                RuntimeWarning, stacklevel=4,
            )
        return None

    # -------------------------------------------------------------- report --
    def loaded(self) -> list[str]:
        """The ops this registry has loaded in this process (what the callers asking for them then ran)."""
        with self._lock:
            return sorted(self._modules)

    def status(self) -> list[OpStatus]:
        rows = []
        for name, spec in ops.ALL_OPS.items():
            rows.append(self._status_of(name, spec))
        return rows

    def _status_of(self, name: str, spec: ops.OpSpec) -> OpStatus:
        if name in self._modules:
            module = self._modules[name]
            return OpStatus(name, spec.device, True, True, f"loaded from {Path(module.__file__).parent}")
        problem = ops.requirement_problem(spec)
        if problem is not None:
            return OpStatus(name, spec.device, False, False, problem)
        try:
            plan = self.plan(name)
        except FileNotFoundError as exc:
            return OpStatus(name, spec.device, False, False, str(exc))
        if plan.is_built():
            return OpStatus(name, spec.device, True, True, f"cached in {plan.directory}")
        if plan.failed_marker.is_file():
            return OpStatus(name, spec.device, False, False,
                            f"last build failed (log: {plan.failed_marker}); retry with `python -m hybrid.kernels build`")
        if name in self._failures:
            return OpStatus(name, spec.device, False, False, self._failures[name])
        return OpStatus(name, spec.device, True, False, "not built yet; builds on first use or with "
                                                       "`python -m hybrid.kernels build`")


@lru_cache(maxsize=16)
def _registry_for(mode: KernelMode, cache_root: str, csrc: str, cxx: str) -> KernelRegistry:
    del cxx  # part of the memo key only: a different compiler needs fresh requirement checks
    return KernelRegistry(mode, Path(cache_root), Path(csrc))


# The variables (and the working directory, for relative paths) the registry's settings derive from.
_SETTING_ENVS = (MODE_ENV, CACHE_ENV, CSRC_ENV, "XDG_CACHE_HOME", "HOME", "CXX")


def default_registry() -> KernelRegistry:
    """The registry for the current environment variables.

    Called on every kernel call (the norm and codec ops ask it each time), so the memo key is
    the raw settings: resolving the cache and csrc paths costs file-system calls (tens of µs)."""
    return _registry_for_settings(tuple(os.environ.get(name) for name in _SETTING_ENVS), os.getcwd())


@lru_cache(maxsize=16)
def _registry_for_settings(settings: tuple, cwd: str) -> KernelRegistry:
    del settings, cwd  # the memo key only
    return _registry_for(kernel_mode(), str(default_cache_root()), str(default_csrc_dir()), cxx_compiler())
