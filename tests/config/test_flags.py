"""The command line derived from the schema: every key has a flag, today's flags keep their meaning,
flags override ``--config``, and the derived switches (``--bf16``, ``--recompute-activations``...) behave."""

import json

import pytest

from hybrid.config import ConfigError, HybridConfig, config_from_command_line
from hybrid.config.flags import flags_of
from hybrid.config.parse import to_dotted
from hybrid.config.spellings import FLAT_NAMES, LEAVES, SPELLINGS


def _settings(argv):
    return to_dotted(config_from_command_line(argv))


def test_no_flags_give_the_schema_defaults():
    # one default per key: the command line adds none of its own
    assert config_from_command_line([]) == HybridConfig()


def test_every_key_has_a_flag_and_every_flag_one_key():
    assert set(LEAVES) == set(to_dotted(HybridConfig()))
    for key in LEAVES:
        assert flags_of(HybridConfig, key), key
    keys_by_flag = {flag: s.leaf.key for flag, s in SPELLINGS.items()}
    assert len(keys_by_flag) == len(SPELLINGS)
    assert all(name == flag[2:].replace("-", "_") for name, flag in ((s.flat_name, s.flag) for s in
                                                                       FLAT_NAMES.values()))


# Every flag of the earlier trainer, its spelling and meaning unchanged: (argv, dotted key, value).
TODAYS_FLAGS = [
    (["--tensor-model-parallel-size", "2"], "tensor_parallel_size", 2),
    (["--sequence-parallel", "--tensor-model-parallel-size", "2"], "model.sequence_parallel", True),
    (["--zero-stage", "2"], "zero.stage", 2),
    (["--zero-stage", "1", "--offload-optimizer", "cpu"], "zero.offload_optimizer", "cpu"),
    (["--zero-bucket-size", "5e6"], "zero.bucket_size", 5_000_000),
    (["--distributed-timeout-minutes", "3"], "distributed.timeout_minutes", 3.0),
    (["--model", "tiny"], "model.preset", "tiny"),
    (["--num-layers", "3"], "model.num_layers", 3),
    (["--hidden-size", "64"], "model.hidden_size", 64),
    (["--num-attention-heads", "4"], "model.num_attention_heads", 4),
    (["--num-query-groups", "2"], "model.num_query_groups", 2),
    (["--kv-channels", "128"], "model.kv_channels", 128),
    (["--qk-layernorm"], "model.qk_layernorm", True),
    (["--rope-scaling", "llama3"], "model.rope_scaling", "llama3"),
    (["--rope-original-max-positions", "8192"], "model.rope_original_max_positions", 8192),
    (["--add-qkv-bias"], "model.add_qkv_bias", True),
    (["--ffn-hidden-size", "256"], "model.ffn_hidden_size", 256),
    (["--seq-length", "128"], "model.seq_length", 128),
    (["--max-position-embeddings", "256"], "model.max_position_embeddings", 256),
    (["--vocab-size", "512"], "model.vocab_size", 512),
    (["--position-embedding-type", "rope"], "model.position_embedding_type", "rope"),
    (["--normalization", "rmsnorm"], "model.normalization", "rmsnorm"),
    (["--norm-epsilon", "1e-6"], "model.norm_epsilon", 1e-6),
    (["--rotary-base", "500000"], "model.rotary_base", 500000.0),
    (["--swiglu"], "model.swiglu", True),
    (["--disable-bias-linear"], "model.disable_bias_linear", True),
    (["--untie-embeddings-and-output-weights"], "model.untie_embeddings_and_output_weights", True),
    (["--hidden-dropout", "0.1"], "model.hidden_dropout", 0.1),
    (["--attention-dropout", "0.1"], "model.attention_dropout", 0.1),
    (["--init-method-std", "0.02"], "model.init_method_std", 0.02),
    (["--micro-batch-size", "4"], "micro_batch_size", 4),
    (["--global-batch-size", "64"], "global_batch_size", 64),
    (["--train-iters", "100"], "run.train_iters", 100),
    (["--optimizer", "sgd"], "optimizer.type", "sgd"),
    (["--lr", "3e-4"], "optimizer.lr", 3e-4),
    (["--min-lr", "1e-5"], "scheduler.min_lr", 1e-5),
    (["--lr-decay-style", "linear", "--lr-decay-iters", "10"], "scheduler.type", "linear"),
    (["--lr-warmup-iters", "5"], "scheduler.warmup_iters", 5),
    (["--lr-decay-style", "cosine", "--lr-decay-iters", "10"], "scheduler.decay_iters", 10),
    (["--weight-decay", "0.1"], "optimizer.weight_decay", 0.1),
    (["--adam-beta1", "0.8"], "optimizer.betas", (0.8, 0.999)),
    (["--adam-beta2", "0.95"], "optimizer.betas", (0.9, 0.95)),
    (["--adam-eps", "1e-6"], "optimizer.eps", 1e-6),
    (["--optimizer", "sgd", "--sgd-momentum", "0.9"], "optimizer.momentum", 0.9),
    (["--clip-grad", "1.0"], "clip_grad", 1.0),
    (["--bf16"], "precision", "bf16"),
    (["--fp16"], "precision", "fp16"),
    (["--loss-scale", "1024"], "loss_scaling.loss_scale", 1024.0),
    (["--initial-loss-scale", "4294967296"], "loss_scaling.initial_scale_power", 32),
    (["--min-loss-scale", "2"], "loss_scaling.min_loss_scale", 2.0),
    (["--loss-scale-window", "500"], "loss_scaling.loss_scale_window", 500),
    (["--hysteresis", "3"], "loss_scaling.hysteresis", 3),
    (["--recompute-activations"], "recompute", "selective"),
    (["--recompute-granularity", "full"], "recompute", "full"),
    (["--recompute-activations", "--recompute-granularity", "full"], "recompute", "full"),
    (["--data-path", "0.3", "a", "0.7", "b"], "data.path", ["0.3", "a", "0.7", "b"]),
    (["--split", "98,2,0"], "data.split", "98,2,0"),
    (["--tokenizer-model", "tok.model"], "data.tokenizer_model", "tok.model"),
    (["--eod-mask-loss"], "data.eod_mask_loss", True),
    (["--mock-data"], "data.mock", True),
    (["--save", "ckpt"], "checkpoint.save", "ckpt"),
    (["--load", "ckpt"], "checkpoint.load", "ckpt"),
    (["--save", "ckpt", "--save-interval", "10"], "checkpoint.save_interval", 10),
    (["--save", "ckpt", "--keep-last", "2"], "checkpoint.keep_last", 2),
    (["--finetune"], "checkpoint.finetune", True),
    (["--override-opt-param-scheduler"], "checkpoint.override_opt_param_scheduler", True),
    (["--eval-interval", "50"], "eval.interval", 50),
    (["--eval-iters", "4"], "eval.iters", 4),
    (["--log-interval", "10"], "logging.log_interval", 10),
    (["--tensorboard-dir", "tb"], "logging.tensorboard_dir", "tb"),
    (["--seed", "7"], "seed", 7),
    (["--peak-tflops", "312"], "logging.peak_tflops", 312.0),
    (["--exit-interval", "20"], "run.exit_interval", 20),
    (["--exit-duration-in-mins", "30"], "run.exit_duration_in_mins", 30.0),
    (["--no-fused-kernels"], "use_fused_kernels", False),
]

