"""Every csrc/cuda/*.cu compiles with nvcc for sm_80 and sm_90 with warnings as errors.

Takes about 20-30 s on two cores; skipped where nvcc is absent. CI may instead run
``python -m hybrid.kernels check-cuda`` as its own step and deselect this test with
``-k 'not check_cuda'``.
"""

from __future__ import annotations

import io

import pytest

from hybrid.kernels.cuda_check import check_cuda_sources
from hybrid.kernels.ops import find_nvcc


@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found")
def test_check_cuda_compiles_every_source():
    out = io.StringIO()
    code = check_cuda_sources(stream=out)
    text = out.getvalue()
    assert code == 0, text
    for name in ("layer_norm.cu", "multi_tensor_adam.cu", "quantize.cu", "status.cu"):
        assert f"ok   {name}" in text
    assert "sm_80, sm_90" in text


def test_check_cuda_skips_cleanly_without_nvcc(monkeypatch):
    import hybrid.kernels.cuda_check as cuda_check

    monkeypatch.setattr(cuda_check, "find_nvcc", lambda: None)
    out = io.StringIO()
    assert check_cuda_sources(stream=out) == 0
    assert "SKIPPED - nvcc not found" in out.getvalue()


def test_a_compiler_that_never_finishes_is_stopped_and_reported(monkeypatch):
    import hybrid.kernels.cuda_check as cuda_check

    monkeypatch.setattr(cuda_check, "COMMAND_TIMEOUT_S", 0.5)
    result = cuda_check._run(["sleep", "30"], "stuck.cu")
    assert not result.ok
    assert result.seconds < 10
    assert "sleep was stopped after 0.5 s without finishing" in result.output
