"""DeepSpeed-style JSON: auto-detection, every mapped key, and every refusal."""

import json

import pytest

from hybrid.config import ConfigError, from_deepspeed, is_deepspeed_style, load_config

DS = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "steps_per_print": 50,
    "gradient_clipping": 1.0,
    "wall_clock_breakdown": False,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7, "overlap_comm": False,
                          "contiguous_gradients": True, "reduce_scatter": True, "allgather_partitions": True},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
             "hysteresis": 3, "min_loss_scale": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6,
                                              "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 6e-4,
                                                      "warmup_num_steps": 100, "total_num_steps": 1000,
                                                      "warmup_type": "linear"}},
    "tensorboard": {"enabled": True, "output_path": "tb_logs", "job_name": "ds_job"},
}


def test_full_deepspeed_config_maps_every_key(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(DS))
    cfg = load_config(path)
    assert (cfg.global_batch_size, cfg.micro_batch_size, cfg.gradient_accumulation_steps) == (64, 2, 4)
    assert cfg.resolve_batch(8).global_batch_size == 64
    assert cfg.steps_per_print == 50 and cfg.clip_grad == 1.0
    assert (cfg.zero.stage, cfg.zero.bucket_size, cfg.zero.overlap_comm) == (2, 50_000_000, False)
    assert cfg.precision == "fp16" and cfg.autocast is False
    ls = cfg.loss_scaling
    assert (ls.loss_scale, ls.initial_scale_power, ls.loss_scale_window, ls.hysteresis, ls.min_loss_scale) == \
        (0.0, 12, 500, 3, 2.0)
    opt = cfg.optimizer
    assert (opt.type, opt.betas, opt.eps, opt.weight_decay) == ("adamw", (0.9, 0.95), 1e-6, 0.1)
    # WarmupDecayLR: peak = warmup_max_lr (DeepSpeed overrides the optimizer's lr), decays to warmup_min_lr.
    s = cfg.scheduler
    assert opt.lr == 6e-4
    assert (s.type, s.warmup_iters, s.warmup_style, s.warmup_start_lr, s.decay_iters, s.min_lr) == \
        ("linear", 100, "linear", 1e-5, 1000, 1e-5)
    tb = cfg.tensorboard
    assert (tb.enabled, tb.output_path, tb.job_name) == (True, "tb_logs", "ds_job")


