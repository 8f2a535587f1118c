"""DeepSpeed configs that use ZeRO++'s and the 1-bit optimizers' keys load unchanged and train (4 gloo ranks as
2 emulated nodes x 2): ``zero_quantized_gradients`` / ``zero_quantized_weights`` / ``zero_hpz_partition_size``,
``OneBitAdam`` and ``ZeroOneAdam``. Each trains a small GPT a few steps; the loss must fall and the last step must
use the compressed collectives the keys ask for."""

import math

import pytest
import torch

from tests.multiproc import run_distributed
from tests.plan.harness import gpt_config

WORLD, STEPS = 4, 6
SPEC = dict(hidden=64, layers=2, heads=4, seq=32, vocab=256)
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 0}
CONFIGS = {
    "zero++": {**BASE, "zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                                             "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
                                             "stage3_param_persistence_threshold": 100,
                                             # no prefetch window, so nothing kept for backward: this model fits
                                             # any window, and hpZ would have no backward gather to move
                                             "stage3_prefetch_bucket_size": 0},
               "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}},
    "onebit": {**BASE, "zero_optimization": {"stage": 2, "zero_quantized_weights": True},
               "optimizer": {"type": "OneBitAdam", "params": {"lr": 3e-3, "freeze_step": 3, "cuda_aware": False,
                                                              "comm_backend_name": "nccl"}}},
    # 0/1 Adam applies no bias correction (as DeepSpeed's), so its first steps are several times Adam's: a run this
    # short needs a small learning rate (a long one warms the rate up until var_freeze_step)
    "zero_one": {**BASE, "zero_optimization": {"stage": 0},
                 "optimizer": {"type": "ZeroOneAdam", "params": {
                     "lr": 1e-4, "bias_correction": False, "var_freeze_step": 4, "var_update_scaler": 2,
                     "local_step_scaler": 2, "local_step_clipper": 2, "cuda_aware": False,
                     "comm_backend_name": "nccl"}}},
}
# what the last step of each sent over data parallelism
EXPECTED = {"zero++": ("all_gather/dp_node", "reduce_scatter/dp"), "onebit": ("all_to_all/dp",),
            "zero_one": ()}


def _train_all():
    import hybrid
    from hybrid import Topology
    from model_zoo import GPTModel

    out = {}
    for name, ds in CONFIGS.items():
        torch.manual_seed(0)
        topo = Topology(ranks_per_node=2)
        cfg = gpt_config(SPEC)
        model = GPTModel(cfg, topo)
        engine = hybrid.initialize(model, ds, topology=topo)
        gen = torch.Generator().manual_seed(7)
        x = torch.randint(0, cfg.vocab_size, (2 * topo.dp_size, cfg.seq_length), generator=gen)
        mine = x[2 * topo.dp_rank: 2 * topo.dp_rank + 2]
        losses = []
        for _ in range(STEPS):  # the same batch: the loss must fall
            loss = engine(mine, mine)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[name] = {"losses": losses, "comm": sorted(engine.comm_report()),
                     "type": engine.config.optimizer.type, "stage": engine.config.zero.stage}
        engine.optimizer.remove_hooks()
        engine.close()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_train_all, WORLD, timeout=300)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_deepspeed_config_trains(results, name):
    for r in results:
        got = r[name]
        assert all(math.isfinite(v) for v in got["losses"]) and got["losses"][-1] < got["losses"][0], got["losses"]
        for op in EXPECTED[name]:
            assert op in got["comm"], (name, got["comm"])
    assert results[0]["onebit"]["type"] == "onebit_adam" and results[0]["zero_one"]["type"] == "zero_one_adam"
