"""How the kernels are used: the ``HYBRID_KERNELS`` switch and the errors it can raise.

``HYBRID_KERNELS`` takes three values:

* ``auto`` (default): build each op at first use; if it cannot be built or loaded,
  warn once per op and use the pure-torch implementation.
* ``require``: the same, except that a missing or failed op raises
  :class:`KernelUnavailableError` instead of falling back.
* ``off``: never build or load a compiled op, and never warn. (The trainer's
  ``--no-fused-kernels`` is narrower: it switches off the optimizer's fused Adam only.)
"""

from __future__ import annotations

import enum
import os

MODE_ENV = "HYBRID_KERNELS"
CACHE_ENV = "HYBRID_KERNELS_CACHE"
CSRC_ENV = "HYBRID_CSRC_DIR"
ISA_ENV = "HYBRID_CPU_ADAM_ISA"
LOCK_STALE_ENV = "HYBRID_KERNELS_LOCK_STALE_S"


class KernelMode(enum.Enum):
    AUTO = "auto"
    REQUIRE = "require"
    OFF = "off"


class KernelUnavailableError(RuntimeError):
    """A compiled op was required (``HYBRID_KERNELS=require``) but cannot be used."""


class KernelBuildError(RuntimeError):
    """Compiling or importing an op failed; the message carries the compiler output tail."""


def kernel_mode(environ: "os._Environ[str] | dict[str, str] | None" = None) -> KernelMode:
    """Parse ``HYBRID_KERNELS`` (empty or unset means ``auto``)."""
    env = os.environ if environ is None else environ
    raw = env.get(MODE_ENV, "").strip().lower() or KernelMode.AUTO.value
    try:
        return KernelMode(raw)
    except ValueError:
        allowed = ", ".join(m.value for m in KernelMode)
        raise ValueError(
            f"{MODE_ENV}={env.get(MODE_ENV)!r} is not a valid kernel mode; use one of: {allowed}"
        ) from None


def forced_cpu_isa(environ: "os._Environ[str] | dict[str, str] | None" = None) -> str:
    """The SIMD path forced through ``HYBRID_CPU_ADAM_ISA`` ('' means choose automatically)."""
    env = os.environ if environ is None else environ
    raw = env.get(ISA_ENV, "").strip().lower()
    allowed = ("", "auto", "scalar", "avx2", "avx512")
    if raw not in allowed:
        raise ValueError(
            f"{ISA_ENV}={env.get(ISA_ENV)!r} is not a CPU Adam path; use one of: auto, scalar, avx2, avx512"
        )
    return "" if raw == "auto" else raw