def test_stage3_and_offload_keys():
    cfg = from_deepspeed({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 3e8,
        "stage3_prefetch_bucket_size": 2e7, "stage3_max_reuse_distance": 1e9}})
    z = cfg.zero
    assert (z.stage, z.offload_optimizer, z.persistence_threshold, z.max_live_parameters, z.prefetch_bucket_size,
            z.max_reuse_distance) == (3, "cpu", 10_000, 300_000_000, 20_000_000, 1_000_000_000)
    assert from_deepspeed({"zero_optimization": {"stage": 1}}).zero.offload_optimizer == "none"
    assert from_deepspeed({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none"}}}) \
        .zero.offload_optimizer == "none"


def test_zero_plus_plus_quantization_keys():
    on = from_deepspeed({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                                               "zero_quantized_weights": True}}).zero
    assert (on.quantized_gradients, on.quantized_weights) == ("int4", "int8")
    off = from_deepspeed({"zero_optimization": {"stage": 2, "zero_quantized_gradients": False,
                                                "zero_quantized_weights": False}}).zero
    assert (off.quantized_gradients, off.quantized_weights) == ("off", "off")
    with pytest.raises(ConfigError, match=r"'zero_optimization\.zero_quantized_gradients' must be true or false"):
        from_deepspeed({"zero_optimization": {"zero_quantized_gradients": "int4"}})
    with pytest.raises(ConfigError, match=r"quantized weights need ZeRO stage 1, 2 or 3.*\[from DeepSpeed key "
                                          r"'zero_optimization\.zero_quantized_weights'\]"):
        from_deepspeed({"zero_optimization": {"stage": 0, "zero_quantized_weights": True}})


def test_zero_plus_plus_hpz_and_onebit_adam_keys():
    z = from_deepspeed({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}).zero
    assert (z.stage, z.hpz_partition_size) == (3, 2)
    with pytest.raises(ConfigError, match=r"needs ZeRO stage 3.*\[from DeepSpeed key "
                                          r"'zero_optimization\.zero_hpz_partition_size'\]"):
        from_deepspeed({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}})
    cfg = from_deepspeed({"zero_optimization": {"stage": 2},
                          "optimizer": {"type": "OneBitAdam", "params": {
                              "lr": 2e-4, "betas": [0.9, 0.98], "eps": 1e-7, "weight_decay": 0.01, "freeze_step": 400,
                              "cuda_aware": False, "comm_backend_name": "nccl"}}})
    o = cfg.optimizer
    assert (o.type, o.lr, tuple(o.betas), o.eps, o.weight_decay, o.freeze_step) == \
        ("onebit_adam", 2e-4, (0.9, 0.98), 1e-7, 0.01, 400)
    with pytest.raises(ConfigError, match=r"onebit_adam composes with ZeRO stages 0-2"):
        from_deepspeed({"zero_optimization": {"stage": 3}, "optimizer": {"type": "OneBitAdam", "params": {}}})
    with pytest.raises(ConfigError, match=r"'optimizer\.params\.cuda_aware' must be a bool"):
        from_deepspeed({"optimizer": {"type": "OneBitAdam", "params": {"cuda_aware": "yes"}}})
    # the 0/1 Adam config DeepSpeed's tutorial gives, as it stands
    zo = from_deepspeed({"zero_optimization": {"stage": 0}, "optimizer": {"type": "ZeroOneAdam", "params": {
        "lr": 1e-3, "weight_decay": 0.01, "bias_correction": False, "var_freeze_step": 1000, "var_update_scaler": 16,
        "local_step_scaler": 1000, "local_step_clipper": 16, "cuda_aware": False, "comm_backend_name": "nccl"}}})
    o = zo.optimizer
    assert (o.type, o.var_freeze_step, o.var_update_scaler, o.local_step_scaler, o.local_step_clipper) == \
        ("zero_one_adam", 1000, 16, 1000, 16)
    with pytest.raises(ConfigError, match=r"zero_one_adam takes local steps .* ZeRO stage 0"):
        from_deepspeed({"zero_optimization": {"stage": 1}, "optimizer": {"type": "ZeroOneAdam", "params": {}}})
    with pytest.raises(ConfigError, match=r"'OneBitLamb' is not supported \(it is a DeepSpeed optimizer hybrid "
                                          r"does not implement\)"):
        from_deepspeed({"optimizer": {"type": "OneBitLamb", "params": {}}})


def test_bf16_and_optimizer_kinds():
    assert load_config({"bf16": {"enabled": True}}).precision == "bf16"
    assert load_config({"bf16": {"enabled": False}}).precision == "fp32"
    assert load_config({"fp16": {"enabled": False, "loss_scale": 128}}).precision == "fp32"
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false.
    assert from_deepspeed({"optimizer": {"type": "Adam", "params": {}}}).optimizer.type == "adamw"
    assert from_deepspeed({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}).optimizer.type \
        == "adam"
    sgd = from_deepspeed({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}).optimizer
    assert (sgd.type, sgd.lr, sgd.momentum) == ("sgd", 0.1, 0.9)
    assert load_config({"train_batch_size": 8, "gradient_clipping": None}).clip_grad == 0.0
    static = load_config({"fp16": {"enabled": True, "loss_scale": 1024}}).loss_scaling
    assert static.loss_scale == 1024.0


