"""Native config: defaults, loaders, type conversion, overrides and every error case."""

import json
import re
from pathlib import Path

import pytest

from hybrid.config import ConfigError, HybridConfig, load_config
from hybrid.config.parse import apply_overrides, config_from_dict, to_plain
from tests.config.one_error import raises_one_error_listing

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"

FULL = {
    "precision": "bf16", "autocast": False,
    "loss_scaling": {"loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 3,
                     "min_loss_scale": 0.5},
    "zero": {"stage": 2, "bucket_size": 1000, "overlap_comm": False, "reduce_once": True,
             "overlap_param_gather": True,
             "quantized_gradients": "int4", "quantized_weights": "int8", "two_level_reduce": True,
             "quantization_block": 128, "hpz_partition_size": 1,
             "offload_optimizer": "cpu", "master_precision": "fp32",
             "persistence_threshold": 10, "max_live_parameters": 5000, "prefetch_bucket_size": 0,
             "max_reuse_distance": 7000},
    "optimizer": {"type": "adamw", "lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "bias_correction": False,
                  "weight_decay": 0.1, "max_coeff": 10.0, "min_coeff": 0.01, "decoupled_lr": None,
                  "decoupled_min_lr": None,
                  "freeze_step": 50, "var_freeze_step": 60, "var_update_scaler": 8, "local_step_scaler": 100,
                  "local_step_clipper": 4, "decay_1d_params": True, "weight_decay_incr_style": "constant",
                  "start_weight_decay": None, "end_weight_decay": None},
    "scheduler": {"type": "cosine", "warmup_iters": 10, "warmup_samples": None, "warmup_fraction": None,
                  "warmup_tokens": None, "decay_tokens": None,
                  "warmup_style": "linear", "warmup_start_lr": 1e-5, "decay_iters": 100, "decay_samples": None,
                  "min_lr": 3e-5, "wsd_decay_style": "exponential", "wsd_decay_iters": None, "wsd_decay_samples": None,
                  "weight_decay_incr_iters": None, "weight_decay_incr_samples": None},
    "clip_grad": 1.0, "micro_batch_size": 2, "gradient_accumulation_steps": 4, "global_batch_size": 64,
    "calculate_per_token_loss": True,
    "rampup_batch_size": [16, 16, 3000], "step_batch_size_schedule": [],
    "tensor_parallel_size": 2, "expert_parallel_size": 2, "context_parallel_size": 2, "recompute": "selective",
    "pipeline": {"size": 2, "schedule": "interleaved", "layers_per_virtual_stage": 2, "layers_per_stage": None},
    "tensorboard": {"enabled": True, "output_path": "tb", "job_name": "run1"},
    "seed": 7, "steps_per_print": 5, "use_fused_kernels": False,
    # the trainer's sections
    "model": {"preset": None, "compile": True, "compile_cache_dir": "cc", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
              "kv_channels": 24, "ffn_hidden_size": 128,
              "seq_length": 32, "max_position_embeddings": 64, "vocab_size": 512, "position_embedding_type": "rope",
              "normalization": "rmsnorm", "norm_epsilon": 1e-6, "apply_layernorm_1p": True,
              "rotary_base": 500000.0, "rope_scaling": "llama3",
              "rope_scaling_factor": 8.0, "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
              "rope_original_max_positions": 8192, "yarn_beta_fast": 16.0, "yarn_beta_slow": 2.0,
              "no_yarn_correction_range_round_to_int": True, "mscale": 1.0, "mscale_all_dim": 0.5, "swiglu": True,
              "add_qkv_bias": True, "qk_layernorm": True,
              "disable_bias_linear": True, "untie_embeddings_and_output_weights": True, "hidden_dropout": 0.1,
              "attention_dropout": 0.0, "init_method_std": 0.02, "sequence_parallel": True,
              "num_experts": 4, "moe_ffn_hidden_size": None, "moe_layer_freq": [0, 1], "moe_router_topk": None,
              "moe_router_score_function": None, "moe_router_pre_softmax": False,
              "moe_router_topk_scaling_factor": None, "moe_router_num_groups": None, "moe_router_group_topk": None,
              "moe_router_enable_expert_bias": False,
              "moe_router_bias_update_rate": None, "moe_router_load_balancing_type": None, "moe_aux_loss_coeff": None,
              "moe_z_loss_coeff": None, "moe_expert_capacity_factor": None, "moe_token_drop_policy": None,
              "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
              "expert_tensor_parallel_size": None, "moe_grouped_gemm": False, "moe_token_dispatcher_type": None,
              "moe_quantized_dispatch": False, "cp_comm_type": None},
    "data": {"path": ["0.3", "a", "0.7", "b"], "train_path": [], "valid_path": [], "test_path": [],
             "split": "98,2,0",
             "tokenizer_type": None,
             "tokenizer_model": "tok.model", "vocab_file": None, "merge_file": None,
             "tiktoken_pattern": None, "tiktoken_num_special_tokens": 1000,
             "eod_mask_loss": True, "reset_position_ids": False, "reset_attention_mask": True, "mock": False,
             "cache_path": "cache"},
    "checkpoint": {"save": "ckpt", "load": "ckpt", "exit_on_missing_checkpoint": False, "save_interval": 50,
                   "keep_last": 2, "finetune": False, "no_load_optim": False, "no_load_rng": False,
                   "use_checkpoint_args": False,
                   "override_opt_param_scheduler": True, "use_checkpoint_opt_param_scheduler": False,
                   "async_save": True, "save_16bit_model": False, "async_save_chunk_mb": 256},
    "run": {"train_iters": 100, "train_samples": None, "train_tokens": None, "exit_interval": 60, "exit_duration_in_mins": 30.0,
            "max_consecutive_skipped_steps": 20, "skip_train": False, "check_for_nan_in_loss_and_grad": False,
            "loss_spike_factor": 3.0, "loss_spike_window": 50},
    "eval": {"interval": 25, "iters": 4},
    "logging": {"log_interval": 5, "tensorboard_dir": "tb", "peak_tflops": 312.0, "log_params_norm": True,
                "log_num_zeros_in_grad": False, "moe_per_layer_logging": True, "wandb_project": "proj",
                "wandb_exp_name": "run1", "wandb_save_dir": "wandb", "profile": True, "profile_step_start": 3,
                "profile_step_end": 5, "profile_ranks": [0, 1]},
    "distributed": {"timeout_minutes": 5.0, "allow_tp_across_nodes": True},
}


