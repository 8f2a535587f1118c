"""Fixtures for the kernel tests: the compiled CPU Adam op, built once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def cpu_adam_op():
    """The compiled CPU Adam module (built into HYBRID_KERNELS_CACHE on first use)."""
    from hybrid.kernels import ops
    from hybrid.kernels.modes import KernelMode
    from hybrid.kernels.registry import KernelRegistry
    from hybrid.kernels.builder import default_cache_root, default_csrc_dir

    problem = ops.requirement_problem(ops.CPU_ADAM)
    if problem is not None:
        pytest.skip(f"cpu_adam cannot be built here: {problem}")
    return KernelRegistry(KernelMode.REQUIRE, default_cache_root(), default_csrc_dir()).load("cpu_adam")


@pytest.fixture
def kernel_env(monkeypatch):
    """Clean kernel-related environment for a test (mode auto, automatic ISA)."""
    for name in ("HYBRID_KERNELS", "HYBRID_CPU_ADAM_ISA", "HYBRID_CSRC_DIR"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch
