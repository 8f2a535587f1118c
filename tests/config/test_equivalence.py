"""A flag, a YAML key and a DeepSpeed key that mean the same setting give the same config.

Each case is one setting (or a few that only make sense together) written the
three ways; the three whole configs must be equal, through the engine's loader
(``load_config``) and through the trainer's ``--config FILE``.
"""

import json

import pytest

from hybrid.config import config_from_command_line, load_config

CASES = {
    "zero-3 persistence threshold": (
        ["--zero-stage", "3", "--zero-persistence-threshold", "1000"],
        "zero: {stage: 3, persistence_threshold: 1000}",
        {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000}}),
    "zero-3 live parameters and prefetch": (
        ["--zero-stage", "3", "--zero-max-live-parameters", "3e8", "--zero-prefetch-bucket-size", "2e7"],
        "zero: {stage: 3, max_live_parameters: 3e8, prefetch_bucket_size: 2.0e+7}",
        {"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 3e8, "stage3_prefetch_bucket_size": 2e7}}),
    "overlap_comm off": (
        ["--no-zero-overlap-comm"],
        "zero: {overlap_comm: false}",
        {"zero_optimization": {"overlap_comm": False}}),
    "bucket size": (
        ["--zero-stage", "2", "--zero-bucket-size", "5e7"],
        "zero: {stage: 2, bucket_size: 5e7}",
        {"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7}}),
    "cpu offload": (
        ["--zero-stage", "1", "--offload-optimizer", "cpu"],
        "zero: {stage: 1, offload_optimizer: cpu}",
        {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}),
    "bf16": (["--bf16"], "precision: bf16", {"bf16": {"enabled": True}}),
    "fp16 loss scaling": (
        ["--fp16", "--initial-loss-scale", "4096", "--loss-scale-window", "500", "--hysteresis", "3",
         "--min-loss-scale", "2"],
        "precision: fp16\nloss_scaling: {initial_scale_power: 12, loss_scale_window: 500, hysteresis: 3, "
        "min_loss_scale: 2}",
        {"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 3,
                  "min_loss_scale": 2}}),
    "static loss scale": (
        ["--fp16", "--loss-scale", "1024"],
        "precision: fp16\nloss_scaling: {loss_scale: 1024}",
        {"fp16": {"enabled": True, "loss_scale": 1024}}),
    "batch sizes and clipping": (
        ["--micro-batch-size", "2", "--gradient-accumulation-steps", "4", "--global-batch-size", "64",
         "--clip-grad", "1.0", "--steps-per-print", "50"],
        "micro_batch_size: 2\ngradient_accumulation_steps: 4\nglobal_batch_size: 64\nclip_grad: 1.0\n"
        "steps_per_print: 50",
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "train_batch_size": 64,
         "gradient_clipping": 1.0, "steps_per_print": 50}),
    "adamw": (
        ["--lr", "3e-4", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-6", "--weight-decay", "0.1"],
        "optimizer: {type: adamw, lr: 3.0e-4, betas: [0.9, 0.95], eps: 1.0e-6, weight_decay: 0.1}",
        {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6,
                                                   "weight_decay": 0.1}}}),
    "sgd": (
        ["--optimizer", "sgd", "--lr", "0.1", "--sgd-momentum", "0.9"],
        "optimizer: {type: sgd, lr: 0.1, momentum: 0.9}",
        {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}),
    "warmup and linear decay": (
        ["--lr", "1e-3", "--lr-decay-style", "linear", "--lr-warmup-iters", "10", "--lr-decay-iters", "100",
         "--lr-warmup-init", "1e-5", "--min-lr", "1e-5"],
        "optimizer: {lr: 1.0e-3}\nscheduler: {type: linear, warmup_iters: 10, decay_iters: 100, "
        "warmup_start_lr: 1.0e-5, min_lr: 1.0e-5}",
        {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3,
                                                           "warmup_num_steps": 10, "total_num_steps": 100,
                                                           "warmup_type": "linear"}}}),
    "engine tensorboard": (
        ["--tensorboard-enabled", "--tensorboard-output-path", "tb", "--tensorboard-job-name", "run1"],
        "tensorboard: {enabled: true, output_path: tb, job_name: run1}",
        {"tensorboard": {"enabled": True, "output_path": "tb", "job_name": "run1"}}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_flag_yaml_and_deepspeed_give_the_same_config(tmp_path, name):
    argv, yaml_text, deepspeed = CASES[name]
    yaml_path, ds_path = tmp_path / "c.yaml", tmp_path / "ds.json"
    yaml_path.write_text(yaml_text + "\n")
    ds_path.write_text(json.dumps(deepspeed))
    from_flags = config_from_command_line(argv)
    forms = {"yaml (engine)": load_config(yaml_path), "deepspeed (engine)": load_config(ds_path),
             "yaml (--config)": config_from_command_line(["--config", str(yaml_path)]),
             "deepspeed (--config)": config_from_command_line(["--config", str(ds_path)])}
    for form, config in forms.items():
        assert config == from_flags, f"{name}: {form} differs from the flags"