def test_defaults_are_valid_and_documented_values():
    cfg = load_config(None)
    assert cfg == HybridConfig()
    assert cfg.precision == "fp32" and cfg.zero.stage == 0 and cfg.zero.bucket_size == 25_000_000
    assert cfg.zero.overlap_comm is True and cfg.optimizer.type == "adamw"
    assert cfg.loss_scaling.initial_scale_power == 16 and cfg.loss_scaling.loss_scale_window == 1000
    assert cfg.loss_scaling.hysteresis == 2 and cfg.loss_scaling.min_loss_scale == 1.0
    assert cfg.loss_scaling.loss_scale == 0.0
    assert cfg.resolve_batch(4).gradient_accumulation_steps == 1


def test_full_dict_round_trips_through_json_and_yaml(tmp_path):
    cfg = load_config(FULL)
    assert cfg.optimizer.betas == (0.9, 0.95) and cfg.zero.stage == 2 and cfg.recompute == "selective"
    assert cfg.tensorboard.job_name == "run1" and cfg.use_fused_kernels is False
    assert to_plain(cfg) == {**FULL, "optimizer": {**FULL["optimizer"], "momentum": 0.0},
                             "loss_scaling": {**FULL["loss_scaling"], "loss_scale": 0.0}}
    (tmp_path / "c.json").write_text(json.dumps(to_plain(cfg)))
    assert load_config(tmp_path / "c.json") == cfg
    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(to_plain(cfg)))
    assert load_config(str(tmp_path / "c.yaml")) == cfg


def test_yaml_scientific_notation_without_dot_is_read_as_a_number(tmp_path):
    # YAML 1.1 reads 3e-4 as a string; the loader converts numeric strings for numeric keys.
    (tmp_path / "c.yml").write_text("optimizer:\n  lr: 3e-4\nzero:\n  bucket_size: 5e6\n")
    cfg = load_config(tmp_path / "c.yml")
    assert cfg.optimizer.lr == 3e-4 and cfg.zero.bucket_size == 5_000_000
    assert isinstance(cfg.zero.bucket_size, int)


def test_enum_values_are_case_insensitive():
    cfg = load_config({"precision": "BF16", "optimizer": {"type": "AdamW", "lr": 1e-3},
                       "scheduler": {"type": "Constant"}})
    assert cfg.precision == "bf16" and cfg.optimizer.type == "adamw"
    assert cfg.scheduler.type == "constant"


