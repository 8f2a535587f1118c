"""Just-in-time build of one C++/CUDA op into a versioned cache, and loading it back.

Layout: ``<cache>/<op>/<torch>-<python>-<isa>-<key>/`` holds the ninja build of the
extension module ``hybrid_<op>_<key>``. The key hashes everything that changes the
binary: the op's source files, compiler flags, torch and Python versions, the compiler,
the host ISA and (for CUDA) the nvcc version and target architectures. A finished build
leaves ``build_ok.json``; later processes import the module straight from disk without
touching the lock or ninja. A failed build leaves ``build_failed.log`` so the next process
reports the same error at once instead of recompiling; ``python -m hybrid.kernels build``
clears it and retries.

The compiler runs in a child process (``python -m hybrid.kernels.builder PLAN``) with a
deadline, the lock's staleness age (``HYBRID_KERNELS_LOCK_STALE_S``): a compiler stuck on
a hung file system is killed with everything below it and reported as a failed build, not
waited on for ever. The parent imports the finished library.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from hybrid.kernels.build_lock import DEFAULT_STALE_AFTER_S, BuildLock
from hybrid.kernels.modes import CACHE_ENV, CSRC_ENV, LOCK_STALE_ENV, KernelBuildError
from hybrid.processes import stop_tree

SOURCE_SUFFIXES = (".cpp", ".cc", ".h", ".hpp", ".cu", ".cuh")
OK_MARKER = "build_ok.json"
FAILED_MARKER = "build_failed.log"


@dataclass(frozen=True)
class OpSpec:
    """What to compile for one op.

    ``sources`` are paths relative to the csrc directory; every file with a source
    suffix in their directories is hashed, so editing a header triggers a rebuild.
    """

    name: str
    sources: tuple[str, ...]
    device: str  # "cpu" or "cuda"
    extra_cflags: tuple[str, ...] = ()
    extra_cuda_cflags: tuple[str, ...] = ()
    extra_ldflags: tuple[str, ...] = ()
    description: str = ""
    key_extras: tuple[str, ...] = field(default=())


def default_csrc_dir() -> Path:
    env = os.environ.get(CSRC_ENV)
    if env:
        return Path(env).expanduser().resolve()
    return Path(__file__).resolve().parents[2] / "csrc"


def default_cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "hybrid" / "kernels"


def lock_stale_after_s() -> float:
    raw = os.environ.get(LOCK_STALE_ENV)
    if not raw:
        return DEFAULT_STALE_AFTER_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{LOCK_STALE_ENV}={raw!r} must be a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{LOCK_STALE_ENV}={raw!r} must be > 0")
    return value


def cxx_compiler() -> str:
    return os.environ.get("CXX", "c++")


@lru_cache(maxsize=8)
def compiler_identity(compiler: str) -> str | None:
    """First line of ``<compiler> --version``, or None if it cannot run."""
    path = shutil.which(compiler)
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return (out.stdout.splitlines() or ["unknown"])[0].strip()


@lru_cache(maxsize=1)
def host_isa() -> str:
    """Best SIMD level of this CPU as seen by the OS: avx512, avx2, scalar, or the machine name."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return machine or "unknown"
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "x86_64"
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if "avx512f" in flags:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "scalar"


def source_files(spec: OpSpec, csrc: Path) -> list[Path]:
    """Every file that can affect the build (the listed sources plus headers beside them)."""
    missing = [s for s in spec.sources if not (csrc / s).is_file()]
    if missing:
        raise FileNotFoundError(
            f"op {spec.name}: source file(s) {', '.join(missing)} not found under {csrc}; "
            f"run from a source checkout or point {CSRC_ENV} at the csrc directory"
        )
    files: set[Path] = set()
    for rel in spec.sources:
        folder = (csrc / rel).parent
        files.update(p for p in folder.iterdir() if p.suffix in SOURCE_SUFFIXES and p.is_file())
    return sorted(files)


def build_key(spec: OpSpec, csrc: Path, extras: tuple[str, ...] = ()) -> str:
    import torch

    h = hashlib.sha256()
    parts = [spec.name, torch.__version__, sys.version.split()[0], host_isa(),
             compiler_identity(cxx_compiler()) or "no-compiler", *spec.extra_cflags,
             *spec.extra_cuda_cflags, *spec.extra_ldflags, *spec.key_extras, *extras]
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    for path in source_files(spec, csrc):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class BuildPlan:
    spec: OpSpec
    csrc: Path
    directory: Path
    module_name: str

    @property
    def library(self) -> Path:
        return self.directory / f"{self.module_name}.so"

    @property
    def ok_marker(self) -> Path:
        return self.directory / OK_MARKER

    @property
    def failed_marker(self) -> Path:
        return self.directory / FAILED_MARKER

    @property
    def lock_path(self) -> Path:
        return self.directory.with_name(self.directory.name + ".lock")

    def is_built(self) -> bool:
        return self.ok_marker.is_file() and self.library.is_file()


