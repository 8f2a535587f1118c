"""DeepSpeed-style JSON: auto-detection, every mapped key, and every refusal."""

import json

import pytest

from hybrid.config import ConfigError, from_deepspeed, is_deepspeed_style, load_config
from tests.config.one_error import raises_one_error_listing

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


@pytest.mark.parametrize("kind,hybrid_type", [("Adam", "adamw"), ("AdamW", "adamw"), ("OneBitAdam", "onebit_adam")])
def test_bias_correction_maps_to_the_optimizers_switch(kind, hybrid_type):
    params = {"lr": 3e-5, "weight_decay": 0.0}
    off = from_deepspeed({"optimizer": {"type": kind, "params": {**params, "bias_correction": False}}}).optimizer
    assert (off.type, off.bias_correction) == (hybrid_type, False)
    on = from_deepspeed({"optimizer": {"type": kind, "params": {**params, "bias_correction": True}}}).optimizer
    assert on.bias_correction is True
    assert from_deepspeed({"optimizer": {"type": kind, "params": params}}).optimizer.bias_correction is True
    l2 = from_deepspeed({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "bias_correction": False}}})
    assert (l2.optimizer.type, l2.optimizer.bias_correction) == ("adam", False)
    with pytest.raises(ConfigError, match=r"'optimizer\.params\.bias_correction' must be a bool, got 'no'"):
        from_deepspeed({"optimizer": {"type": kind, "params": {"bias_correction": "no"}}})


def test_bias_correction_of_the_optimizers_without_one():
    # 0/1 Adam's update has none either way: accepted, and the switch keeps its default
    zo = from_deepspeed({"zero_optimization": {"stage": 0},
                         "optimizer": {"type": "ZeroOneAdam", "params": {"bias_correction": False}}})
    assert zo.optimizer.bias_correction is True
    with pytest.raises(ConfigError, match=r"'optimizer\.params\.bias_correction' = False is not supported: only "
                                          r"Adam, AdamW, OneBitAdam and Lamb"):
        from_deepspeed({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "bias_correction": False}}})


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
     r"'zero_optimization\.offload_optimizer\.ratio' is not supported by hybrid: offloading a part of the "
     r"optimizer state is not implemented"),
    ({"zero_optimization": {"offload_param": {"device": "cpu"}}},
     r"'zero_optimization\.offload_param' is not supported by hybrid"),
    ({"zero_optimization": {"stage3_max_live_parameters": 0}}, r"'zero\.max_live_parameters' must be >= 1.*"
                                                                r"\[from DeepSpeed key 'zero_optimization\.stage3_max_live"),
    ({"zero_optimization": {"allgather_bucket_size": "big"}}, r"'zero_optimization\.allgather_bucket_size' must "
                                                              r"be a number, got 'big'"),
    ({"zero_optimization": {"cpu_offload": 1}}, r"'zero_optimization\.cpu_offload' must be true or false"),
    ({"train_batch_size": 8, "zero_allow_untested_optimizer": "yes"}, r"'zero_allow_untested_optimizer' must be a "
                                                                      r"bool"),
    ({"train_batch_size": 8, "flops_profiler": {"enabled": True}}, r"'flops_profiler' is not supported"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}},
     r"'zero_optimization\.offload_param' is not supported by hybrid: ZeRO-3 parameter offload \(the parameter "
     r"partitions in host or NVMe memory, fetched for each module\) is not implemented"),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, r"'optimizer\.params\.max_grad_norm' is "
                                                                        r"not supported by hybrid: clip with the "
                                                                        r"top-level gradient_clipping"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"cuda_aware": 1}}}, r"'optimizer\.params\.cuda_aware' must be "
                                                                         r"a bool, got 1"),
    ({"zero_optimization": {"stage": 4}}, r"'zero\.stage' must be one of 0, 1, 2, 3, got 4.*\[from DeepSpeed key "
                                          r"'zero_optimization\.stage'\]"),
    ({"zero_optimization": {"reduce_scatter": False}},
     r"'zero_optimization\.reduce_scatter' = False is not supported: hybrid always behaves as reduce_scatter=True"),
    ({"zero_optimization": 2}, r"DeepSpeed key 'zero_optimization' must be an object"),
    ({"train_batch_size": 8, "activation_checkpointing": {"partition_activation": True}},
     r"unknown DeepSpeed key 'activation_checkpointing\.partition_activation'\. Did you mean "
     r"'activation_checkpointing\.partition_activations'\?"),
    ({"train_batch_size": 8, "wall_clock_breakdown": True}, r"'wall_clock_breakdown' = True is not supported"),
    ({"train_batch_size": 8, "flops_profiler": {}}, r"'flops_profiler' is not supported"),
    ({"train_batch_size": "auto"}, r"DeepSpeed key 'train_batch_size' is \"auto\""),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, r"'optimizer\.params\.lr' is \"auto\""),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, r"'fp16\.enabled' and 'bf16\.enabled' are both true"),
    ({"fp16": {"enabled": "yes"}}, r"'fp16\.enabled' must be true or false"),
    ({"fp16": {"enabled": True, "auto_cast": 1}}, r"'fp16\.auto_cast' must be a bool, got 1"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, r"'fp16\.fp16_master_weights_and_grads'"),
    ({"fp16": {"enabled": True, "initial_scale_powr": 8}}, r"Did you mean 'fp16\.initial_scale_power'\?"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, r"'loss_scaling\.hysteresis' must be >= 1, got 0 "
                                                   r"\[from DeepSpeed key 'fp16\.hysteresis'\]"),
    ({"bf16": {"enabled": True, "immediate_grad_update": True}}, r"'bf16\.immediate_grad_update' is not supp"),
    ({"optimizer": {"type": "Lion", "params": {}}}, r"optimizer\.type 'Lion' is not supported \(it is a DeepSpeed "
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


def test_the_16bit_model_key_and_parameter_offload_switched_off():
    for key in ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                "stage3_gather_fp16_weights_on_model_save"):
        cfg = load_config({"zero_optimization": {"stage": 3, key: True, "offload_param": {"device": "none"}}})
        assert cfg.checkpoint.save_16bit_model is True and cfg.zero.stage == 3
    assert load_config(COMMON_ZERO2).checkpoint.save_16bit_model is False