# Engine settings that had no flag before.
NEW_FLAGS = [
    (["--no-zero-overlap-comm"], "zero.overlap_comm", False),
    (["--zero-overlap-comm"], "zero.overlap_comm", True),
    (["--zero-stage", "3", "--zero-persistence-threshold", "1000"], "zero.persistence_threshold", 1000),
    (["--zero-max-live-parameters", "3e8"], "zero.max_live_parameters", 300_000_000),
    (["--zero-prefetch-bucket-size", "0"], "zero.prefetch_bucket_size", 0),
    (["--bf16", "--autocast"], "autocast", True),
    (["--precision", "fp16"], "precision", "fp16"),
    (["--precision", "bf16", "--bf16"], "precision", "bf16"),
    (["--gradient-accumulation-steps", "4"], "gradient_accumulation_steps", 4),
    (["--steps-per-print", "0"], "steps_per_print", 0),
    (["--adam-betas", "0.9", "0.95"], "optimizer.betas", (0.9, 0.95)),
    (["--adam-betas", "0.8", "0.9", "--adam-beta2", "0.95"], "optimizer.betas", (0.8, 0.95)),
    (["--optimizer-decay-1d-params"], "optimizer.decay_1d_params", True),
    (["--lr-warmup-style", "log", "--lr-warmup-iters", "10"], "scheduler.warmup_style", "log"),
    (["--lr-warmup-init", "1e-5"], "scheduler.warmup_start_lr", 1e-5),
    (["--initial-scale-power", "12"], "loss_scaling.initial_scale_power", 12),
    (["--tensorboard-enabled", "--tensorboard-output-path", "tb"], "tensorboard.output_path", "tb"),
    (["--tensorboard-job-name", "run1"], "tensorboard.job_name", "run1"),
    (["--fused-kernels"], "use_fused_kernels", True),
]


