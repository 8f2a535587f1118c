"""Compiled kernels with pure-torch fallbacks: CPU/CUDA Adam, CUDA LayerNorm/RMSNorm, CPU/CUDA blockwise
quantization (:mod:`hybrid.kernels.quantize`).

Ops build just in time (ninja, versioned cache) on first use; ``python -m hybrid.kernels
build`` prebuilds and ``report`` shows what is available. ``HYBRID_KERNELS=auto|require|off``
chooses between fallback-with-one-warning, error, and never using the compiled ops.
Importing the package registers the ``torch.library`` custom ops (``torch.ops.hybrid.*``,
:mod:`hybrid.kernels.library`), so a compiled graph loaded from a cache finds them.
See docs/kernels.md.
"""

from hybrid.kernels.adam_reference import torch_adam_step
from hybrid.kernels.cpu_adam import adam_step, multi_tensor_adam
from hybrid.kernels.layer_norm import layer_norm, rms_norm, rms_norm_reference
from hybrid.kernels.modes import KernelBuildError, KernelMode, KernelUnavailableError, kernel_mode
from hybrid.kernels.registry import KernelRegistry, OpStatus, default_registry
from hybrid.kernels import library, quantize  # noqa: F401  (importing quantize registers hybrid::quantize_*)


def status() -> list[OpStatus]:
    """One record per op (name, device, available, built, reason), without building anything."""
    return default_registry().status()


def loaded_ops() -> list[str]:
    """The compiled ops this process has loaded so far under the current ``HYBRID_KERNELS`` mode."""
    return default_registry().loaded()


def build(names=None, *, verbose: bool = False, retry_failed: bool = True) -> dict[str, str]:
    """Build the named ops (default: every op whose requirements are met); returns name -> outcome.

    ``retry_failed=False`` reports an op whose last build failed (the cache's failure record) without compiling
    it again."""
    from hybrid.kernels.ops import ALL_OPS, requirement_problem

    registry = default_registry()
    outcome: dict[str, str] = {}
    for name in names or list(ALL_OPS):
        problem = requirement_problem(ALL_OPS[name])
        if problem is not None:
            outcome[name] = f"skipped: {problem}"
            continue
        try:
            registry.load(name, retry_failed=retry_failed, verbose=verbose)
            outcome[name] = "built"
        except (KernelBuildError, KernelUnavailableError, OSError) as exc:
            outcome[name] = f"FAILED: {exc}"
    return outcome


__all__ = [
    "adam_step", "multi_tensor_adam", "torch_adam_step", "layer_norm", "rms_norm", "rms_norm_reference", "status",
    "build", "loaded_ops", "KernelMode", "kernel_mode", "KernelUnavailableError", "KernelBuildError",
    "KernelRegistry", "OpStatus", "default_registry",
]