def test_scheduler_mappings():
    warm = from_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": 2e-3}},
                           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 50}}})
    assert warm.optimizer.lr == 2e-3  # warmup_max_lr defaults to the optimizer's lr
    assert (warm.scheduler.type, warm.scheduler.warmup_iters, warm.scheduler.warmup_style,
            warm.scheduler.warmup_start_lr) == ("constant", 50, "log", 0.0)
    warm2 = from_deepspeed({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 5e-4,
                                                                         "warmup_num_steps": 1}}})
    assert warm2.optimizer.lr == 5e-4 and warm2.scheduler.warmup_iters == 2  # DeepSpeed's floor of 2 steps
    cos = from_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                          "scheduler": {"type": "WarmupCosineLR",
                                        "params": {"total_num_steps": 500, "warmup_num_steps": 20,
                                                   "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}}})
    s = cos.scheduler
    assert cos.optimizer.lr == 1e-3
    assert (s.type, s.decay_iters, s.warmup_iters) == ("cosine", 500, 20)
    assert s.warmup_start_lr == pytest.approx(1e-4) and s.min_lr == pytest.approx(1e-5)
    default_cos = from_deepspeed({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5000}}})
    assert default_cos.scheduler.min_lr == pytest.approx(1e-3 * 1e-4) and default_cos.scheduler.warmup_iters == 1000


def test_detection():
    assert is_deepspeed_style({"train_micro_batch_size_per_gpu": 1})
    assert is_deepspeed_style({"zero_optimization": {"stage": 1}})
    assert is_deepspeed_style({"optimizer": {"type": "AdamW", "params": {}}})
    assert is_deepspeed_style({"scheduler": {"type": "WarmupLR"}})
    assert not is_deepspeed_style({"optimizer": {"type": "adamw", "lr": 1e-3}, "steps_per_print": 3})
    assert not is_deepspeed_style({"zero": {"stage": 1}, "gradient_accumulation_steps": 2})
    # Shared keys read the same either way.
    assert load_config({"gradient_accumulation_steps": 2}).gradient_accumulation_steps == 2


