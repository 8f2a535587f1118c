"""Megatron-Core's MoE flags in the trainer (issue 49, items 6 and 10): the keys, --expert-model-parallel-size
acted on, and every bad value refused in one line naming the flag and the fix before any process group."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.config import ConfigError, config_from_command_line
from hybrid.training.cli import parse_args

REPO = Path(__file__).resolve().parents[2]
# A tiny MoE model as Megatron-LM scripts spell one (experts carry no biases: --disable-bias-linear).
MOE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
       "--vocab-size", "64", "--micro-batch-size", "1", "--train-iters", "2", "--mock-data", "--eval-interval", "0",
       "--disable-bias-linear", "--swiglu", "--num-experts", "4"]


def test_the_moe_keys_reach_the_model():
    from hybrid.training.model import model_config

    cfg = parse_args(MOE + ["--moe-router-topk", "1", "--moe-layer-freq", "'([0]*1+[1]*1)'", "--moe-aux-loss-coeff",
                            "1e-2", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                            "--moe-router-bias-update-rate", "0.01", "--moe-expert-capacity-factor", "1.5",
                            "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate",
                            "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                            "--moe-per-layer-logging"], world_size=2)
    assert cfg.logging.moe_per_layer_logging  # the monitor's per-layer lines (hybrid.monitor.moe)
    gpt = model_config(cfg, vocab_size=64)
    assert (gpt.num_experts, gpt.moe_router_topk, gpt.moe_layer_freq) == (4, 1, (0, 1))
    assert gpt.moe_layer_pattern() == (False, True)
    assert (gpt.moe_aux_loss_coeff, gpt.moe_router_score_function, gpt.moe_router_bias_update_rate) == \
        (1e-2, "sigmoid", 0.01)
    assert gpt.moe_router_enable_expert_bias and gpt.moe_shared_expert_gate
    assert (gpt.moe_expert_capacity_factor, gpt.moe_shared_expert_intermediate_size) == (1.5, 16)
    assert (cfg.expert_parallel_size, gpt.expert_tensor_parallel_size) == (2, 1)
    assert model_config(parse_args(MOE + ["--moe-layer-freq", "2"], world_size=1), 64).moe_layer_pattern() == \
        (True, False)  # every 2nd layer from layer 0, as Megatron counts
    grouped = model_config(parse_args(MOE + ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"],
                                      world_size=1), 64)
    assert (grouped.moe_router_num_groups, grouped.moe_router_group_topk) == (2, 1)  # DeepSeek's group-limited


# issue 49, item 10: each bad value is one line naming the flag (and the flag's key) and what to change
@pytest.mark.parametrize("extra,world,match", [
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], 4,
     r"--num-experts 6 must be divisible by --expert-model-parallel-size 4: .*choose an ep that divides 6 "
     r"\(set by --num-experts, --expert-model-parallel-size\)$"),
    (["--moe-router-topk", "5"], 1, r"--moe-router-topk 5 must lie in \[1, --num-experts 4\]"),
    (["--expert-model-parallel-size", "4"], 2,
     r"^--expert-model-parallel-size 4 must divide the data-parallel ranks dp\*cp = 2\*1 = 2: .*choose a divisor of "
     r"2 \(world size 2 = tp 1 x pp 1 x dp 2\) \(set by --expert-model-parallel-size\)$"),
    # ep 3 divides dp 6, but not the 4 experts
    (["--expert-model-parallel-size", "3", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 12,
     r"--num-experts 4 must be divisible by --expert-model-parallel-size 3"),
    (["--moe-expert-capacity-factor", "0"], 1,
     r"^config key 'model.moe_expert_capacity_factor' must be > 0.0, got 0.0 \(set by --moe-expert-capacity-factor\)$"),
    (["--moe-expert-capacity-factor", "-1.5"], 1, r"'model.moe_expert_capacity_factor' must be > 0.0, got -1.5"),
    (["--moe-layer-freq", "([0]*1+[1]*2)"], 1, r"--moe-layer-freq \(0, 1, 1\) must be a positive integer N .* or one "
                                               r"0/1 per layer \(2 of them\)"),
    (["--moe-shared-expert-gate"], 1, r"--moe-shared-expert-gate needs a shared expert: set "
                                      r"--moe-shared-expert-intermediate-size"),
    (["--expert-tensor-parallel-size", "3", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
     r"--expert-tensor-parallel-size 3 must be 1 .* or the tensor-parallel size 2"),
    (["--moe-router-group-topk", "1"], 1, r"--moe-router-group-topk needs --moe-router-num-groups"),
    (["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"], 1,
     r"--num-experts 4 must be divisible by --moe-router-num-groups 3"),
    # top-2 of 4 experts in 4 groups of 1: one group cannot hold 2 experts
    (["--moe-router-num-groups", "4", "--moe-router-group-topk", "1"], 1,
     r"--moe-router-group-topk 1 cannot take --moe-router-topk 2 experts from --moe-router-num-groups 4 groups of "
     r"1: choose a group_topk in \[2, 2\]"),
])
def test_a_bad_moe_setting_is_one_line_naming_the_flag(extra, world, match):
    with pytest.raises(ConfigError, match=match) as raised:
        parse_args(MOE + extra, world_size=world)
    assert "\n" not in str(raised.value)


def test_expert_parallelism_needs_an_moe_model():
    dense = MOE[:-2]  # without --num-experts 4
    with pytest.raises(ConfigError, match=r"--expert-model-parallel-size 2 shares out the experts of an MoE model, "
                                          r"and this model is dense \(--num-experts unset\): set --num-experts, or "
                                          r"leave --expert-model-parallel-size 1"):
        parse_args(dense + ["--expert-model-parallel-size", "2"], world_size=2)
    notes = []  # --num-experts 1 (Megatron-DeepSpeed's dense scripts) is dense: ep 1 and the MoE keys are noted
    cfg = config_from_command_line(dense + ["--num-experts", "1", "--expert-model-parallel-size", "1",
                                            "--moe-router-topk", "2", "--moe-train-capacity-factor", "1.0"],
                                   notes=notes)
    assert cfg.model.num_experts is None and cfg.model.moe_router_topk is None and cfg.expert_parallel_size is None
    assert [n.split(" (")[0] for n in notes] == ["--num-experts 1", "--expert-model-parallel-size 1",
                                                 "--moe-router-topk 2", "--moe-train-capacity-factor 1.0"]


def test_an_moe_preset_is_not_read_as_dense():
    from model_zoo.presets import get_preset

    assert get_preset("tiny-moe").is_moe
    cfg = config_from_command_line(["--model", "tiny-moe", "--moe-router-topk", "1"])
    assert cfg.model.moe_router_topk == 1  # kept: the preset's model is MoE


def test_every_refused_moe_flag_is_listed_in_one_launch():
    argv = MOE + ["--moe-router-topk-limited-devices", "2", "--moe-input-jitter-eps", "0.01",
                  "--moe-token-dispatcher-type", "flex", "--moe-enable-deepep", "--moe-use-upcycling",
                  "--moe-expert-parallel-size", "2", "--moe-permute-fusion", "--moe-router-fusion"]
    with pytest.raises(ConfigError) as raised:
        config_from_command_line(argv)
    message = str(raised.value)
    assert message.startswith("6 settings need changing: (1) ") and "\n" not in message
    for flag in ("--moe-router-topk-limited-devices 2", "--moe-input-jitter-eps 0.01",
                 "--moe-token-dispatcher-type flex", "--moe-enable-deepep", "--moe-use-upcycling",
                 "--moe-expert-parallel-size 2"):
        assert f"{flag} is a Megatron-LM" in message, flag
    assert "--moe-permute-fusion" not in message and "--moe-router-fusion" not in message  # no-ops, noted


def test_the_trainer_builds_the_topology_with_ep(monkeypatch):
    """The trainer hands --expert-model-parallel-size to the Topology it builds (the run itself: the slow test
    below)."""
    import hybrid
    from hybrid.training import trainer

    built = {}

    class Stop(Exception):
        pass

    def topology(**kwargs):
        built.update(kwargs)
        raise Stop

    monkeypatch.setattr(hybrid, "init_distributed", lambda **kwargs: None)
    monkeypatch.setattr(trainer, "Topology", topology)
    with pytest.raises(Stop):
        trainer.Trainer(parse_args(MOE + ["--expert-model-parallel-size", "2"], world_size=2))
    assert (built["ep"], built["tp"], built["pp"]) == (2, 1, 1)


@pytest.mark.slow
def test_an_expert_parallel_run_trains_and_records_ep_in_its_layout(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    argv = MOE + ["--expert-model-parallel-size", "2", "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
                  "--log-interval", "1", "--moe-per-layer-logging"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "hybrid.train", *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tp=1 dp=2 pp=1 ep=2" in proc.stdout
    assert len([line for line in proc.stdout.splitlines() if line.startswith("iteration")]) == 2
    assert len([line for line in proc.stdout.splitlines() if line.startswith("moe layer ")]) == 2 * 2  # per layer
    metadata = json.loads((tmp_path / "ckpt" / "iter_0000002" / "metadata.json").read_text())
    assert metadata["layout"]["ep"] == 2 and metadata["model_config"]["num_experts"] == 4


def test_every_moe_flag_docs_training_md_names_is_a_key_an_entry_or_a_family():
    """docs/training.md's Mixture of Experts section names flags; each is a key's, a MEGATRON_FLAGS entry's (with
    the verdict the section gives) or a refused family's."""
    import re

    from hybrid.config.megatron_flags import MEGATRON_FLAGS, family_of
    from hybrid.config.spellings import SPELLINGS

    text = (REPO / "docs" / "training.md").read_text().split("## Mixture of Experts")[1].split("\n## ")[0]
    entries = {f.flag: f for f in MEGATRON_FLAGS}
    accepted = text.split("**accepted, no effect**")[1].split("* **refused**")[0]
    refused = text.split("* **refused**")[1].split("* **Megatron-DeepSpeed's**")[0]
    for flag in set(re.findall(r"--[a-z][a-z0-9-]+", text)) - {"--nnodes", "--nproc-per-node"}:  # torchrun's
        assert flag in SPELLINGS or flag in entries or family_of(flag) is not None, flag
    for flag in re.findall(r"--[a-z][a-z0-9-]+", accepted):
        assert entries[flag].accepted, flag
    for flag in set(re.findall(r"--[a-z][a-z0-9-]+", refused)) - set(SPELLINGS):
        entry = entries.get(flag)
        assert entry is None and family_of(flag) is not None or not entry.accepted or entry.values, flag
