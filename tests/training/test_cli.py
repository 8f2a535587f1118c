"""The trainer's command line: bad settings fail before any training, with errors that name the key and the flag."""

import os
import subprocess
import sys

import pytest

from hybrid.config import ConfigError
from hybrid.training import parse_args, validate
from hybrid.training.trainer import main

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "512", "--micro-batch-size", "1"]


def _fails(argv, world, match, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 1
    (text,) = capsys.readouterr().err.splitlines()
    assert text.startswith("hybrid-train: error: "), text
    for part in match if isinstance(match, tuple) else (match,):
        assert part in text, text


@pytest.mark.parametrize("argv,world,match", [
    (MODEL + ["--mock-data", "--train-iters", "2", "--tensor-model-parallel-size", "3"], 4,
     ("world size 4 is not divisible by tensor_parallel_size x pipeline.size = 3 x 1",
      "(set by --tensor-model-parallel-size, --pipeline-model-parallel-size)")),
    (MODEL + ["--mock-data", "--train-iters", "2", "--tensor-model-parallel-size", "2",
              "--pipeline-model-parallel-size", "3"], 4,
     ("world size 4 is not divisible by tensor_parallel_size x pipeline.size = 2 x 3", "start a multiple of 6")),
    (MODEL + ["--mock-data", "--train-iters", "2", "--pipeline-model-parallel-size", "2", "--zero-stage", "3"], 4,
     ("ZeRO stage 3 partitions the parameters", "(set by --zero-stage, --pipeline-model-parallel-size)")),
    (MODEL + ["--mock-data", "--train-iters", "2", "--pipeline-schedule", "interleaved"], 4,
     ("the interleaved pipeline schedule and 'pipeline.layers_per_virtual_stage' go together",)),
    (MODEL + ["--mock-data", "--train-iters", "2", "--micro-batch-size", "2", "--global-batch-size", "6"], 2,
     ("global_batch_size 6 is not divisible by micro_batch_size x data-parallel size = 2 x 2 = 4",
      "--micro-batch-size", "--global-batch-size")),
    (MODEL + ["--train-iters", "2"], 1,
     ("'data.path' is required", "(set by --data-path, --train-data-path, --mock-data)")),
    (MODEL + ["--train-iters", "2", "--data-path", "/nonexistent/corpus_text_document"], 1,
     ("/nonexistent/corpus_text_document.bin does not exist", "--data-path")),
    (MODEL + ["--mock-data"], 1, ("give the run's length", "(set by --train-iters, --train-samples)")),
    (MODEL[:-2] + ["--mock-data", "--train-iters", "2"], 1,
     ("give a batch size", "--micro-batch-size", "--global-batch-size")),
    (MODEL + ["--mock-data", "--train-iters", "2", "--bf16", "--fp16"], 1,
     ("--bf16 and --fp16 are mutually exclusive", "'precision'")),
    (MODEL + ["--mock-data", "--train-iters", "2", "--num-attention-heads", "8", "--tensor-model-parallel-size",
              "3"], 3, ("num_heads=8 must be divisible by the tensor-parallel size tp=3",
                        "(set by --num-attention-heads, --tensor-model-parallel-size)")),
    (MODEL + ["--mock-data", "--train-iters", "2", "--hidden-size", "30", "--num-attention-heads", "8"], 1,
     ("GPTConfig.hidden_size=30 must be divisible by num_heads=8, or kv_channels must give the head dim",
      "(set by --hidden-size, --num-attention-heads, --kv-channels)")),
    (["--model", "gpt2-smal", "--mock-data", "--train-iters", "2", "--micro-batch-size", "1"], 1,
     ("did you mean 'gpt2-small'", "(set by --model)")),
    (MODEL + ["--mock-data", "--train-iters", "2", "--data-path", "corpus_text_document"], 1,
     ("'data.mock' trains on random tokens and would ignore 'data.path'", "(set by --mock-data, --data-path)")),
    (MODEL + ["--mock-data", "--train-iters", "2", "--finetune"], 1,
     ("'checkpoint.finetune' changes how a checkpoint is loaded; it needs 'checkpoint.load'", "--finetune")),
    (MODEL + ["--mock-data", "--train-iters", "2", "--override-opt-param-scheduler"], 1,
     ("'checkpoint.override_opt_param_scheduler'", "needs 'checkpoint.load'")),
    (MODEL + ["--mock-data", "--train-iters", "2", "--async-save"], 1,
     ("'checkpoint.async_save' writes the trainer's checkpoints in the background; it needs 'checkpoint.save'",
      "(set by --async-save, --save)")),
    (MODEL + ["--mock-data", "--train-iters", "2", "--save-interval", "5"], 1,
     ("'checkpoint.save_interval' needs 'checkpoint.save'", "(set by --save-interval, --save)")),
    # --sequence-parallel at TP 1 is turned off with a note, as Megatron-LM does (tests/config/test_megatron_flags.py)
    (MODEL + ["--mock-data", "--train-iters", "2", "--initial-loss-scale", "1000"], 1,
     ("--initial-loss-scale '1000': must be a power of two", "(set by --initial-scale-power, --initial-loss-scale)")),
    (MODEL + ["--mock-data", "--train-iters", "2", "--zero-stage", "0", "--offload-optimizer", "cpu"], 1,
     ("offload to cpu needs ZeRO stage 1, 2 or 3", "(set by --offload-optimizer, --zero-stage)")),
    (MODEL + ["--mock-data", "--train-iters", "2", "--zero-stage", "0", "--overlap-param-gather"], 1,
     ("zero.overlap_param_gather needs ZeRO stage 1 or 2: at stage 0 every rank steps the whole model",
      "(set by --overlap-param-gather, --zero-stage)")),
    (MODEL + ["--mock-data", "--train-iters", "2", "--zero-stage", "4"], 1,
     ("'zero.stage' must be one of 0, 1, 2, 3, got 4", "(set by --zero-stage)")),
    (MODEL + ["--mock-data", "--train-iters", "2", "--zero-stage", "4", "--lr", "-1"], 1,
     ("2 config keys need changing: (1) ", "'zero.stage' must be one of 0, 1, 2, 3, got 4 (set by --zero-stage)",
      "'optimizer.lr' must be > 0.0, got -1.0 (set by --lr)")),
    (MODEL + ["--mock-data", "--train-iters", "2", "--zero-bucket-size", "lots"], 1,
     ("'zero.bucket_size' must be an integer, got 'lots'", "(set by --zero-bucket-size)")),
    (MODEL + ["--mock-data", "--train-iters", "2", "--sgd-momentum", "0.9"], 1,
     ("'optimizer.momentum' applies to sgd only", "--sgd-momentum", "--optimizer")),
    (MODEL + ["--mock-data", "--train-iters", "2", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2"], 1,
     ("'scheduler.decay_iters' (2) must be greater than 'scheduler.warmup_iters' (2)", "--lr-decay-iters")),
])
def test_bad_settings_exit_before_training(argv, world, match, monkeypatch, capsys):
    _fails(argv, world, match, monkeypatch, capsys)


def test_tokenizer_and_output_paths_are_checked_before_training(tmp_path, monkeypatch, capsys):
    from hybrid.data.tokenizer import train_sentencepiece
    from tests.data.testkit import synthetic_documents

    train_sentencepiece(synthetic_documents(200, seed=3), tmp_path / "tok", 256)
    model = [a for a in MODEL if a not in ("--vocab-size", "512")]
    run = model + ["--mock-data", "--train-iters", "2"]
    _fails(run + ["--tokenizer-model", str(tmp_path / "tok.model"), "--vocab-size", "200"], 1,
           ("'model.vocab_size' 200 is smaller than the 256 tokens of", "set it to at least 256",
            "(set by --vocab-size, --tokenizer-model)"), monkeypatch, capsys)
    (tmp_path / "notes.txt").write_text("not a model")
    _fails(run + ["--tokenizer-model", str(tmp_path / "notes.txt")], 1,
           ("notes.txt is not a SentencePiece model", "--tokenizer-model"), monkeypatch, capsys)
    _fails(run + ["--tokenizer-model", str(tmp_path)], 1, ("is a directory", "--tokenizer-model"), monkeypatch, capsys)
    _fails(run + ["--vocab-size", "512", "--tensorboard-dir", str(tmp_path / "notes.txt")], 1,
           ("'logging.tensorboard_dir'", "notes.txt is a file", "(set by --tensorboard-dir)"), monkeypatch, capsys)


def test_config_file_with_flat_keys_and_flag_override(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("num-layers: 3\nhidden_size: 64\nnum_attention_heads: 4\nseq_length: 32\nlr: 0.5\n"
                   "data_path: [0.3, a, 0.7, b]\nbf16: true\nzero_stage: 2\nno_fused_kernels: true\n"
                   "lr_decay_iters: null\n")
    config = parse_args(["--config", str(cfg), "--lr", "0.25"])
    assert (config.model.num_layers, config.model.hidden_size, config.optimizer.lr) == (3, 64, 0.25)
    assert config.data.path == ["0.3", "a", "0.7", "b"]
    assert config.precision == "bf16" and config.zero.stage == 2 and config.use_fused_kernels is False


def test_config_file_with_the_nested_tree(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("zero: {stage: 3, persistence_threshold: 1000, overlap_comm: false}\n"
                   "model: {num_layers: 2, hidden_size: 64, num_attention_heads: 4, seq_length: 32, vocab_size: 512}\n"
                   "data: {mock: true}\nrun: {train_iters: 7}\nscheduler: {type: cosine}\nmicro_batch_size: 2\n")
    config = parse_args(["--config", str(cfg), "--zero-max-live-parameters", "123", "--zero-overlap-comm"])
    z = config.zero
    assert (z.stage, z.persistence_threshold, z.max_live_parameters, z.overlap_comm) == (3, 1000, 123, True)
    # the trainer derives the decay length from the run length
    assert config.scheduler.decay_iters == 7 and config.run.train_iters == 7
    validate(config, world_size=2)


@pytest.mark.parametrize("text,match", [
    ('{"hiden_size": 64}', r"unknown config key 'hiden_size'\. Did you mean 'hidden_size'\?"),
    ('{"data_path": 5}', r"'data\.path' must be a list of strings .*got 5 \(int\) \(set by --data-path\)"),
    ('{"data": {"path": 5}}', r"'data\.path' must be a list of strings .*got 5 \(int\)"),
    ('{"zero": {"stgae": 1}}', r"unknown config key 'zero\.stgae'\. Did you mean 'zero\.stage'\?"),
    ('{"bf16": "yes"}', r"'bf16' is a switch \(--bf16\): give true or false, got 'yes'"),
    ('{"lr": "fast"}', r"'optimizer\.lr' must be a number, got 'fast' .*\(set by --lr\)"),
    ('[1, 2]', r"expected a mapping of settings at the top level"),
    ('{"micro_batch_sise": 2, "zero": {"stgae": 1}, "lr": -1}',
     r"3 config keys need changing: \(1\) unknown config key 'micro_batch_sise'\. Did you mean 'micro_batch_size'\? "
     r"\(2\) unknown config key 'zero\.stgae'.* \(3\) config key 'optimizer\.lr' must be > 0\.0, got -1"),
    ('{"zero_stage": 1, "zero": {"stage": 2}}',
     r"config keys 'zero_stage' and 'zero\.stage' both set 'zero\.stage', to different values \(1, 2\); give one"),
    ('{"tensor_parallel_size": 1, "tensor_model_parallel_size": 2}',
     r"'tensor_model_parallel_size' and 'tensor_parallel_size' both set 'tensor_parallel_size'"),
    (b"\xff\xfe\x00garbage", r"is not UTF-8 text \(invalid start byte at byte 0\); give the JSON or YAML file"),
])
def test_config_file_errors_name_the_key(tmp_path, text, match):
    cfg = tmp_path / "run.json"
    cfg.write_bytes(text) if isinstance(text, bytes) else cfg.write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        parse_args(["--config", str(cfg)])
    assert str(info.value).startswith(f"--config {cfg}: ")


def test_a_files_nested_and_flat_keys_may_agree_and_flags_still_override_both(tmp_path):
    cfg = tmp_path / "run.json"
    cfg.write_text('{"zero_stage": 2, "zero": {"stage": 2}, "optimizer": {"betas": [0.9, 0.95]}, "adam_beta1": 0.9}')
    config = parse_args(["--config", str(cfg)])
    assert config.zero.stage == 2 and config.optimizer.betas == (0.9, 0.95)
    assert parse_args(["--config", str(cfg), "--zero-stage", "1"]).zero.stage == 1


def test_integers_are_read_exactly_not_through_a_float():
    assert parse_args(["--train-iters", "9007199254740993"]).run.train_iters == 2 ** 53 + 1
    with pytest.raises(ConfigError, match=r"'seed' must be <= 4294967295, got 12345678901234567 "):
        parse_args(["--seed", "12345678901234567"])


def test_unknown_flag_is_rejected_with_the_nearest_flag():
    proc = subprocess.run([sys.executable, "-m", "hybrid.train", "--hiden-size", "64"], capture_output=True,
                          text=True, env={**os.environ, "WORLD_SIZE": "1"})
    assert proc.returncode != 0
    assert "unrecognized arguments: --hiden-size 64 (did you mean --hidden-size?)" in proc.stderr


def test_help_lists_every_engine_setting():
    proc = subprocess.run([sys.executable, "-m", "hybrid.train", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--zero-stage", "--zero-overlap-comm", "--no-zero-overlap-comm", "--zero-persistence-threshold",
                 "--zero-max-live-parameters", "--zero-prefetch-bucket-size", "--offload-optimizer", "--autocast",
                 "--zero-bucket-size", "--gradient-accumulation-steps", "--steps-per-print", "--lr-warmup-style"):
        assert flag in proc.stdout, flag
    # each flag's help names its key and default
    assert "[zero.persistence_threshold; default: 100000]" in " ".join(proc.stdout.split())


def test_valid_settings_pass():
    config = parse_args(MODEL + ["--mock-data", "--train-iters", "4", "--tensor-model-parallel-size", "2",
                                 "--global-batch-size", "8", "--micro-batch-size", "2"])
    validate(config, world_size=4)
    assert config.precision == "fp32" and config.recompute == "none"
    assert not config.zero.overlap_param_gather
    assert parse_args(MODEL + ["--zero-stage", "2", "--overlap-param-gather"]).zero.overlap_param_gather
    assert config.tensor_parallel_size == 2 and config.resolve_batch(2).gradient_accumulation_steps == 2