def test_bf16_master_weights_and_optimizer_states_are_the_bf16_master_mode():
    both = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
    assert load_config(both).zero.master_precision == "bf16"
    off = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}}
    assert load_config(off).zero.master_precision == "fp32"
    with pytest.raises(ConfigError, match=r"'bf16.bf16_master_weights_and_grads' alone is not supported: hybrid "
                                          r"keeps the optimizer state in the masters' dtype"):
        load_config({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}})
    with pytest.raises(ConfigError, match=r"'zero.master_precision' bf16 keeps the bf16 parameters as their own"):
        load_config({"fp16": {"enabled": True}, "bf16": {"bf16_master_weights_and_grads": True,
                                                         "bf16_optimizer_states": True}})


def test_a_common_zero2_config_loads_with_its_switched_off_features_and_knobs():
    cfg = load_config(COMMON_ZERO2)
    assert (cfg.zero.stage, cfg.zero.bucket_size, cfg.zero.offload_optimizer) == (2, 50000000, "none")
    assert (cfg.precision, cfg.global_batch_size, cfg.micro_batch_size, cfg.clip_grad) == ("bf16", 16, 4, 1.0)


def test_every_key_that_needs_changing_is_named_in_one_error():
    data = {**COMMON_ZERO2, "activation_checkpointing": {"partition_activations": 1},
            "sparse_attention": {"mode": "fixed", "block": 16},
            "zero_optimization": {**COMMON_ZERO2["zero_optimization"], "cpu_offload": "on", "reduce_bucket_sise": 1},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "max_grad_norm": 1.0}}}
    raises_one_error_listing(load_config, data, 5, "DeepSpeed keys", (
                 "'activation_checkpointing.partition_activations' must be a bool, got 1",
                 "'sparse_attention' is not supported", "'zero_optimization.cpu_offload' must be true or false",
                 "unknown DeepSpeed key 'zero_optimization.reduce_bucket_sise'. Did you mean "
                 "'zero_optimization.reduce_bucket_size'?",
                 "'optimizer.params.max_grad_norm' is not supported"))


def test_every_value_hybrid_refuses_is_named_in_one_error_with_its_deepspeed_key():
    data = {**COMMON_ZERO2, "train_micro_batch_size_per_gpu": 0,
            "zero_optimization": {**COMMON_ZERO2["zero_optimization"], "stage": 9}}
    raises_one_error_listing(load_config, data, 2, "config keys", (
        "'zero.stage' must be one of 0, 1, 2, 3, got 9 [from DeepSpeed key 'zero_optimization.stage']",
        "'micro_batch_size' must be >= 1, got 0 [from DeepSpeed key 'train_micro_batch_size_per_gpu']"))