@pytest.mark.parametrize("data,match", [
    ({"train_batch_size": 8, "precision": "bf16"},
     r"mixes hybrid keys \(precision\) with DeepSpeed keys \(train_batch_size\); write it in one style"),
    ({"train_batch_size": 8, "zero_optimisation": {}},
     r"unknown DeepSpeed key 'zero_optimisation'\. Did you mean 'zero_optimization'\?"),
    ({"zero_optimization": {"stage": 1, "reduce_bucket_sise": 10}},
     r"unknown DeepSpeed key 'zero_optimization\.reduce_bucket_sise'\. Did you mean "
     r"'zero_optimization\.reduce_bucket_size'\?"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
     r"'zero\.offload_optimizer' must be one of none, cpu, got 'nvme'.*\[from DeepSpeed key "
     r"'zero_optimization\.offload_optimizer\.device'\]"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}},
     r"'zero_optimization\.offload_optimizer\.pin_memory' = False is not supported"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
     r"unknown DeepSpeed key 'zero_optimization\.offload_optimizer\.ratio'"),
    ({"zero_optimization": {"offload_param": {"device": "cpu"}}},
     r"'zero_optimization\.offload_param' is not supported by hybrid"),
    ({"zero_optimization": {"stage3_max_live_parameters": 0}}, r"'zero\.max_live_parameters' must be >= 1.*"
                                                                r"\[from DeepSpeed key 'zero_optimization\.stage3_max_live"),
    ({"zero_optimization": {"allgather_bucket_size": "big"}}, r"'zero_optimization\.allgather_bucket_size' must "
                                                              r"be a number, got 'big'"),
    ({"zero_optimization": {"cpu_offload": True}}, r"'zero_optimization\.cpu_offload' is not supported by hybrid: "
                                                   r"write it as offload_optimizer"),
    ({"train_batch_size": 8, "zero_allow_untested_optimizer": True}, r"'zero_allow_untested_optimizer' is not "
                                                                     r"supported by hybrid"),
    ({"train_batch_size": 8, "flops_profiler": {"enabled": True}}, r"'flops_profiler' is not supported"),
    ({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}},
     r"'zero_optimization\.stage3_gather_16bit_weights_on_model_save' is not supported by hybrid: hybrid saves "
     r"sharded checkpoints and consolidates them offline \(tools/convert_checkpoint\.py to-fp32 or to-hf\)"),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, r"'optimizer\.params\.max_grad_norm' is "
                                                                        r"not supported by hybrid: clip with the "
                                                                        r"top-level gradient_clipping"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"cuda_aware": 1}}}, r"'optimizer\.params\.cuda_aware' must be "
                                                                         r"a bool, got 1"),
    ({"zero_optimization": {"stage": 4}}, r"'zero\.stage' must be one of 0, 1, 2, 3, got 4.*\[from DeepSpeed key "
                                          r"'zero_optimization\.stage'\]"),
    ({"zero_optimization": {"contiguous_gradients": False}},
     r"'zero_optimization\.contiguous_gradients' = False is not supported: hybrid always behaves as "
     r"contiguous_gradients=True"),
    ({"zero_optimization": 2}, r"DeepSpeed key 'zero_optimization' must be an object"),
    ({"train_batch_size": 8, "activation_checkpointing": {}}, r"'activation_checkpointing' is not supported by "
                                                              r"hybrid: set hybrid's 'recompute'"),
    ({"train_batch_size": 8, "wall_clock_breakdown": True}, r"'wall_clock_breakdown' = True is not supported"),
    ({"train_batch_size": 8, "flops_profiler": {}}, r"'flops_profiler' is not supported"),
    ({"train_batch_size": "auto"}, r"DeepSpeed key 'train_batch_size' is \"auto\""),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, r"'optimizer\.params\.lr' is \"auto\""),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, r"'fp16\.enabled' and 'bf16\.enabled' are both true"),
    ({"fp16": {"enabled": "yes"}}, r"'fp16\.enabled' must be true or false"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, r"'fp16\.auto_cast' = True is not supported"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, r"'fp16\.fp16_master_weights_and_grads'"),
    ({"fp16": {"enabled": True, "initial_scale_powr": 8}}, r"Did you mean 'fp16\.initial_scale_power'\?"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, r"'loss_scaling\.hysteresis' must be >= 1, got 0 "
                                                   r"\[from DeepSpeed key 'fp16\.hysteresis'\]"),
    ({"bf16": {"enabled": True, "immediate_grad_update": True}}, r"'bf16\.immediate_grad_update' is not supp"),
    ({"optimizer": {"type": "Lamb", "params": {}}}, r"optimizer\.type 'Lamb' is not supported \(it is a DeepSpeed "
                                                    r"optimizer hybrid does not implement\)"),
    ({"optimizer": {"type": "AdamX", "params": {}}}, r"Did you mean 'Adam'\?"),
    ({"optimizer": {"type": 3, "params": {}}}, r"'optimizer\.type' must be one of Adam, AdamW, SGD"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "amsgrad": True}}}, r"'optimizer\.params\.amsgrad' "
                                                                                r"= True is not supported"),
    ({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, r"'optimizer\.params\.torch_adam' is not "
                                                                       r"supported"),
    ({"optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}}, r"unknown DeepSpeed key "
                                                                    r"'optimizer\.params\.momentum'"),
    ({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}, r"'AdamW' with optimizer\.params\."
                                                                         r"adam_w_mode false is contradictory"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, r"'optimizer\.lr' must be > 0\.0.*\[from DeepSpeed "
                                                             r"key 'optimizer\.params\.lr'\]"),
    ({"train_batch_size": 4, "optimizer": {"type": "AdamW", "parms": {}}},
     r"unknown DeepSpeed key 'optimizer\.parms'\. Did you mean 'optimizer\.params'\?"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, r"scheduler\.type 'OneCycle' is not supported; use one of "
                                                        r"WarmupLR, WarmupDecayLR, WarmupCosineLR"),
    ({"scheduler": {"type": "WarmupCosine", "params": {}}}, r"Did you mean 'WarmupCosineLR'\?"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}},
     r"WarmupDecayLR needs 'scheduler\.params\.total_num_steps'"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50, "warmup_num_steps": 100}}},
     r"'scheduler\.decay_iters' \(50\) must be greater than 'scheduler\.warmup_iters' \(100\)"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 10}}},
     r"unknown DeepSpeed key 'scheduler\.params\.warmup_steps' for WarmupLR\. Did you mean "
     r"'scheduler\.params\.warmup_num_steps'\?"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "exp"}}}, r"must be 'linear' or 'log'"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "ten"}}}, r"must be a number"),
    ({"tensorboard": {"enabled": True, "outputpath": "x"}, "train_batch_size": 1},
     r"Did you mean 'tensorboard\.output_path'\?"),
])
def test_deepspeed_errors_name_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        load_config(data)


