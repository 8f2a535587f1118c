"""Compile every CUDA source with nvcc for sm_80 and sm_90, warnings as errors.

This needs no GPU and no CUDA build of torch: the kernels depend on the CUDA runtime
headers only. With ``link=True`` the thin torch bindings are compiled too and each op
is linked into a shared library with ``--no-undefined`` and imported, which proves the
bindings and launchers agree (the import works without a GPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hybrid.kernels.builder import cxx_compiler, default_csrc_dir
from hybrid.kernels.ops import ALL_OPS, cuda_toolkit_root, find_nvcc, nvcc_version

DEFAULT_ARCHS = ("80", "90")
# torch's extension builds define these; compiling with them proves the kernels never
# rely on the implicit half/bfloat16 operators they disable.
TORCH_STYLE_DEFINES = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                       "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__")
# One source compiles in well under a minute for two architectures; ten means nvcc is stuck (on a stalled
# file system, say), which is reported as that source's failure rather than waited on.
COMMAND_TIMEOUT_S = 600.0


@dataclass
class CompileResult:
    source: str
    ok: bool
    seconds: float
    output: str


def nvcc_command(nvcc: str, source: Path, obj: Path, archs, pic: bool = False) -> list[str]:
    cmd = [nvcc, "-c", "-std=c++17", "-O3", "--Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror",
           *TORCH_STYLE_DEFINES, str(source), "-o", str(obj)]
    for arch in archs:
        cmd += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    if pic:
        cmd += ["-Xcompiler", "-fPIC"]
    return cmd


def _run(cmd: list[str], label: str) -> CompileResult:
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return CompileResult(label, False, time.perf_counter() - start,
                             f"{cmd[0]} was stopped after {COMMAND_TIMEOUT_S:g} s without finishing")
    return CompileResult(label, proc.returncode == 0, time.perf_counter() - start,
                         (proc.stdout + proc.stderr).strip())


def _binding_command(source: Path, obj: Path, module: str) -> list[str]:
    from torch.utils import cpp_extension

    includes = [f"-isystem{p}" for p in cpp_extension.include_paths()]
    includes.append(f"-isystem{sysconfig.get_paths()['include']}")
    return [cxx_compiler(), "-std=c++20", "-O1", "-fPIC", "-c", "-Wall", "-Wextra", "-Werror", *includes,
            f"-I{source.parent}", f"-DTORCH_EXTENSION_NAME={module}", str(source), "-o", str(obj)]


def _link_and_import(op_name: str, objects: list[Path], out_dir: Path, nvcc: str) -> CompileResult:
    from torch.utils import cpp_extension

    module = f"hybrid_check_{op_name}"
    lib = out_dir / f"{module}.so"
    cuda_lib = cuda_toolkit_root(nvcc) / "lib64"
    torch_lib = Path(cpp_extension.include_paths()[0]).parent / "lib"
    py_libdir = sysconfig.get_config_var("LIBDIR")
    py_lib = f"python{sysconfig.get_config_var('LDVERSION')}"
    link = [cxx_compiler(), "-shared", *map(str, objects), f"-L{torch_lib}", "-lc10", "-ltorch", "-ltorch_cpu",
            "-ltorch_python", f"-L{cuda_lib}", "-lcudart", f"-Wl,-rpath,{cuda_lib}", f"-Wl,-rpath,{torch_lib}",
            f"-L{py_libdir}", f"-l{py_lib}", "-Wl,--no-undefined", "-o", str(lib)]
    result = _run(link, f"link {op_name}")
    if not result.ok:
        return result
    probe = f"import sys, torch; sys.path.insert(0, {str(out_dir)!r}); import {module}; print('ok')"
    imported = _run([sys.executable, "-c", probe], f"import {op_name}")
    imported.seconds += result.seconds
    imported.source = f"link+import {op_name}"
    return imported


def check_cuda_sources(csrc: Path | None = None, archs=DEFAULT_ARCHS, link: bool = False,
                       jobs: int | None = None, stream=sys.stdout) -> int:
    """Compile (and optionally link) the CUDA sources; print a summary; return an exit code."""
    csrc = csrc or default_csrc_dir()
    nvcc = find_nvcc()
    if nvcc is None:
        print("check-cuda: SKIPPED - nvcc not found (set CUDA_HOME or put nvcc on PATH)", file=stream)
        return 0
    sources = sorted((csrc / "cuda").glob("*.cu"))
    if not sources:
        print(f"check-cuda: FAILED - no .cu files under {csrc / 'cuda'}", file=stream)
        return 1
    print(f"check-cuda: nvcc {nvcc_version(nvcc)} ({nvcc}), archs {', '.join('sm_' + a for a in archs)}, "
          f"{len(sources)} sources", file=stream)
    jobs = jobs or os.cpu_count() or 1
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hybrid-check-cuda-") as tmp:
        out = Path(tmp)
        objects = {s.name: out / (s.stem + ".o") for s in sources}
        tasks = [(nvcc_command(nvcc, s, objects[s.name], archs, pic=link), s.name) for s in sources]
        bindings: dict[str, Path] = {}
        if link:
            for op in ALL_OPS.values():
                for rel in op.sources:
                    if rel.endswith(".cpp") and op.device == "cuda":
                        src = csrc / rel
                        bindings[rel] = out / (src.stem + ".binding.o")
                        tasks.append((_binding_command(src, bindings[rel], f"hybrid_check_{op.name}"), rel))
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(lambda t: _run(*t), tasks))
        if link and all(r.ok for r in results):
            for op in ALL_OPS.values():
                if op.device != "cuda":
                    continue
                objs = [bindings[r] if r.endswith(".cpp") else objects[Path(r).name] for r in op.sources]
                results.append(_link_and_import(op.name, objs, out, nvcc))
    failed = [r for r in results if not r.ok]
    for r in results:
        print(f"  {'ok  ' if r.ok else 'FAIL'} {r.source:<32} {r.seconds:6.1f} s", file=stream)
    for r in failed:
        print(f"\n--- {r.source} ---\n{r.output}", file=stream)
    total = time.perf_counter() - started
    verdict = "FAILED" if failed else "passed"
    print(f"check-cuda: {verdict} ({len(results) - len(failed)}/{len(results)} ok, {total:.1f} s wall)", file=stream)
    return 1 if failed else 0
