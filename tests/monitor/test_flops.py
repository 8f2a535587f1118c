import time

import pytest
import torch

from hybrid.monitor.flops import (MatmulProbe, PeakFlops, model_flops_utilization,
                                  resolve_peak_flops, table_peak_tflops, tflops_per_device)


@pytest.mark.parametrize("name,precision,expected", [
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100-PCIE-40GB", "fp16", 312.0),
    ("NVIDIA A100-SXM4-40GB", "fp32", 19.5),
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "bf16", 756.0),
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA H200", "fp32", 66.9),
])
def test_table_lookup(name, precision, expected):
    assert table_peak_tflops(name, precision) == expected


@pytest.mark.parametrize("name", ["NVIDIA H100 NVL", "NVIDIA H200 NVL", "Tesla V100-SXM2-16GB",
                                  "NVIDIA GeForce RTX 4090"])
def test_unknown_gpus_have_no_table_peak(name):
    assert table_peak_tflops(name, "bf16") is None


def test_table_rejects_unknown_precision():
    with pytest.raises(ValueError, match="precision"):
        table_peak_tflops("NVIDIA A100", "int8")


def test_user_peak_overrides_everything():
    peak = resolve_peak_flops(torch.device("cpu"), "fp32", user_tflops=123.0)
    assert peak == PeakFlops(123.0, "user", "--peak-tflops")
    with pytest.raises(ValueError, match="--peak-tflops"):
        resolve_peak_flops(torch.device("cpu"), "fp32", user_tflops=0.0)


def test_mfu_arithmetic_by_hand():
    # A 1.5B-parameter model at 6 FLOPs per parameter per token: 9e9 FLOPs/token.
    # 8 devices sharing 200,000 tokens/s -> 25,000 tokens/s/device
    # -> 9e9 * 25,000 = 2.25e14 FLOP/s = 225 TFLOP/s per device; on a 312 peak: 72.115...%.
    achieved = tflops_per_device(9e9, 200_000 / 8)
    assert achieved == pytest.approx(225.0, rel=1e-12)
    mfu = model_flops_utilization(achieved, PeakFlops(312.0, "table", "A100"))
    assert mfu == pytest.approx(225.0 / 312.0, rel=1e-12)
    assert model_flops_utilization(achieved, None) is None


def test_cpu_probe_is_plausible_and_cached():
    probe = MatmulProbe(size=256, duration_s=0.2, rounds=4)
    first = probe.tflops()
    matmuls = probe.matmuls_run
    # Any CPU that runs this suite does between 0.1 GFLOP/s and 100 TFLOP/s of fp32 matmul.
    assert 1e-4 < first < 100.0
    assert matmuls >= 4
    start = time.perf_counter()
    assert probe.tflops() == first
    assert time.perf_counter() - start < 0.01
    assert probe.matmuls_run == matmuls  # nothing ran again
    peak = resolve_peak_flops(torch.device("cpu"), "fp32", probe=probe)
    assert peak.source == "measured" and peak.tflops == first
    assert "matmul probe" in peak.describe() and "measured" in peak.describe()


def test_peak_validation():
    with pytest.raises(ValueError, match="source"):
        PeakFlops(1.0, "guess", "")
    with pytest.raises(ValueError, match="> 0"):
        PeakFlops(0.0, "table", "")