# ---- data_types: accepted where it names the dtype hybrid keeps at the config's precision ---------------------

PRECISION_SECTIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": True}}}
# What hybrid keeps at each precision, written out here: parameters and the gradients accumulated over micro-steps
# in the precision itself at every ZeRO stage, floating-point buffers cast with the model except at fp32.
KEPT = {"fp32": {"grad_accum_dtype": "fp32", "param_dtype": "fp32", "buffer_dtype": None},
        "bf16": {"grad_accum_dtype": "bf16", "param_dtype": "bf16", "buffer_dtype": "bf16"},
        "fp16": {"grad_accum_dtype": "fp16", "param_dtype": "fp16", "buffer_dtype": "fp16"}}
STAGES = [0, 1, 2, 3]


def ds_with(precision, stage, data_types, **more):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": stage, **more}, **PRECISION_SECTIONS[precision], "data_types": data_types}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_data_types_naming_what_hybrid_keeps_are_accepted_at_every_stage(precision, stage):
    cfg = load_config(ds_with(precision, stage, KEPT[precision]))
    assert (cfg.precision, cfg.zero.stage) == (precision, stage)
    assert load_config(ds_with(precision, stage, {"grad_accum_dtype": precision})).precision == precision
    if stage > 0:
        offloaded = ds_with(precision, stage, {"grad_accum_dtype": precision}, offload_optimizer={"device": "cpu"})
        assert load_config(offloaded).zero.offload_optimizer == "cpu"


def test_data_types_take_deepspeeds_spellings_and_null():
    for precision, spellings in {"fp32": ("float32", "float", "torch.float32"),
                                 "fp16": ("float16", "half", "torch.float16"),
                                 "bf16": ("bfloat16", "bfloat", "torch.bfloat16")}.items():
        for spelling in spellings:
            load_config(ds_with(precision, 2, {"grad_accum_dtype": spelling, "param_dtype": spelling}))
    # null is DeepSpeed's default: the dtype the precision gives
    assert load_config(ds_with("bf16", 1, {"grad_accum_dtype": None, "param_dtype": None,
                                           "buffer_dtype": None})).precision == "bf16"
    assert load_config({"train_batch_size": 8, "data_types": {}}).precision == "fp32"


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("precision,value", [("bf16", "fp32"), ("fp16", "fp32"), ("fp32", "bf16"), ("fp32", "fp16"),
                                             ("bf16", "fp16"), ("fp16", "bfloat16")])
def test_a_grad_accum_dtype_hybrid_does_not_use_is_refused_naming_what_it_accumulates_in(precision, value, stage):
    with pytest.raises(ConfigError) as raised:
        load_config(ds_with(precision, stage, {"grad_accum_dtype": value}))
    message = str(raised.value)
    assert message.startswith(f"DeepSpeed key 'data_types.grad_accum_dtype' = '{value}' is not supported: "), message
    assert f"hybrid accumulates gradients in {precision}, the parameters' dtype, at every ZeRO stage; remove it, " \
           f"or set it to {precision}" in message, message
    # fp32 accumulation of a low precision is what autocast gives
    assert ("'autocast: true'" in message) == (value == "fp32"), message


