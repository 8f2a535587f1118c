"""Part 1 of the GPU verification run: the environment, and the two peaks the later parts compare with.

Records the GPU's name, driver, CUDA, torch and NCCL versions, then measures
  * copy bandwidth: a 2 GiB device-to-device copy (bytes read + written per second; part 2's own
    measurement, check_kernels.copy_bandwidth, which part 2 divides each kernel's bandwidth by);
  * bf16 matmul TFLOP/s: square bf16 matmuls (hybrid.monitor.flops.MatmulProbe), printed beside the
    spec sheet's dense bf16 peak of the GPU found (results.spec_peak_bf16_tflops(), from hybrid's GPU
    table; the H200's where the table lacks the GPU, which info's spec_gpu names).
Part 5 reports MFU against both the spec peak and this measured peak (read from part1_env.json).
Checks: a CUDA device is visible, and both measurements are positive and finite. Dry run: CPU, small
sizes, bf16 matmul on the CPU.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from benchmarks.gpu.results import (  # noqa: E402
    PartResult, dry_run_choice, run_part, spec_gpu_name, spec_peak_bf16_tflops)


def driver_version() -> str:
    """The NVIDIA driver, as nvidia-smi reports it (there is no torch call for it)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (nvidia-smi not found)"


def nccl_version() -> str:
    if not torch.cuda.is_available():
        return "n/a on CPU"
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def body(res: PartResult) -> None:
    from benchmarks.gpu.check_kernels import Target, copy_bandwidth
    from hybrid.monitor.flops import MatmulProbe, table_peak_tflops

    dry = res.dry_run
    device = "cpu" if dry else "cuda"
    if not dry and not res.check("a CUDA device is visible", torch.cuda.is_available(),
                                 "torch.cuda.is_available() is False"):
        return
    name = "CPU (dry run)" if dry else torch.cuda.get_device_name(0)
    spec = spec_peak_bf16_tflops()
    res.info.update(device=name, driver="n/a on CPU" if dry else driver_version(), cuda=torch.version.cuda,
                    torch=torch.__version__, nccl=nccl_version(),
                    spec_gpu=spec_gpu_name(), spec_peak_bf16_tflops=spec,
                    hybrid_table_bf16_tflops=None if dry else table_peak_tflops(name, "bf16"))
    if not dry:
        props = torch.cuda.get_device_properties(0)
        res.info.update(memory_gib=props.total_memory / 2**30, sms=props.multi_processor_count,
                        capability=f"{props.major}.{props.minor}")
    bw = copy_bandwidth(Target(dry))
    size = dry_run_choice(dry, 8192, 256)
    probe = MatmulProbe(size=size, duration_s=dry_run_choice(dry, 2.0, 0.3), rounds=dry_run_choice(dry, 8, 3),
                        dtype=torch.bfloat16, device=device)
    tflops = probe.tflops()
    res.info.update(copy_bandwidth_bytes_per_s=bw, matmul_bf16_tflops=tflops, matmul_probe=probe.describe())
    res.check("copy bandwidth measured", bw > 0 and math.isfinite(bw), f"{bw}")
    res.check("bf16 matmul TFLOP/s measured", tflops > 0 and math.isfinite(tflops), f"{tflops}")
    for key in ("device", "driver", "cuda", "torch", "nccl"):
        print(f"{key:<8}{res.info[key]}")
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s (read + write); bf16 matmul {tflops:.1f} TFLOP/s measured, "
          f"spec peak {spec:.0f} of {res.info['spec_gpu']} ({100 * tflops / spec:.1f}% of it)", flush=True)
    res.headline = (f"{name}; torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {res.info['nccl']}; "
                    f"copy {bw / 1e12:.2f} TB/s; bf16 mm {tflops:.0f} TFLOP/s (spec {spec:.0f})")


if __name__ == "__main__":
    sys.exit(run_part(1, "env", body, __doc__))
