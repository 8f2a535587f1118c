"""The blockwise quantization codec on CPU: the torch path against the compiled cpu_quantize op.

    python benchmarks/quantize_cpu.py [--sizes 1M 16M] [--repeats 7] [--threads 0 1] \\
        [--json benchmarks/results/quantize_cpu.json]

For each operation (pack, unpack into ``out``, unpack_sum into an fp32 ``out``), bits
(8, 4, 1) and size (elements of fp32 input, as ``rows`` rows of ``size / rows``), both
paths run interleaved, one call each per round after a warm-up, so load from other
processes hits them alike; the table gives the median over rounds. GB/s counts the fp32
side: ``size * 4`` bytes per call (the input of pack, the decoded rows of unpack and
unpack_sum). Every case also checks that the two paths give the same bytes and bits.

hybrid.kernels.quantize sends a CPU operation to the compiled op when it was faster here
(its CPU_KERNEL_OPS); docs/compression.md "CPU speed" holds the table.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.cpu_adam import cpu_name, timed_rounds  # noqa: E402  (the CPU model; interleaved timing)
from hybrid.argument_parser import ArgumentParser  # noqa: E402
from hybrid.kernels import quantize as Q  # noqa: E402
from hybrid.kernels.builder import default_cache_root, default_csrc_dir  # noqa: E402
from hybrid.kernels.modes import KernelMode  # noqa: E402
from hybrid.kernels.registry import KernelRegistry  # noqa: E402

OPS = ("pack", "unpack", "unpack_sum")


def _size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if text[-1:] in "KMG" else text) * mult


def _label(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else str(n)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def run_case(op, name: str, bits: int, size: int, rows: int, block: int, repeats: int) -> dict:
    k = size // rows
    gen = torch.Generator().manual_seed(bits * 7 + size)
    x = torch.randn(rows, k, generator=gen)
    wire_t = torch.empty(rows, Q.wire_bytes(k, bits, block), dtype=torch.uint8)
    wire_c = torch.empty_like(wire_t)
    wire = Q.pack(x, bits, block, use_kernel=False)
    if name == "pack":
        contenders = {
            "torch": lambda: Q._pack_torch(x, bits, block, wire_t),
            "cpp": lambda: op.pack(x, wire_c, bits, block, ""),
        }
        check = lambda: torch.equal(wire_t, wire_c)  # noqa: E731
    elif name == "unpack":
        out_t, out_c = torch.empty(rows, k), torch.empty(rows, k)
        contenders = {
            "torch": lambda: Q._unpack_torch(wire, k, bits, block, out_t),
            "cpp": lambda: op.unpack(wire, out_c, k, bits, block, ""),
        }
        check = lambda: same_bits(out_t, out_c)  # noqa: E731
    else:
        out_t, out_c = torch.empty(k), torch.empty(k)
        contenders = {
            "torch": lambda: Q._unpack_sum_torch(wire, k, bits, block, out_t),
            "cpp": lambda: op.unpack_sum(wire, out_c, k, bits, block, ""),
        }
        check = lambda: same_bits(out_t, out_c)  # noqa: E731
    times = timed_rounds(contenders, repeats)
    if not check():
        raise SystemExit(f"MISMATCH: {name} bits={bits} size={size}: the two paths differ")
    gb = size * 4 / 1e9
    med = {n: statistics.median(t) for n, t in times.items()}
    return {
        "op": name, "bits": bits, "elements": size, "rows": rows, "block": block,
        "torch_s": med["torch"], "cpp_s": med["cpp"],
        "torch_gbps": gb / med["torch"], "cpp_gbps": gb / med["cpp"],
        "speedup": med["torch"] / med["cpp"], "bit_identical": True,
        "torch_s_all": times["torch"], "cpp_s_all": times["cpp"],
    }


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["1M", "16M"], help="fp32 elements per call (K/M suffixes)")
    parser.add_argument("--rows", type=int, default=4, help="rows (ranks) the elements are split into")
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--bits", type=int, nargs="+", default=list(Q.BITS))
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (median reported)")
    parser.add_argument("--threads", type=int, nargs="+", default=[0],
                        help="torch/OpenMP thread counts to run at, in turn (0: torch's default)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)

    default_threads = torch.get_num_threads()
    thread_counts = [t or default_threads for t in args.threads]
    op = KernelRegistry(KernelMode.REQUIRE, default_cache_root(), default_csrc_dir()).load("cpu_quantize")
    sizes = [_size(s) for s in args.sizes]
    load_before = os.getloadavg()
    results = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for name in args.ops:
            for bits in args.bits:
                for size in sizes:
                    r = run_case(op, name, bits, size, args.rows, args.block, args.repeats)
                    results.append({"threads": threads, **r})
    torch.set_num_threads(default_threads)
    load_after = os.getloadavg()

    print(f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs; torch {torch.__version__}; "
          f"cpu_quantize path {op.default_isa()}")
    print(f"rows = {args.rows}, block = {args.block}, median of {args.repeats} interleaved rounds; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print("GB/s of fp32 (elements x 4 bytes per call); both paths bit-identical in every case\n")
    print("| threads | op | bits | elements | torch GB/s | C++ GB/s | C++ / torch |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['threads']} | {r['op']} | {r['bits']} | {_label(r['elements'])} | {r['torch_gbps']:.2f} | "
              f"{r['cpp_gbps']:.2f} | {r['speedup']:.1f}x |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "command": " ".join(["python", Path(sys.argv[0]).as_posix(), *(sys.argv[1:] if argv is None else argv)]),
            "cpu": cpu_name(), "logical_cpus": os.cpu_count(), "torch": torch.__version__,
            "threads": thread_counts, "isa": op.default_isa(), "repeats": args.repeats,
            "load_average_before": load_before, "load_average_after": load_after,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "gbps_counts": "fp32 bytes per call: elements * 4",
        }
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
