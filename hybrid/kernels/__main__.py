"""``python -m hybrid.kernels build|report|check-cuda``.

build       prebuild every op this machine can build (or those named with --op), then report
report      table of each op: available, built, or why not; plus the toolchain and CPU paths
check-cuda  compile every csrc/cuda/*.cu with nvcc for sm_80 and sm_90, warnings as errors
"""

from __future__ import annotations

import argparse
import platform
import sys

from hybrid.argument_parser import ArgumentParser
from hybrid.kernels.builder import compiler_identity, cxx_compiler, default_cache_root, default_csrc_dir, host_isa
from hybrid.kernels.ops import ALL_OPS, find_nvcc, nvcc_version


def _environment_lines() -> list[str]:
    import torch

    nvcc = find_nvcc()
    return [
        f"torch        {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
        f"python       {platform.python_version()}",
        f"compiler     {cxx_compiler()}: {compiler_identity(cxx_compiler()) or 'not found'}",
        f"nvcc         {(nvcc + ' ' + (nvcc_version(nvcc) or '?')) if nvcc else 'not found'}",
        f"cpu          {platform.machine()}, best SIMD path: {host_isa()}",
        f"cache        {default_cache_root()}",
        f"sources      {default_csrc_dir()}",
    ]


def _cpu_isa_line() -> str | None:
    """The CPU Adam paths the compiled op reports, if it is already built."""
    from hybrid.kernels.registry import default_registry

    registry = default_registry()
    plan = registry.plan("cpu_adam") if (default_csrc_dir() / ALL_OPS["cpu_adam"].sources[0]).is_file() else None
    if plan is None or not plan.is_built():
        return None
    module = registry.load("cpu_adam")
    return f"cpu_adam     paths on this CPU: {', '.join(module.supported_isas())} (default {module.default_isa()})"


def print_report(stream=sys.stdout) -> None:
    from hybrid.kernels import status

    for line in _environment_lines():
        print(line, file=stream)
    isa = _cpu_isa_line()
    if isa:
        print(isa, file=stream)
    rows = status()
    width = max(len(r.name) for r in rows)
    print(file=stream)
    print(f"{'op':<{width}}  device  available  built  reason / location", file=stream)
    for r in rows:
        print(f"{r.name:<{width}}  {r.device:<6}  {'yes' if r.available else 'no':<9}  "
              f"{'yes' if r.built else 'no':<5}  {r.reason}", file=stream)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m hybrid.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_build = sub.add_parser("build", help="prebuild the ops")
    p_build.add_argument("--op", action="append", choices=sorted(ALL_OPS), help="only this op (repeatable)")
    p_build.add_argument("--verbose", action="store_true", help="show compiler commands and output")
    sub.add_parser("report", help="print the availability table")
    p_check = sub.add_parser("check-cuda", help="compile every .cu with nvcc (no GPU needed)")
    p_check.add_argument("--arch", action="append", help="compute capability digits, e.g. 90 (default: 80 and 90)")
    p_check.add_argument("--link", action="store_true",
                         help="also compile the torch bindings, link each CUDA op and import it")
    p_check.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: CPU count)")
    args = parser.parse_args(argv)

    if args.command == "build":
        from hybrid.kernels import build

        outcome = build(args.op, verbose=args.verbose)
        for name, result in outcome.items():
            print(f"{name}: {result.splitlines()[0] if result else result}")
            if result.startswith("FAILED"):
                print("\n".join(result.splitlines()[1:]))
        print()
        print_report()
        return 1 if any(r.startswith("FAILED") for r in outcome.values()) else 0
    if args.command == "report":
        print_report()
        return 0
    from hybrid.kernels.cuda_check import DEFAULT_ARCHS, check_cuda_sources

    return check_cuda_sources(archs=tuple(args.arch or DEFAULT_ARCHS), link=args.link, jobs=args.jobs)


if __name__ == "__main__":
    sys.exit(main())