def plan_build(spec: OpSpec, csrc: Path, cache_root: Path, extras: tuple[str, ...] = ()) -> BuildPlan:
    import torch

    key = build_key(spec, csrc, extras)
    torch_tag = "torch" + torch.__version__.split("+")[0]
    py_tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    directory = cache_root / spec.name / f"{torch_tag}-{py_tag}-{host_isa()}-{key}"
    return BuildPlan(spec, csrc, directory, f"hybrid_{spec.name}_{key}")


def _import_library(plan: BuildPlan) -> ModuleType:
    if plan.module_name in sys.modules:
        return sys.modules[plan.module_name]
    loader_spec = importlib.util.spec_from_file_location(plan.module_name, plan.library)
    if loader_spec is None or loader_spec.loader is None:
        raise KernelBuildError(f"cannot import {plan.library}")
    module = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(module)
    sys.modules[plan.module_name] = module
    return module


def _compile(plan: BuildPlan, verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    spec = plan.spec
    # The ninja baton torch keeps inside the build directory would make torch wait forever
    # if a previous build died holding it; we hold our own lock, so it cannot be live.
    (plan.directory / "lock").unlink(missing_ok=True)
    return cpp_extension.load(
        name=plan.module_name,
        sources=[str(plan.csrc / s) for s in spec.sources],
        extra_cflags=list(spec.extra_cflags),
        extra_cuda_cflags=list(spec.extra_cuda_cflags),
        extra_ldflags=list(spec.extra_ldflags),
        extra_include_paths=sorted({str((plan.csrc / s).parent) for s in spec.sources}),
        build_directory=str(plan.directory),
        verbose=verbose,
        with_cuda=spec.device == "cuda",
    )


_STOP_GRACE_S = 5.0  # a build past its deadline gets this long to end on SIGTERM before everything is killed


def _compile_in_child(plan: BuildPlan, verbose: bool, timeout_s: float) -> None:
    """:func:`_compile` in a child process, stopped with every compiler below it after ``timeout_s``
    (:func:`hybrid.processes.stop_tree`); a RuntimeError holding its output when it fails or overruns."""
    payload = json.dumps({"spec": dataclasses.asdict(plan.spec), "csrc": str(plan.csrc),
                          "directory": str(plan.directory), "module_name": plan.module_name, "verbose": verbose})
    # the child imports this package from where this process found it, whatever put it on sys.path here
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, "-m", "hybrid.kernels.builder", payload], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_tree(proc.pid, _STOP_GRACE_S)
        output, _ = proc.communicate(timeout=60)
        raise RuntimeError(f"the build did not finish within {timeout_s:g} s ({LOCK_STALE_ENV}; a compiler stuck "
                           f"on a hung file system?) and was killed:\n{output}") from None
    finally:
        if proc.poll() is None:  # this process interrupted meanwhile: no compiler outlives it
            stop_tree(proc.pid, _STOP_GRACE_S)
    if verbose and output:
        print(output, end="", flush=True)
    if proc.returncode != 0:
        raise RuntimeError(output.strip() or f"the build process exited with {proc.returncode}")


def _compile_plan_from_json(payload: str) -> None:
    """The child's side of :func:`_compile_in_child`."""
    data = json.loads(payload)
    spec = OpSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in data["spec"].items()})
    _compile(BuildPlan(spec, Path(data["csrc"]), Path(data["directory"]), data["module_name"]), data["verbose"])


def build_and_load(plan: BuildPlan, *, retry_failed: bool = False, verbose: bool = False,
                   lock_timeout_s: float | None = None) -> ModuleType:
    """Return the op's module, compiling it first if no finished build exists.

    ``retry_failed`` compiles again even if an earlier build with the same key failed.

    Raises:
        KernelBuildError: compilation or import failed (message holds the log tail).
    """
    if plan.is_built():
        try:
            return _import_library(plan)
        except ImportError as exc:
            raise KernelBuildError(f"op {plan.spec.name}: cannot import {plan.library}: {exc}; "
                                   f"delete {plan.directory} to rebuild it") from exc
    if plan.failed_marker.is_file() and not retry_failed:
        raise KernelBuildError(
            f"op {plan.spec.name} failed to build earlier (log: {plan.failed_marker}); "
            f"fix the cause, then run `python -m hybrid.kernels build` to retry.\n"
            + _tail(plan.failed_marker.read_text())
        )
    plan.directory.mkdir(parents=True, exist_ok=True)
    with BuildLock(plan.lock_path, stale_after_s=lock_stale_after_s(), timeout_s=lock_timeout_s):
        if plan.is_built():  # another process finished while we waited
            return _import_library(plan)
        plan.failed_marker.unlink(missing_ok=True)
        plan.ok_marker.unlink(missing_ok=True)
        started = time.time()
        try:
            _compile_in_child(plan, verbose, lock_stale_after_s())
            module = _import_library(plan)
        except Exception as exc:  # the compiler's output, or the import's error
            log = f"{type(exc).__name__}: {exc}"
            plan.failed_marker.write_text(log)
            raise KernelBuildError(f"op {plan.spec.name} failed to build in {plan.directory}:\n{_tail(log)}") from exc
        plan.ok_marker.write_text(json.dumps({
            "op": plan.spec.name, "module": plan.module_name, "seconds": round(time.time() - started, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }))
    return module


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


if __name__ == "__main__":
    _compile_plan_from_json(sys.argv[1])
