"""Peak FLOP/s per device and model FLOPs utilization (MFU).

::

    tflops_per_device = flops_per_token * tokens_per_sec_per_device / 1e12
    mfu               = tflops_per_device / peak_tflops_per_device

``flops_per_token`` (forward + backward of the model, from
``model_zoo.flops.flops_per_token``) is supplied by the caller. The peak
comes from one of three sources, always reported with its label:

* ``user``     - ``--peak-tflops``;
* ``table``    - published dense tensor-core peaks of known GPUs (below);
* ``measured`` - on CPU, a matmul probe timed once at start-up.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence, Tuple

import torch

from hybrid.layout import PRECISIONS

# Published dense (no 2:4 sparsity) peaks in TFLOP/s, per GPU:
# (name substrings that must all appear in torch.cuda.get_device_name(), substrings
# that must not, bf16/fp16 tensor core, fp32 without TF32). First match wins.
GPU_PEAK_TFLOPS: Tuple[Tuple[Tuple[str, ...], Tuple[str, ...], float, float], ...] = (
    (("A100",), (), 312.0, 19.5),
    (("H100", "PCIe"), (), 756.0, 51.2),
    (("H100",), ("NVL", "PCIe"), 989.4, 66.9),  # SXM5 (reported as "H100 80GB HBM3")
    (("H200",), ("NVL",), 989.4, 66.9),  # SXM
)

SOURCES = ("user", "table", "measured")


@dataclasses.dataclass(frozen=True)
class PeakFlops:
    """The peak FLOP/s of one device and where the number comes from."""

    tflops: float
    source: str  # one of SOURCES
    detail: str  # e.g. the GPU name, or how the probe ran

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"peak source must be one of {SOURCES}, got {self.source!r}")
        if not self.tflops > 0:
            raise ValueError(f"peak TFLOP/s must be > 0, got {self.tflops!r}")

    def describe(self) -> str:
        return f"{self.tflops:.4g} TFLOP/s per device ({self.source}: {self.detail})"


def table_peak_tflops(device_name: str, precision: str) -> Optional[float]:
    """The published peak of a GPU named ``device_name`` for ``precision``
    (``"bf16"``/``"fp16"`` use the tensor-core column, ``"fp32"`` the plain fp32
    one), or None for a GPU not in the table."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    for required, excluded, half, single in GPU_PEAK_TFLOPS:
        if all(s in device_name for s in required) and not any(s in device_name for s in excluded):
            return single if precision == "fp32" else half
    return None


class MatmulProbe:
    """Measures the matmul FLOP/s this process reaches, once.

    Square ``size`` x ``size`` matmuls run for about ``duration_s`` seconds in
    rounds; the best round's rate is the peak. The first call to
    :meth:`tflops` measures, later calls return the same number. It runs on
    torch's current intra-op thread count, so call it after choosing that
    (the CPU a process may use is the "device" whose peak MFU refers to).
    """

    def __init__(self, size: int = 1024, duration_s: float = 2.0, rounds: int = 8,
                 dtype: torch.dtype = torch.float32, device: str = "cpu"):
        if size < 1 or duration_s <= 0 or rounds < 1:
            raise ValueError("MatmulProbe needs size >= 1, duration_s > 0 and rounds >= 1")
        self.size, self.duration_s, self.rounds = size, duration_s, rounds
        self.dtype, self.device = dtype, torch.device(device)
        self._result: Optional[float] = None
        self.matmuls_run = 0

    def tflops(self) -> float:
        if self._result is None:
            self._result = self._measure()
        return self._result

    def describe(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return (f"{dtype} {self.size}x{self.size} matmul probe on {self.device.type}, "
                f"{torch.get_num_threads()} thread(s)")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _measure(self) -> float:
        gen = torch.Generator(device="cpu").manual_seed(0)
        a = torch.randn(self.size, self.size, generator=gen).to(self.device, self.dtype)
        b = torch.randn(self.size, self.size, generator=gen).to(self.device, self.dtype)
        out = torch.empty_like(a)
        flops_per_matmul = 2.0 * self.size ** 3
        torch.mm(a, b, out=out)  # warm-up: thread pool start, first-touch of ``out``
        self._sync()
        round_s = self.duration_s / self.rounds
        best = 0.0
        for _ in range(self.rounds):
            n, start = 0, time.perf_counter()
            while True:
                torch.mm(a, b, out=out)
                n += 1
                if n % 4 == 0 or self.device.type != "cuda":
                    self._sync()
                    elapsed = time.perf_counter() - start
                    if elapsed >= round_s:
                        break
            self.matmuls_run += n
            best = max(best, n * flops_per_matmul / elapsed)
        return best / 1e12


def resolve_peak_flops(device: torch.device, precision: str, user_tflops: Optional[float] = None,
                       probe: Optional[MatmulProbe] = None) -> Optional[PeakFlops]:
    """The peak to compute MFU against, or None when it is unknown.

    ``user_tflops`` (``--peak-tflops``) wins; then the GPU table for a CUDA
    device; on CPU the ``probe`` (a default :class:`MatmulProbe` if None). A
    GPU missing from the table yields None: pass ``--peak-tflops`` for MFU.
    """
    if user_tflops is not None:
        if not user_tflops > 0:
            raise ValueError(f"--peak-tflops must be > 0, got {user_tflops!r}")
        return PeakFlops(float(user_tflops), "user", "--peak-tflops")
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = table_peak_tflops(name, precision)
        if peak is None:
            return None
        kind = "fp32" if precision == "fp32" else "dense bf16/fp16 tensor core"
        return PeakFlops(peak, "table", f"{name}, {kind}")
    probe = probe or MatmulProbe()
    return PeakFlops(probe.tflops(), "measured", probe.describe())


def tflops_per_device(flops_per_token: float, tokens_per_sec_per_device: float) -> float:
    """Achieved model TFLOP/s of one device."""
    return flops_per_token * tokens_per_sec_per_device / 1e12


def model_flops_utilization(achieved_tflops: float, peak: Optional[PeakFlops]) -> Optional[float]:
    """``achieved / peak`` as a fraction (0.42 means 42 %), or None without a peak."""
    return None if peak is None else achieved_tflops / peak.tflops


def known_gpus() -> Sequence[str]:
    """Human-readable names of the GPUs in the peak table."""
    return [" ".join(req) + (f" (not {', '.join(exc)})" if exc else "")
            for req, exc, _, _ in GPU_PEAK_TFLOPS]