@pytest.mark.parametrize("data_types,precision,match", [
    ({"param_dtype": "fp32"}, "bf16", r"'data_types\.param_dtype' = 'fp32' is not supported: with bf16 enabled, "
                                      r"hybrid trains the parameters in bf16; remove it, or set it to bf16$"),
    ({"param_dtype": "bf16"}, "fp32", r"'data_types\.param_dtype' = 'bf16' is not supported: in fp32 \(fp16 and bf16 "
                                      r"off\), hybrid trains the parameters in fp32; remove it, or set it to fp32 "
                                      r"\(to train in bf16, set bf16\.enabled\)"),
    ({"buffer_dtype": "fp32"}, "fp16", r"'data_types\.buffer_dtype' = 'fp32' is not supported: with fp16 enabled, "
                                       r"hybrid casts floating-point buffers to fp16 with the model; remove it, or set "
                                       r"it to fp16$"),
    ({"buffer_dtype": "fp32"}, "fp32", r"'data_types\.buffer_dtype' = 'fp32' is not supported: in fp32 \(fp16 and "
                                       r"bf16 off\), hybrid casts no buffers: they keep the dtype the model has them "
                                       r"in; remove it$"),
    ({"grad_accum_dtype": "int8"}, "bf16", r"'data_types\.grad_accum_dtype' must be one of fp32, fp16, bf16, got "
                                           r"'int8'"),
    ({"param_dtype": 16}, "fp16", r"'data_types\.param_dtype' must be one of fp32, fp16, bf16, got 16"),
    ({"grad_acum_dtype": "fp32"}, "fp32", r"unknown DeepSpeed key 'data_types\.grad_acum_dtype'\. Did you mean "
                                          r"'data_types\.grad_accum_dtype'\?"),
    ("fp32", "fp32", r"DeepSpeed key 'data_types' must be an object, got 'fp32'"),
])
def test_the_other_data_types_keys_and_bad_values(data_types, precision, match):
    with pytest.raises(ConfigError, match=match):
        load_config(ds_with(precision, 2, data_types))


def test_data_types_problems_join_the_other_keys_in_one_error():
    data = {**COMMON_ZERO2, "data_types": {"grad_accum_dtype": "fp32", "param_dtype": "bf16", "buffer_dtyp": "bf16"},
            "zero_optimization": {**COMMON_ZERO2["zero_optimization"], "reduce_bucket_sise": 1}}
    raises_one_error_listing(load_config, data, 3, "DeepSpeed keys", (
        "unknown DeepSpeed key 'zero_optimization.reduce_bucket_sise'",
        "unknown DeepSpeed key 'data_types.buffer_dtyp'. Did you mean 'data_types.buffer_dtype'?",
        "'data_types.grad_accum_dtype' = 'fp32' is not supported: with bf16 enabled, hybrid accumulates gradients "
        "in bf16"))
    # fp16/bf16 'enabled' given wrongly is its own error; the dtypes are checked once the precision is known
    with pytest.raises(ConfigError, match=r"^DeepSpeed key 'bf16\.enabled' must be true or false, got 'yes'$"):
        load_config({"train_batch_size": 8, "bf16": {"enabled": "yes"}, "data_types": {"grad_accum_dtype": "fp16"}})


def test_communication_data_type_is_accepted_where_it_is_the_dtype_gradients_are_reduced_in():
    for precision in ("fp32", "bf16", "fp16"):
        data = {**ds_with(precision, 2, {}), "communication_data_type": KEPT[precision]["grad_accum_dtype"]}
        assert load_config(data).precision == precision
    with pytest.raises(ConfigError, match=r"^DeepSpeed key 'communication_data_type' = 'fp32' is not supported: with "
                                          r"bf16 enabled, hybrid reduces gradients in bf16, the dtype they accumulate "
                                          r"in; remove it, or set it to bf16"):
        load_config({**ds_with("bf16", 2, {}), "communication_data_type": "fp32"})
    quantized = ds_with("bf16", 2, {}, zero_quantized_gradients=True)
    with pytest.raises(ConfigError, match=r"'communication_data_type' = 'bf16' is not supported: with "
                                          r"'zero_optimization\.zero_quantized_gradients', hybrid sends gradients "
                                          r"blockwise-quantized; remove it"):
        load_config({**quantized, "communication_data_type": "bf16"})


def test_the_dtype_rule_has_one_statement_that_the_intake_reads(monkeypatch):
    """The intake asks hybrid.layout.precision_traits, rather than restating which dtype each precision keeps."""
    import hybrid.config.deepspeed as intake
    from hybrid.layout import PrecisionTraits

    monkeypatch.setattr(intake, "precision_traits", lambda precision: PrecisionTraits("fp16", "fp16", "fp16"))
    load_config(ds_with("bf16", 2, {"grad_accum_dtype": "fp16"}))
    with pytest.raises(ConfigError, match=r"accumulates gradients in fp16"):
        load_config(ds_with("bf16", 2, {"grad_accum_dtype": "bf16"}))


# ---- ... and what the engine keeps: a world-1 engine of each stage, precision and gradient path --------------