@pytest.mark.parametrize("argv,key,value", TODAYS_FLAGS + NEW_FLAGS)
def test_flag_sets_its_key(argv, key, value):
    assert _settings(argv)[key] == (list(value) if isinstance(value, tuple) else value)


def test_todays_flags_are_all_still_spelled():
    for argv, _, _ in TODAYS_FLAGS:
        for arg in argv:
            assert not arg.startswith("--") or arg in SPELLINGS, arg


def test_flags_override_the_config_file_and_weak_switches_yield(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("zero: {stage: 1, bucket_size: 1000}\nrecompute: full\noptimizer: {betas: [0.8, 0.9]}\n")
    s = _settings(["--config", str(path), "--zero-stage", "2", "--recompute-activations", "--adam-beta2", "0.95"])
    assert (s["zero.stage"], s["zero.bucket_size"]) == (2, 1000)
    assert s["recompute"] == "full"  # --recompute-activations: selective only when nothing else set it
    assert s["optimizer.betas"] == [0.8, 0.95]


def test_deepspeed_config_file_under_flags(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                                "bf16": {"enabled": True}}))
    s = _settings(["--config", str(path), "--zero-stage", "3", "--lr", "1e-4"])
    assert (s["micro_batch_size"], s["zero.stage"], s["precision"], s["optimizer.lr"]) == (2, 3, "bf16", 1e-4)


@pytest.mark.parametrize("argv,match", [
    (["--bf16", "--fp16"], r"--bf16 and --fp16 are mutually exclusive: they set 'precision' to different values "
                           r"\('bf16', 'fp16'\); give one \(set by --precision, --bf16, --fp16\)"),
    (["--precision", "fp32", "--bf16"], r"--precision and --bf16 are mutually exclusive"),
    (["--initial-loss-scale", "3"], r"--initial-loss-scale '3': must be a power of two"),
    (["--zero-stage", "two"], r"'zero\.stage' must be an integer, got 'two' \(str\) \(set by --zero-stage\)"),
    (["--precision", "bf61"], r"'precision' must be one of fp32, bf16, fp16, got 'bf61'\. Did you mean 'bf16'\?"),
    (["--autocast"], r"'autocast' is true but 'precision' is fp32.*\(set by --autocast, --precision, --bf16, --fp16\)"),
    (["--lr", "0"], r"'optimizer\.lr' must be > 0\.0, got 0\.0 \(set by --lr\)"),
    (["--adam-beta2", "1.0"], r"'optimizer\.betas\[1\]' must be in \[0, 1\).*--adam-beta2"),
])
def test_flag_errors_name_key_and_flag(argv, match):
    with pytest.raises(ConfigError, match=match):
        config_from_command_line(argv)


def test_unknown_flag_exits_with_the_nearest_flag(capsys):
    with pytest.raises(SystemExit):
        config_from_command_line(["--zero-persistance-threshold", "5"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --zero-persistance-threshold 5 (did you mean --zero-persistence-threshold?)" \
        in err


def test_abbreviations_are_not_flags(capsys):
    with pytest.raises(SystemExit):
        config_from_command_line(["--zero-stag", "1"])
    assert "unrecognized arguments" in capsys.readouterr().err