# A DeepSpeed ZeRO-2 config as such configs are commonly written: tuning knobs of DeepSpeed's own, feature
# sections switched off, and the off values of features hybrid does not have.
COMMON_ZERO2 = {
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10, "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "reduce_scatter": True,
                          "allgather_bucket_size": 5e8, "reduce_bucket_size": 50000000, "overlap_comm": True,
                          "contiguous_gradients": True, "cpu_offload": False, "round_robin_gradients": False,
                          "stage3_gather_16bit_weights_on_model_save": False},
    "optimizer": {"type": "AdamW", "params": {"lr": 1.5e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                              "weight_decay": 0.01}},
    "bf16": {"enabled": True}, "wall_clock_breakdown": False, "zero_allow_untested_optimizer": False,
    "flops_profiler": {"enabled": False, "profile_step": 1, "module_depth": -1, "top_modules": 3},
    "comms_logger": {"enabled": False, "verbose": False},
}


def test_a_common_zero2_config_loads_with_its_switched_off_features_and_knobs():
    cfg = load_config(COMMON_ZERO2)
    assert (cfg.zero.stage, cfg.zero.bucket_size, cfg.zero.offload_optimizer) == (2, 50000000, "none")
    assert (cfg.precision, cfg.global_batch_size, cfg.micro_batch_size, cfg.clip_grad) == ("bf16", 16, 4, 1.0)


def test_every_key_that_needs_changing_is_named_in_one_error():
    data = {**COMMON_ZERO2, "activation_checkpointing": {"partition_activations": False},
            "data_types": {"grad_accum_dtype": "fp32"},
            "zero_optimization": {**COMMON_ZERO2["zero_optimization"], "cpu_offload": True, "reduce_bucket_sise": 1},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "max_grad_norm": 1.0}}}
    with pytest.raises(ConfigError) as raised:
        load_config(data)
    message = str(raised.value)
    assert "\n" not in message and message.startswith("5 DeepSpeed keys need changing: (1) ")
    for part in ("'activation_checkpointing' is not supported by hybrid: set hybrid's 'recompute'",
                 "'data_types' is not supported", "'zero_optimization.cpu_offload' is not supported",
                 "unknown DeepSpeed key 'zero_optimization.reduce_bucket_sise'. Did you mean "
                 "'zero_optimization.reduce_bucket_size'?",
                 "'optimizer.params.max_grad_norm' is not supported"):
        assert part in message, (part, message)


def test_every_value_hybrid_refuses_is_named_in_one_error_with_its_deepspeed_key():
    data = {**COMMON_ZERO2, "train_micro_batch_size_per_gpu": 0,
            "zero_optimization": {**COMMON_ZERO2["zero_optimization"], "stage": 9}}
    with pytest.raises(ConfigError) as raised:
        load_config(data)
    message = str(raised.value)
    assert message.startswith("2 config keys need changing: (1) "), message
    for part in ("'zero.stage' must be one of 0, 1, 2, 3, got 9 [from DeepSpeed key 'zero_optimization.stage']",
                 "'micro_batch_size' must be >= 1, got 0 [from DeepSpeed key 'train_micro_batch_size_per_gpu']"):
        assert part in message, (part, message)