def _engine_dtypes(ds, overrides=None):
    """Dtypes of one world-1 run of ``ds`` over two micro-steps: the parameters, the gradient store the micro-steps
    accumulate into (and stage 2's staging buckets, offload's host copies), and a floating-point buffer."""
    torch = pytest.importorskip("torch")
    import hybrid
    from hybrid.topology import Topology

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
            self.register_buffer("scale", torch.ones(4))

        def forward(self, x):
            return self.fc2(torch.nn.functional.gelu(self.fc1(x))) * self.scale

    torch.manual_seed(0)
    model = Net()
    engine = hybrid.initialize(model, ds, topology=Topology(), **(overrides or {}))
    opt, seen = engine.optimizer, set()
    try:
        for _ in range(2):
            x = torch.randn(2, 8, dtype=model.fc1.weight.dtype)
            engine.backward(model(x).float().square().mean())
            grads = opt.reducer.grads if isinstance(opt.reducer.grads, list) else [opt.reducer.grads]
            seen |= {g.dtype for g in grads}
            seen |= {b.dtype for bufs in getattr(opt.reducer, "_allocated", {}).values() for b in bufs}
            seen |= {g.dtype for off in getattr(opt, "_offload", []) for g in off.grads}
            engine.step()
    finally:
        opt.remove_hooks()
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    return ({names[p.dtype] for p in model.parameters()}, {names[d] for d in seen}, names[model.scale.dtype])


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_accepted_data_types_are_the_dtypes_the_engine_keeps(precision, stage):
    kept = KEPT[precision]
    variants = [({}, None)]
    if stage > 0:
        variants.append(({"offload_optimizer": {"device": "cpu"}}, None))
    if stage in (1, 2):
        variants.append(({}, {"zero.reduce_once": True}))
    for more, overrides in variants:
        params, grads, buffer = _engine_dtypes(ds_with(precision, stage, kept, **more), overrides)
        assert params == {kept["param_dtype"]} and grads == {kept["grad_accum_dtype"]}, (more, overrides)
        assert buffer == (kept["buffer_dtype"] or "fp32"), (more, overrides)


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("precision,autocast", [("fp32", False), ("bf16", False), ("fp16", False), ("bf16", True),
                                                ("fp16", True)])
def test_precision_traits_are_the_dtypes_the_engine_keeps(precision, autocast, stage):
    from hybrid.layout import precision_traits

    traits = precision_traits(precision, autocast)
    native = {"precision": precision, "autocast": autocast, "zero": {"stage": stage}, "micro_batch_size": 2,
              "gradient_accumulation_steps": 2, "steps_per_print": 0}
    params, grads, buffer = _engine_dtypes(native)
    assert (params, grads, buffer) == ({traits.params}, {traits.grads}, traits.buffers or "fp32")


def test_data_types_are_checked_again_when_the_command_line_changes_the_precision(tmp_path):
    from hybrid.config import config_from_command_line

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds_with("fp16", 2, KEPT["fp16"])))
    assert config_from_command_line(["--config", str(path)]).precision == "fp16"
    assert config_from_command_line(["--config", str(path), "--lr", "1e-4"]).optimizer.lr == 1e-4  # no new precision
    with pytest.raises(ConfigError) as raised:
        config_from_command_line(["--config", str(path), "--bf16"])
    message = str(raised.value)
    assert message.startswith(f"{path}: 3 DeepSpeed keys need changing: (1) "), message
    for part in ("DeepSpeed key 'data_types.grad_accum_dtype' = 'fp16' is not supported: with bf16 enabled, "
                 "hybrid accumulates gradients in bf16", "'data_types.param_dtype' = 'fp16'",
                 "'data_types.buffer_dtype' = 'fp16'", "(the command line set precision bf16)"):
        assert part in message, (part, message)
    # a file whose dtypes fit the new precision (none given) is fine
    path.write_text(json.dumps(ds_with("fp16", 2, {})))
    assert config_from_command_line(["--config", str(path), "--bf16"]).precision == "bf16"


def test_data_types_are_checked_again_when_initialize_overrides_the_precision():
    import torch

    import hybrid

    ds = ds_with("bf16", 1, {"grad_accum_dtype": "bf16"})
    with pytest.raises(ConfigError, match=r"'data_types\.grad_accum_dtype' = 'bf16' is not supported: in fp32 .* "
                                          r"\(the keyword overrides set precision fp32\)"):
        hybrid.initialize(torch.nn.Linear(4, 4), ds, precision="fp32")
