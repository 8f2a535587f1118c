"""Optimizer offload to host memory (stages 1-3) over 4 gloo ranks: parity, and no duplicated memory on CPU."""

import pytest
import torch

from tests.multiproc import run_distributed
from tests.zero.common import TiedMLP, max_rel_diff, rel_diff_list
from tests.zero.test_gpt_parity import _reference
from tests.zero.test_stage3 import _gpt_run, _losses

WORLD = 4


def _suite():
    from hybrid import Topology

    topo = Topology(tp=2)
    res = {}
    for stage in (1, 2, 3):
        res[("fp32", stage)] = _gpt_run(topo, stage, offload="cpu")
    for stage in (2, 3):
        for offload in ("none", "cpu"):
            res[("bf16", stage, offload)] = _gpt_run(topo, stage, dtype=torch.bfloat16, steps=2, offload=offload,
                                                    threshold=0)
    with _separate_host_twins():
        for stage in (1, 2, 3):
            res[("twins", stage)] = _gpt_run(topo, stage, offload="cpu", gas=2)
    return res


class _separate_host_twins:
    """Give the host twins of the reduced gradients their own memory although the model is on the CPU, as on a
    GPU machine: the gradients must then really be copied (streamed during backward) to reach the optimizer.
    Stage 3 reduces straight into its host gradient partition, so only stages 1-2 change."""

    def __enter__(self):
        from hybrid.zero import offload

        self.original = original = offload.ChunkOffload.__init__

        def separate(chunks, device_grads, device_params, host, **kwargs):
            original(chunks, device_grads, device_params, host, **kwargs)
            for twin in chunks._grads:
                twin.same, twin.host = False, torch.zeros_like(twin.device_tensor)
            chunks.grads = [twin.host for twin in chunks._grads]
            chunks.same = False

        offload.ChunkOffload.__init__ = separate

    def __exit__(self, *exc):
        from hybrid.zero import offload

        offload.ChunkOffload.__init__ = self.original


@pytest.fixture(scope="module")
def results():
    return run_distributed(_suite, WORLD, timeout=300)


@pytest.fixture(scope="module")
def reference():
    return _reference()


def _assert_parity(results, reference, key):
    ref_losses, ref_norms, ref_params = reference
    assert rel_diff_list(_losses(results, key), ref_losses) < 1e-5
    assert max_rel_diff(results[0][key]["params"], ref_params) < 1e-5
    for r in results:
        assert rel_diff_list(r[key]["norms"], ref_norms) < 1e-5


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_fp32_parity_with_single_process_adamw(results, reference, stage):
    _assert_parity(results, reference, ("fp32", stage))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_stream_to_separate_host_memory_during_backward(results, reference, stage):
    # Two micro-batches per step: only the last one's reductions are final, and only those are streamed.
    key = ("twins", stage)
    _assert_parity(results, reference, key)
    if stage < 3:  # stage 3 lands every bucket in host memory itself
        for r in results:
            streamed = r[key]["streamed"]
            assert streamed and all(n == segments > 0 for n, segments in streamed), streamed


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_on_a_cpu_model_holds_no_second_copy(results, stage):
    for r in results:
        plain, off = r[("bf16", stage, "none")], r[("bf16", stage, "cpu")]
        # The same arithmetic on the same tensors: identical losses, identical weights.
        assert off["losses"] == plain["losses"]
        if off["params"] is not None:
            assert max_rel_diff(off["params"], plain["params"]) == 0.0
        # Not one byte more than without offload: the host tensors are the partition's own.
        keys = ("params", "grads", "master", "optimizer_states", "total")
        assert {k: off["memory"][k] for k in keys} == {k: plain["memory"][k] for k in keys}
        assert off["memory"].get("offload_staging", 0) == 0 and off["memory"].get("lowp_staging", 0) == 0
        # ...and the report says which bytes are host-resident because of offload.
        assert off["memory"]["host_bytes"] == off["memory"]["master"] + off["memory"]["optimizer_states"] > 0
        assert plain["memory"]["host_bytes"] == 0
        assert off["memory"]["device_bytes"] == off["memory"]["total"] - off["memory"]["host_bytes"]


def test_offload_state_lives_on_the_cpu_and_stage0_refuses_it():
    from hybrid import Topology
    from hybrid.zero import ZeroConfigError
    from tests.zero.common import make_zero

    torch.manual_seed(0)
    model = TiedMLP().to(torch.bfloat16)
    opt = make_zero(model, Topology.local(), stage=2, lr=1e-3, offload_optimizer="cpu")
    assert all(p.master.device.type == "cpu" for p in opt.partitions)
    assert all(t.device.type == "cpu" for g in opt.inner.groups for t in g.state.values())
    with pytest.raises(ZeroConfigError, match="zero.offload_optimizer: offload to cpu needs ZeRO stage 1, 2 or 3"):
        make_zero(TiedMLP(), Topology.local(), stage=0, offload_optimizer="cpu")
    with pytest.raises(ZeroConfigError, match="offload must be one of none, cpu"):
        make_zero(TiedMLP(), Topology.local(), stage=1, offload_optimizer="nvme")