def test_empty_yaml_file_gives_defaults(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    assert load_config(tmp_path / "empty.yaml") == HybridConfig()


def test_overrides_dotted_and_section_forms_keep_other_keys():
    cfg = load_config(FULL)
    new = apply_overrides(cfg, {"optimizer.lr": 1e-4, "zero": {"stage": 1}, "precision": "fp16"})
    assert new.optimizer.lr == 1e-4 and new.zero.stage == 1 and new.precision == "fp16"
    assert new.zero.bucket_size == 1000 and new.optimizer.betas == (0.9, 0.95)
    assert cfg.optimizer.lr == 3e-4  # the original is unchanged


def test_section_dataclass_override_replaces_the_section():
    from hybrid.config import ZeroConfig

    new = apply_overrides(config_from_dict({"zero": {"bucket_size": 7}}), {"zero": ZeroConfig(stage=2)})
    assert new.zero == ZeroConfig(stage=2)


def test_config_object_is_copied_and_revalidated():
    cfg = HybridConfig()
    cfg.zero.stage = 5
    with pytest.raises(ConfigError, match="'zero.stage' must be one of 0, 1, 2, 3, got 5"):
        load_config(cfg)
    cfg.zero.stage = "two"
    with pytest.raises(ConfigError, match="'zero.stage' must be an integer, got 'two'"):
        load_config(cfg)
    cfg.zero.stage = 1
    copy = load_config(cfg)
    copy.zero.stage = 2
    assert cfg.zero.stage == 1


@pytest.mark.parametrize("data,match", [
    ({"precison": "bf16"}, r"unknown config key 'precison'\. Did you mean 'precision'\?"),
    ({"optimizer": {"learning_rate": 1e-3}}, r"unknown config key 'optimizer\.learning_rate'\. Valid keys here: "
                                             r"betas, bias_correction, decay_1d_params, decoupled_lr, "
                                             r"decoupled_min_lr, end_weight_decay, eps, freeze_step, "
                                             r"local_step_clipper"),
    ({"zero": {"stag": 1}}, r"unknown config key 'zero\.stag'\. Did you mean 'zero\.stage'\?"),
    ({"schedular": {}}, r"Did you mean 'scheduler'\?"),
    ({"zero_optimisation": {}}, r"Did you mean the DeepSpeed key 'zero_optimization'\?"),
    ({"precision": "bf61"}, r"'precision' must be one of fp32, bf16, fp16, got 'bf61'\. Did you mean 'bf16'\? "
                            r"\(set by --precision, --bf16, --fp16\)"),
    ({"optimizer": {"type": "lion"}}, r"'optimizer\.type' must be one of adamw, adam, sgd, onebit_adam, zero_one_adam, lamb, got 'lion'"),
    ({"recompute": "partial"}, r"'recompute' must be one of none, full, selective"),
    ({"scheduler": {"type": "cosin", "decay_iters": 10}}, r"Did you mean 'cosine'\?"),
    ({"scheduler": {"warmup_style": "exp"}}, r"'scheduler\.warmup_style' must be one of linear, log"),
    ({"zero": {"stage": 4}}, r"'zero\.stage' must be one of 0, 1, 2, 3, got 4 \(set by --zero-stage\)"),
    ({"zero": {"stage": -1}}, r"'zero\.stage' must be one of 0, 1, 2, 3, got -1"),
    ({"zero": {"offload_optimizer": "nvme"}}, r"'zero\.offload_optimizer' must be one of none, cpu, got 'nvme'"),
    ({"zero": {"stage": 0, "offload_optimizer": "cpu"}}, r"'zero\.offload_optimizer' is 'cpu' but 'zero\.stage' is 0: "
                                                        r"offload to cpu needs ZeRO stage 1, 2 or 3.*"
                                                        r"\(set by --offload-optimizer, --zero-stage\)"),
    ({"zero": {"stage": 3, "reduce_once": True}}, r"'zero\.reduce_once' is true but 'zero\.stage' is 3: "
                                                 r"zero\.reduce_once needs ZeRO stage 0, 1 or 2.*"
                                                 r"\(set by --zero-reduce-once, --zero-stage\)"),
    ({"zero": {"stage": 0, "quantized_weights": "int8"}}, r"'zero\.quantized_weights' is 'int8' but 'zero\.stage' "
                                                         r"is 0: quantized weights need ZeRO stage 1, 2 or 3.*"
                                                         r"\(set by --zero-quantized-weights, --zero-stage\)"),
    ({"zero": {"quantized_gradients": "int2"}}, r"'zero\.quantized_gradients' must be one of off, int8, int4, got "
                                                r"'int2'"),
    ({"zero": {"quantized_gradients": "int8", "quantization_block": 12}},
     r"'zero\.quantization_block' is 12 but 'zero\.stage' is 0: a quantization block must be a positive multiple "
     r"of 8"),
    ({"zero": {"max_live_parameters": 0}}, r"'zero\.max_live_parameters' must be >= 1, got 0"),
    ({"zero": {"persistence_threshold": -1}}, r"'zero\.persistence_threshold' must be >= 0, got -1"),
    ({"zero": {"overlap_comm": "yes"}}, r"'zero\.overlap_comm' must be true or false, got 'yes'"),
    ({"zero": {"bucket_size": 1.5}}, r"'zero\.bucket_size' must be an integer, got 1\.5"),
    ({"zero": {"bucket_size": 0}}, r"'zero\.bucket_size' must be >= 1, got 0"),
    ({"micro_batch_size": True}, r"'micro_batch_size' must be an integer, got True"),
    ({"optimizer": {"lr": "fast"}}, r"'optimizer\.lr' must be a number, got 'fast'"),
    ({"optimizer": {"lr": 0}}, r"'optimizer\.lr' must be > 0\.0, got 0\.0"),
    ({"optimizer": {"lr": float("nan")}}, r"'optimizer\.lr' must be a finite number"),
    ({"optimizer": {"betas": [0.9]}}, r"'optimizer\.betas' must be a list of 2 numbers"),
    ({"optimizer": {"betas": [0.9, 1.0]}}, r"'optimizer\.betas\[1\]' must be in \[0, 1\)"),
    ({"optimizer": {"eps": -1}}, r"'optimizer\.eps' must be > 0\.0"),
    ({"optimizer": {"weight_decay": -0.1}}, r"'optimizer\.weight_decay' must be >= 0\.0"),
    ({"optimizer": {"momentum": 0.9}}, r"'optimizer\.momentum' applies to sgd only"),
    ({"optimizer": {"type": "sgd", "momentum": 1.0}}, r"'optimizer\.momentum' must be < 1\.0"),
    ({"scheduler": {"type": "linear"}}, r"needs 'scheduler\.decay_iters'"),
    ({"scheduler": {"type": "cosine", "warmup_iters": 10, "decay_iters": 10}},
     r"'scheduler\.decay_iters' \(10\) must be greater than 'scheduler\.warmup_iters' \(10\)"),
    ({"scheduler": {"warmup_style": "log", "warmup_iters": 1}}, r"'log' needs at least 2 warmup steps, got 'scheduler\.warmup_iters' \(1\)"),
    ({"scheduler": {"min_lr": 1.0}}, r"'scheduler\.min_lr' \(1\.0\) exceeds the peak 'optimizer\.lr'"),
    ({"scheduler": {"warmup_start_lr": 1.0}}, r"'scheduler\.warmup_start_lr' \(1\.0\) exceeds the peak"),
    ({"scheduler": {"warmup_iters": -1}}, r"'scheduler\.warmup_iters' must be >= 0"),
    ({"loss_scaling": {"hysteresis": 0}}, r"'loss_scaling\.hysteresis' must be >= 1"),
    ({"loss_scaling": {"loss_scale_window": 0}}, r"'loss_scaling\.loss_scale_window' must be >= 1"),
    ({"loss_scaling": {"min_loss_scale": 0}}, r"'loss_scaling\.min_loss_scale' must be > 0\.0"),
    ({"loss_scaling": {"loss_scale": -2}}, r"'loss_scaling\.loss_scale' must be >= 0\.0"),
    ({"loss_scaling": {"initial_scale_power": 65}}, r"'loss_scaling\.initial_scale_power' must be <= 64"),
    ({"clip_grad": -1}, r"'clip_grad' must be >= 0\.0"),
    ({"tensor_parallel_size": 0}, r"'tensor_parallel_size' must be >= 1"),
    ({"steps_per_print": -1}, r"'steps_per_print' must be >= 0"),
    ({"seed": "x"}, r"'seed' must be an integer"),
    ({"autocast": True}, r"'autocast' is true but 'precision' is fp32"),
    ({"tensorboard": {"enabled": True, "output_path": ""}}, r"'tensorboard\.output_path' is empty"),
    ({"tensorboard": {"job_name": 3}}, r"'tensorboard\.job_name' must be a string"),
    ({"optimizer": 3}, r"config section 'optimizer' must be a mapping"),
    ({"micro_batch_size": 3, "gradient_accumulation_steps": 2, "global_batch_size": 20},
     r"global_batch_size 20 is not divisible by micro_batch_size 3 x gradient_accumulation_steps 2 = 6"),
    ({1: 2}, r"config keys must be strings"),
    # the trainer's sections follow the same rules
    ({"data": {"path": 5}}, r"'data\.path' must be a list of strings .*got 5 \(int\) \(set by --data-path\)"),
    ({"run": {"train_iters": 0}}, r"'run\.train_iters' must be >= 1, got 0 \(set by --train-iters\)"),
    ({"model": {"hidden_dropout": 1.0}}, r"'model\.hidden_dropout' must be < 1\.0"),
    ({"checkpoint": {"save_interval": 5}}, r"'checkpoint\.save_interval' needs 'checkpoint\.save'"),
    ({"checkpoint": {"keep_last": 2}}, r"'checkpoint\.keep_last' needs 'checkpoint\.save'"),
    ({"checkpoint": {"async_save_chunk_mb": 64}},
     r"'checkpoint\.async_save_chunk_mb' bounds the host copy of a background save; it needs "
     r"'checkpoint\.async_save' \(set by --async-save-chunk-mb, --async-save\)"),
    ({"checkpoint": {"async_save": True, "async_save_chunk_mb": 0}}, r"'checkpoint\.async_save_chunk_mb' must be >= 1"),
    ({"eval": {"iters": -1}}, r"'eval\.iters' must be >= 0"),
    ({"logging": {"log_interval": 0}}, r"'logging\.log_interval' must be >= 1, got 0 \(set by --log-interval\)"),
    ({"distributed": {"timeout_minutes": 0}}, r"'distributed\.timeout_minutes' must be > 0\.0"),
    ({"modle": {}}, r"unknown config key 'modle'\. Did you mean 'model'\?"),
])
def test_bad_native_config_names_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        load_config(data)


def test_every_bad_key_of_a_config_is_named_in_one_error():
    data = {"zero": {"stgae": 2, "overlap_comm": "maybe"}, "optimizer": {"lr": -1, "type": "adamx"},
            "micro_batch_size": 0, "model": {"num_layers": 2}}
    with pytest.raises(ConfigError) as raised:
        load_config(data)
    message = str(raised.value)
    assert "\n" not in message and message.startswith("5 config keys need changing: (1) "), message
    parts = ["unknown config key 'zero.stgae'. Did you mean 'zero.stage'?",
             "'zero.overlap_comm' must be true or false, got 'maybe'", "'optimizer.lr' must be > 0.0, got -1.0",
             "'optimizer.type' must be one of adamw", "'micro_batch_size' must be >= 1, got 0"]
    positions = [message.index(f"({i}) ") for i in range(1, 6)]
    for part, start, end in zip(parts, positions, positions[1:] + [len(message)]):
        assert part in message[start:end], (part, message)  # numbered in the order of the file
    assert set(raised.value.keys) == {"zero.stgae", "zero.overlap_comm", "optimizer.lr", "optimizer.type",
                                      "micro_batch_size"}


def test_a_config_object_with_several_bad_values_names_them_all():
    cfg = HybridConfig()
    cfg.zero.bucket_size, cfg.clip_grad = 0, -1.0
    with pytest.raises(ConfigError, match=r"^2 config keys need changing: \(1\) config key 'zero\.bucket_size' "
                                          r"must be >= 1.* \(2\) config key 'clip_grad' must be >= 0\.0"):
        load_config(cfg)


def test_rules_that_tie_keys_together_wait_until_every_key_is_sound():
    bad_key_and_bad_pair = {"autocast": True, "precision": "fp32", "zero": {"bucket_size": 0}}
    with pytest.raises(ConfigError, match=r"^config key 'zero\.bucket_size' must be >= 1") as raised:
        load_config(bad_key_and_bad_pair)
    assert "autocast" not in str(raised.value)


def test_every_rule_that_ties_keys_together_and_every_training_requirement_is_named_in_one_error():
    from hybrid.config.validate import validate_for_training

    raises_one_error_listing(load_config, {"autocast": True, "precision": "fp32", "zero": {"stage": 0,
                                           "offload_optimizer": "cpu"}, "checkpoint": {"keep_last": 2}},
                             3, "config keys", ("'zero.offload_optimizer' is 'cpu' but 'zero.stage' is 0",
                                                "'autocast' is true but 'precision' is fp32",
                                                "'checkpoint.keep_last' needs 'checkpoint.save'"))
    # the defaults set no run, model, data or batch
    raises_one_error_listing(lambda cfg: validate_for_training(cfg, world_size=1), HybridConfig(), 5, "config keys",
                             ("give the run's length: 'run.train_iters'", "give a model", "the vocabulary size is unknown",
                              "'data.path' is required", "give a batch size"))


@pytest.mark.parametrize("overrides,match", [
    ({"optimizer.learning_rate": 1}, r"unknown config key 'optimizer\.learning_rate'"),
    ({"optimiser.lr": 1}, r"unknown config section 'optimiser'\. Did you mean 'optimizer'\?"),
    ({"zero": 2}, r"config key 'zero' is a section; override its keys, e.g\. 'zero\.stage'"),
    ({"zero.stage": 7}, r"'zero\.stage' must be one of 0, 1, 2, 3, got 7"),
])
def test_bad_overrides(overrides, match):
    with pytest.raises(ConfigError, match=match):
        apply_overrides(HybridConfig(), overrides)


def test_bad_sources(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*missing\.json does not exist"):
        load_config(tmp_path / "missing.json")
    (tmp_path / "c.toml").write_text("")
    with pytest.raises(ConfigError, match=r"must end in \.json, \.yaml or \.yml \(got '\.toml'\)"):
        load_config(tmp_path / "c.toml")
    (tmp_path / "bad.json").write_text("{\"zero\": ")
    with pytest.raises(ConfigError, match=r"bad\.json is not valid JSON"):
        load_config(tmp_path / "bad.json")
    (tmp_path / "bad.yaml").write_text("zero: [1,\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml is not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"list\.yaml must be a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "typo.yaml").write_text("zero:\n  stgae: 1\n")
    with pytest.raises(ConfigError, match=r"typo\.yaml: unknown config key 'zero\.stgae'"):
        load_config(tmp_path / "typo.yaml")
    with pytest.raises(ConfigError, match=r"a config must be a HybridConfig, a dict, or a path"):
        load_config(42)


def _describe(value):
    """A default as docs/config.md writes it."""
    if value is None or value == []:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def test_every_key_is_documented_in_docs_config_md_with_its_flags_and_default():
    """Each key has a row ``| `key` | `--flag`... | `default` | meaning |`` in docs/config.md."""
    from hybrid.config.flags import flags_of
    from hybrid.config.spellings import LEAVES

    text = DOCS.read_text().split("## DeepSpeed-style JSON")[0]  # the key tables come before DeepSpeed's
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([a-z0-9_.]+)` \|.*$", text, re.M)}
    assert len(LEAVES) > 70
    missing = [k for k in LEAVES if k not in rows]
    assert not missing, f"docs/config.md lacks rows for {missing}"
    for key, leaf in LEAVES.items():
        cells = [c.strip() for c in rows[key].split("|")[1:-1]]
        assert len(cells) == 4, rows[key]
        for flag in flags_of(HybridConfig, key):
            assert f"`{flag}`" in cells[1], f"docs/config.md row of {key} lacks flag {flag}: {rows[key]}"
        assert cells[2] == f"`{_describe(leaf.default)}`" or (cells[2] == "unset" and leaf.default in (None, [])), \
            f"docs/config.md gives {key} the default {cells[2]}, the schema {_describe(leaf.default)}"
    stale = [k for k in rows if k not in LEAVES]
    assert not stale, f"docs/config.md documents keys the schema does not have: {stale}"


def test_the_yaml_example_in_docs_config_md_loads(tmp_path):
    text = DOCS.read_text()
    example = text.split("A YAML example with every section:")[1].split("```yaml\n")[1].split("```")[0]
    (tmp_path / "example.yaml").write_text(example)
    cfg = load_config(tmp_path / "example.yaml")
    assert cfg.zero.stage == 2 and cfg.model.preset == "gpt2-small" and cfg.run.train_iters == 300000
