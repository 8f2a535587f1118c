"""The compiled ops hybrid knows about, and why each one can or cannot be built here."""

from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
from functools import lru_cache
from pathlib import Path

from hybrid.kernels.builder import OpSpec, compiler_identity, cxx_compiler

CPU_ADAM = OpSpec(
    name="cpu_adam",
    sources=("cpu/adam.cpp",),
    device="cpu",
    # -ffp-contract=off keeps the scalar and SIMD paths bit-identical (no implicit FMA).
    extra_cflags=("-O3", "-fopenmp", "-ffp-contract=off"),
    extra_ldflags=("-fopenmp",),
    description="SIMD Adam/AdamW on CPU (ZeRO offload, CPU training)",
)

CPU_QUANTIZE = OpSpec(
    name="cpu_quantize",
    sources=("cpu/quantize.cpp",),
    device="cpu",
    # Bit-identical to the torch path: no FMA contraction, no fast-math reciprocals or
    # reassociation (the loops are auto-vectorised, so these flags are what keeps them exact).
    extra_cflags=("-O3", "-fopenmp", "-ffp-contract=off", "-fno-fast-math"),
    extra_ldflags=("-fopenmp",),
    description="blockwise int8 / int4 / 1-bit quantization for compressed communication (CPU, SIMD + OpenMP)",
)

_NVCC_FLAGS = ("-O3", "-lineinfo")

CUDA_ADAM = OpSpec(
    name="cuda_adam",
    sources=("cuda/adam_binding.cpp", "cuda/multi_tensor_adam.cu", "cuda/status.cu"),
    device="cuda",
    extra_cflags=("-O3",),
    extra_cuda_cflags=_NVCC_FLAGS,
    description="multi-tensor fused Adam/AdamW on CUDA",
)

CUDA_NORM = OpSpec(
    name="cuda_norm",
    sources=("cuda/norm_binding.cpp", "cuda/layer_norm.cu", "cuda/status.cu"),
    device="cuda",
    extra_cflags=("-O3",),
    extra_cuda_cflags=_NVCC_FLAGS,
    description="fused LayerNorm / RMSNorm forward and backward on CUDA",
)

CUDA_QUANTIZE = OpSpec(
    name="cuda_quantize",
    sources=("cuda/quantize_binding.cpp", "cuda/quantize.cu", "cuda/status.cu"),
    device="cuda",
    extra_cflags=("-O3",),
    # Bit-identical to the torch path: no FMA contraction, IEEE division, denormals kept
    # (the kernels also use the __f*_rn intrinsics, so these flags are a second guard).
    extra_cuda_cflags=_NVCC_FLAGS + ("-fmad=false", "-prec-div=true", "-ftz=false"),
    description="blockwise int8 / int4 / 1-bit quantization for compressed communication (CUDA)",
)

ALL_OPS: dict[str, OpSpec] = {op.name: op for op in (CPU_ADAM, CPU_QUANTIZE, CUDA_ADAM, CUDA_NORM, CUDA_QUANTIZE)}


def find_nvcc() -> str | None:
    """nvcc from $CUDA_HOME/bin, else from PATH, else /usr/local/cuda/bin."""
    import os

    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        candidate = Path(home) / "bin" / "nvcc"
        return str(candidate) if candidate.is_file() else None
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


@lru_cache(maxsize=4)
def cuda_toolkit_root(nvcc: str) -> Path:
    """The toolkit directory behind ``nvcc`` (which may be a wrapper script on PATH)."""
    import os

    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return Path(home)
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
        match = re.search(r"_HERE_=(\S+)", out.stdout + out.stderr)
        if match:
            return Path(match.group(1)).resolve().parent
    except (OSError, subprocess.SubprocessError):
        pass
    return Path(nvcc).resolve().parent.parent


@lru_cache(maxsize=4)
def nvcc_version(nvcc: str) -> str | None:
    """'13.0' style release of an nvcc binary, or None if it does not run."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", out.stdout)
    return f"{match.group(1)}.{match.group(2)}" if match else None


def cuda_arch_list() -> str:
    """Target architectures for a CUDA build: TORCH_CUDA_ARCH_LIST, else the visible devices."""
    import os

    import torch

    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        return env
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{major}.{minor}" for major, minor in caps)


def _cpu_problem() -> str | None:
    from torch.utils import cpp_extension

    compiler = cxx_compiler()
    if compiler_identity(compiler) is None:
        return f"C++ compiler '{compiler}' not found or not runnable (install g++ or set CXX)"
    if not cpp_extension.is_ninja_available():
        return "ninja not found (pip install ninja)"
    include = sysconfig.get_paths().get("include")
    if not include or not (Path(include) / "Python.h").is_file():
        return "Python development headers (Python.h) not found (install python3-dev)"
    return None


def _cuda_problem() -> str | None:
    import torch

    cpu = _cpu_problem()
    if cpu is not None:
        return cpu
    if torch.version.cuda is None:
        return "torch is a CPU-only build (torch.version.cuda is None)"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    nvcc = find_nvcc()
    if nvcc is None:
        return "nvcc not found (set CUDA_HOME to the CUDA toolkit)"
    version = nvcc_version(nvcc)
    if version is None:
        return f"cannot read the version of {nvcc}"
    if version.split(".")[0] != torch.version.cuda.split(".")[0]:
        return (f"nvcc {version} ({nvcc}) and torch's CUDA {torch.version.cuda} differ in major version; "
                f"point CUDA_HOME at a CUDA {torch.version.cuda.split('.')[0]}.x toolkit")
    return None


def requirement_problem(spec: OpSpec) -> str | None:
    """Why ``spec`` cannot be built on this machine, or None if it can."""
    return _cpu_problem() if spec.device == "cpu" else _cuda_problem()


def key_extras(spec: OpSpec) -> tuple[str, ...]:
    """Build-key inputs known only at build time (the CUDA toolkit and target archs)."""
    if spec.device != "cuda":
        return ()
    nvcc = find_nvcc() or "no-nvcc"
    return (nvcc, nvcc_version(nvcc) or "?", cuda_arch_list())
