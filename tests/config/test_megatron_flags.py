"""A Megatron-LM launch script's flags: those with a key set it, those hybrid does anyway are accepted and
named in one note, those it does not do stop the run with one line naming what to use instead."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.config import ConfigError, config_from_command_line, validate_for_training
from hybrid.config.megatron_flags import MEGATRON_FLAGS, check_megatron_flags

REPO = Path(__file__).resolve().parents[2]

# The flags of a typical Megatron-LM Llama-style pretraining script (a small model, mock data).
MEGATRON_SCRIPT = [
    "--use-mcore-models", "--transformer-impl", "local", "--num-layers", "2", "--hidden-size", "64",
    "--ffn-hidden-size", "172", "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--kv-channels", "32", "--qk-layernorm", "--seq-length", "32", "--max-position-embeddings", "32",
    "--position-embedding-type", "rope",
    "--no-position-embedding", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "20", "--lr", "3e-4", "--min-lr", "3e-5",
    "--lr-decay-style", "WSD", "--lr-wsd-decay-style", "linear", "--lr-wsd-decay-iters", "5",
    "--lr-warmup-iters", "2", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
    "--clip-grad", "1.0", "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
    "--use-flash-attn", "--attention-softmax-in-fp32", "--no-masked-softmax-fusion",
    "--no-gradient-accumulation-fusion",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", "--sequence-parallel",
    "--distributed-backend", "nccl", "--mock-data", "--vocab-size", "128", "--num-workers", "2", "--log-interval", "1",
    "--log-throughput", "--log-params-norm", "--log-num-zeros-in-grad", "--log-memory-to-tensorboard",
    "--log-validation-ppl-to-tensorboard", "--tensorboard-dir", "tb", "--eval-interval", "10", "--eval-iters", "2",
    "--exit-signal-handler", "--ckpt-format", "torch_dist", "--seed", "1234",
    "--make-vocab-size-divisible-by", "128", "--rotary-percent", "1.0", "--no-create-attention-mask-in-dataloader",
    "--check-for-nan-in-loss-and-grad", "--use-dist-ckpt", "--exit-on-missing-checkpoint",
]


def test_a_megatron_script_parses_into_the_settings_it_means():
    notes = []
    cfg = config_from_command_line(MEGATRON_SCRIPT, notes=notes)
    validate_for_training(cfg, world_size=4)
    assert cfg.zero.stage == 1 and cfg.zero.overlap_comm  # the distributed optimizer is ZeRO-1
    assert (cfg.precision, cfg.recompute, cfg.tensor_parallel_size) == ("bf16", "full", 2)
    assert (cfg.scheduler.type, cfg.scheduler.wsd_decay_iters, cfg.scheduler.decay_iters) == ("wsd", 5, 20)
    assert cfg.logging.log_params_norm and cfg.logging.log_num_zeros_in_grad
    noted = [n.split(" (")[0] for n in notes]
    assert noted == ["--use-flash-attn", "--attention-softmax-in-fp32", "--use-mcore-models",
                     "--transformer-impl local", "--exit-signal-handler", "--log-throughput",
                     "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard",
                     "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion", "--group-query-attention",
                     "--no-position-embedding", "--distributed-backend nccl", "--num-workers 2",
                     "--ckpt-format torch_dist", "--use-dist-ckpt",
                     "--make-vocab-size-divisible-by 128", "--no-create-attention-mask-in-dataloader",
                     "--rotary-percent 1.0", "--recompute-method uniform", "--recompute-num-layers 1"]
    assert cfg.checkpoint.exit_on_missing_checkpoint  # a key of its own
    assert cfg.run.check_for_nan_in_loss_and_grad  # a key of its own too


def test_the_model_reads_megatrons_spellings_of_model_zoo_choices():
    from hybrid.training.model import model_config

    cfg = config_from_command_line(MEGATRON_SCRIPT)
    gpt = model_config(cfg, vocab_size=128)
    assert (gpt.norm, gpt.position, gpt.mlp, gpt.num_query_groups) == ("rmsnorm", "rope", "swiglu", 2)
    assert (gpt.head_dim, gpt.attention_width) == (32, 128)  # --kv-channels: 4 heads of 32 on hidden 64
    assert gpt.qk_norm  # --qk-layernorm, with the model's RMSNorm
    learned = config_from_command_line(["--position-embedding-type", "learned_absolute", "--normalization",
                                        "LayerNorm", "--num-layers", "1", "--hidden-size", "32",
                                        "--num-attention-heads", "4", "--seq-length", "16"])
    assert (model_config(learned, 64).position, model_config(learned, 64).norm) == ("learned", "layernorm")
    rotary = config_from_command_line(["--use-rotary-position-embeddings"])
    assert rotary.model.position_embedding_type == "rope"


def test_the_distributed_optimizer_yields_to_an_explicit_zero_stage():
    assert config_from_command_line(["--use-distributed-optimizer", "--zero-stage", "2"]).zero.stage == 2
    assert config_from_command_line(["--zero-stage", "3", "--use-distributed-optimizer"]).zero.stage == 3


@pytest.mark.parametrize("argv,match", [
    (["--recompute-method", "block"], r"^--recompute-method block is a Megatron-LM setting hybrid does not take: "
                                      r".*; accepted: --recompute-method uniform$"),
    (["--recompute-num-layers", "4"], r"accepted: --recompute-num-layers 1$"),
    (["--num-experts", "8", "--moe-router-topk-limited-devices", "4"],
     r"^--moe-router-topk-limited-devices 4 is a Megatron-LM flag hybrid does not take: Megatron's deprecated .* "
     r"--moe-router-num-groups"),
    (["--num-experts", "8", "--moe-router-load-balancing-type", "sinkhorn"],
     r"^--moe-router-load-balancing-type sinkhorn is a Megatron-LM setting hybrid does not take: .*Sinkhorn.*: give "
     r"aux_loss, seq_aux_loss"),
    (["--num-experts", "8", "--moe-token-dispatcher-type", "flex"], r"flex dispatcher are not used.*alltoall"),
    (["--num-experts", "8", "--moe-router-dtype", "fp64"], r"accepted: --moe-router-dtype fp32$"),
    (["--num-experts", "8", "--moe-use-upcycling"], r"upcycling a dense checkpoint"),
    (["--num-experts", "8", "--moe-layer-recompute"], r"--recompute-granularity full$"),
    (["--num-experts", "8", "--moe-input-jitter-eps", "0.01"], r"router input jitter is not implemented"),
    (["--num-experts", "8", "--moe-loss-coeff", "0.01"], r"a Megatron-DeepSpeed MoE flag; hybrid reads "
                                                         r"Megatron-Core's: --moe-aux-loss-coeff$"),
    (["--num-experts", "8", "--moe-future-knob", "3"], r"^--moe-future-knob 3 is a Megatron-LM flag hybrid does not "
                                                       r"take: a Megatron-Core MoE flag hybrid has no counterpart"),
    (["--num-experts", "8", "--moe-layer-freq", "[1]*3+[2]"], r"'model.moe_layer_freq': --moe-layer-freq "
                                                              r"'\[1\]\*3\+\[2\]': expected N or a list"),
    (["--accumulate-allreduce-grads-in-fp32"], r"for fp32 gradients keep fp32 parameters with --autocast"),
    (["--use-rope-scaling"], r"give --rope-scaling llama3 --rope-scaling-factor 8 \(Megatron's default factor\)$"),
    (["--rotary-percent", "0.5"], r"hybrid rotates the whole head dimension; accepted: --rotary-percent 1.0 or 1$"),
    (["--no-save-optim"], r"tools/convert_checkpoint.py exports the weights alone \(to-fp32, to-hf\)$"),
    (["--save-retain-interval", "1000"], r"^--save-retain-interval 1000 is a Megatron-LM flag hybrid does not "
                                         r"take: --keep-last K"),
    (["--squared-relu"], r"MLPs are gelu \(the tanh approximation\) and --swiglu$"),
    (["--apply-residual-connection-post-layernorm"], r"layers are pre-norm"),
])
def test_what_hybrid_does_not_do_stops_with_one_line(argv, match):
    with pytest.raises(ConfigError, match=match) as raised:
        config_from_command_line(argv)
    assert "\n" not in str(raised.value)


def test_every_entry_says_why_and_none_shadows_a_key():
    from hybrid.config.spellings import SPELLINGS

    flags = [f.flag for f in MEGATRON_FLAGS]
    assert len(set(flags)) == len(flags)
    assert not set(flags) & set(SPELLINGS)  # a flag with a key is a spelling of that key, not an entry here
    assert all(f.reason for f in MEGATRON_FLAGS)
    assert check_megatron_flags([]) == ()


def test_the_trainer_prints_the_note_once_on_rank_0(monkeypatch, capsys):
    from hybrid.training.cli import parse_args

    flags = ["--mock-data", "--micro-batch-size", "1", "--train-iters", "1", "--num-layers", "1", "--hidden-size",
             "32", "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "64", "--use-flash-attn",
             "--exit-signal-handler", "--eval-interval", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "hybrid.train", *flags], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    notes = [line for line in proc.stderr.splitlines() if "note:" in line]
    assert notes == ["hybrid-train: note: Megatron-LM flags with no effect here: --use-flash-attn (attention runs "
                     "through torch's scaled_dot_product_attention, which picks its fastest kernel, flash where it "
                     "can); --exit-signal-handler (SIGTERM and SIGINT always save a checkpoint and stop; "
                     "docs/training.md)"]
    monkeypatch.setenv("RANK", "1")  # the other ranks parse the same flags and stay silent
    parse_args(flags)
    assert capsys.readouterr().err == ""


def test_the_megatron_script_trains_under_torchrun(tmp_path):
    """The script's flags as they are (shorter: 6 iterations of global batch 2), TP 2 on two CPU processes."""
    argv = list(MEGATRON_SCRIPT)
    for flag, value in (("--train-iters", "6"), ("--global-batch-size", "2"), ("--lr-wsd-decay-iters", "2"),
                        ("--tensorboard-dir", str(tmp_path / "tb"))):
        argv[argv.index(flag) + 1] = value
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "hybrid.train", *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tp=2 dp=1 pp=1, device cpu, ZeRO stage 1, bf16" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("iteration")]
    assert len(lines) == 6 and all("params norm:" in line and "num zeros:" in line for line in lines)
    # WSD: warmup over 2 steps, the peak, then the linear anneal over the last 2 of 6 steps
    assert [line.split("lr: ")[1].split(" ")[0] for line in lines] == ["0.000E+00", "1.500E-04", "3.000E-04",
                                                                       "3.000E-04", "3.000E-04", "1.650E-04"]
    assert sum("note: Megatron-LM flags with no effect here" in line for line in proc.stderr.splitlines()) == 1


def test_data_args_path_reads_the_blend_from_a_file(tmp_path):
    blend = tmp_path / "blend.txt"
    blend.write_text("0.3 /data/a_text_document\n0.7 /data/b_text_document\n")
    cfg = config_from_command_line(["--data-args-path", str(blend)])
    assert cfg.data.path == ["0.3", "/data/a_text_document", "0.7", "/data/b_text_document"]
    with pytest.raises(ConfigError, match=r"^--data-args-path '.*nope': cannot read it: No such file or directory"):
        config_from_command_line(["--data-args-path", str(tmp_path / "nope")])
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ConfigError, match=r"the file is empty"):
        config_from_command_line(["--data-args-path", str(tmp_path / "empty.txt")])


@pytest.mark.parametrize("flag,reason", [
    ("--masked-softmax-fusion", "--fused-kernels / --no-fused-kernels"),
    ("--bias-dropout-fusion", "--fused-kernels / --no-fused-kernels"),
    ("--mmap-bin-files", "always memory-maps"),
    ("--no-mmap-bin-files", "not the samples"),
    ("--openai-gelu", "already the tanh approximation"),
])
def test_flags_for_what_hybrid_does_anyway_are_noted_with_their_reason(flag, reason):
    notes = []
    config_from_command_line([flag], notes=notes)
    assert len(notes) == 1 and notes[0].startswith(flag) and reason in notes[0], notes


# ---- issue 53: one launch lists everything; settings that mean "off" are accepted with a note ------------------

SMALL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--vocab-size", "64", "--micro-batch-size", "1", "--train-iters", "2"]


@pytest.mark.parametrize("argv,noted", [
    (["--sequence-parallel"], "--sequence-parallel (turned off: "),
    (["--expert-model-parallel-size", "1"], "--expert-model-parallel-size 1 (one expert-parallel rank"),
    (["--num-experts", "1", "--moe-router-topk", "1"], "--moe-router-topk 1 (no effect on a dense model"),
    (["--num-experts", "1"], "--num-experts 1 (one expert is the dense MLP"),
    (["--moe-router-pre-softmax", "--moe-loss-coeff", "0.01"], "--moe-loss-coeff 0.01 (no effect on a dense model"),
    (["--num-experts", "1", "--moe-router-load-balancing-type", "sinkhorn"],
     "--moe-router-load-balancing-type sinkhorn (no effect on a dense model"),
    (["--num-experts", "4", "--moe-permute-fusion"], "--moe-permute-fusion (hybrid orders the tokens by expert"),
    (["--num-experts", "4", "--moe-router-dtype", "fp32"], "--moe-router-dtype fp32 (the router computes"),
    (["--empty-unused-memory-level", "2"], "--empty-unused-memory-level 2 (emptying the CUDA allocator's cache"),
    (["--tokenizer-type", "NullTokenizer", "--mock-data"], "--tokenizer-type NullTokenizer (no tokenizer is read"),
    (["--split", "'99,1,0'"], "--split '99,1,0' (read as 99,1,0"),
    (["--data-impl", "mmap"], "--data-impl mmap (hybrid always memory-maps"),
    (["--no-query-key-layer-scaling"], "--no-query-key-layer-scaling (hybrid applies no query-key layer scaling"),
    (["--num-key-value-heads", "2"], "--num-key-value-heads 2 (read as --num-query-groups 2)"),
    (["--checkpoint-activations"], "--checkpoint-activations (read as --recompute-granularity full)"),
])
def test_settings_that_mean_off_are_accepted_with_a_note(argv, noted):
    notes = []
    config_from_command_line(SMALL + argv, notes=notes)
    assert any(n.startswith(noted) for n in notes), notes


def test_what_the_noted_settings_mean():
    cfg = config_from_command_line(SMALL + ["--sequence-parallel", "--split", "'99,1,0'", "--num-key-value-heads",
                                            "2", "--checkpoint-activations", "--tokenizer-type", "Llama2Tokenizer"])
    assert not cfg.model.sequence_parallel and cfg.data.split == "99,1,0"
    assert (cfg.model.num_query_groups, cfg.recompute) == (2, "full")
    assert cfg.data.tokenizer_type == "sentencepiecetokenizer"
    assert config_from_command_line(["--checkpoint-activations", "--recompute-granularity", "selective"]).recompute \
        == "selective"  # the explicit setting wins, as over --recompute-activations
    empty_valid = config_from_command_line(SMALL + ["--data-path", "d", "--split", "100,0,0", "--eval-interval", "5"])
    assert empty_valid.eval.interval == 0  # Megatron skips the empty validation split
    assert config_from_command_line(SMALL + ["--sequence-parallel", "--tensor-model-parallel-size", "2"]) \
        .model.sequence_parallel


def test_refused_and_invalid_flags_are_listed_in_one_error():
    argv = SMALL + ["--fp8-format", "hybrid", "--fp8-param-gather", "--num-experts", "8", "--moe-router-topk", "2",
                    "--moe-router-topk-limited-devices", "2", "--moe-router-load-balancing-type", "sinkhorn",
                    "--data-path2", "0.5", "a", "0.5", "b", "--lr", "-1", "--window-size", "127,0"]
    with pytest.raises(ConfigError) as raised:
        config_from_command_line(argv)
    message = str(raised.value)
    assert message.startswith("7 settings need changing: (1) ") and "\n" not in message
    for part in ("--fp8-format hybrid is a Megatron-LM flag hybrid does not take: hybrid trains in bf16",
                 "--fp8-param-gather is a Megatron-LM flag hybrid does not take: hybrid trains in bf16",
                 "--moe-router-topk-limited-devices 2 is a Megatron-LM flag hybrid does not take: Megatron's",
                 "--moe-router-load-balancing-type sinkhorn is a Megatron-LM setting hybrid does not take: S-BASE's",
                 "--data-path2 0.5 a 0.5 b is a Megatron-LM flag",
                 "--window-size 127,0 is a Megatron-LM flag hybrid does not take: gpt-oss's variants",
                 "'optimizer.lr' must be > 0.0"):
        assert part in message, part


def test_an_unknown_flag_exits_naming_the_refused_ones_too_and_a_hint_only_when_near(capsys):
    with pytest.raises(SystemExit):
        config_from_command_line(["--hiden-size", "64", "--frobnicate", "--fp8-format", "hybrid"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --hiden-size 64 --frobnicate (did you mean --hidden-size?); and --fp8-format " \
           "hybrid is a Megatron-LM flag hybrid does not take" in err
    from hybrid.config.cli import _unrecognized

    assert _unrecognized(["--qwerty-asdf 2"]) == "unrecognized arguments: --qwerty-asdf 2"  # nothing near
    with pytest.raises(ConfigError, match=r"^--moe-routr-topk 2 is a Megatron-LM flag hybrid does not take: a "
                                          r"Megatron-Core MoE flag .* \(did you mean --moe-router-topk\?\)$"):
        config_from_command_line(["--num-experts", "4", "--moe-routr-topk", "2"])  # a --moe-* flag: MoE's family


def test_the_trainer_checks_the_world_in_the_same_error(monkeypatch):
    from hybrid.training.cli import parse_args

    with pytest.raises(ConfigError) as raised:
        parse_args(SMALL + ["--mock-data", "--tensor-model-parallel-size", "3", "--fp8-format", "e4m3"],
                   world_size=4)
    assert str(raised.value).startswith("2 settings need changing: (1) --fp8-format e4m3 is a Megatron-LM flag")
    assert "world size 4 is not divisible by tensor_parallel_size x pipeline.size = 3 x 1" in str(raised.value)


def test_deepspeed_config_reads_a_deepspeed_json_under_the_flags(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text('{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},'
                  ' "prescale_gradients": true, "bf16": {"enabled": true}}')
    notes = []
    cfg = config_from_command_line(["--deepspeed", "--deepspeed_config", str(ds), "--zero-stage=1"], notes=notes)
    assert (cfg.zero.stage, cfg.precision, cfg.global_batch_size) == (1, "bf16", 8)  # the flag over the file
    assert any(n.startswith("DeepSpeed keys with no effect here: prescale_gradients (") for n in notes), notes
    assert config_from_command_line([f"--deepspeed_config={ds}"]).zero.stage == 2
    native = tmp_path / "native.yaml"
    native.write_text("zero: {stage: 1}\n")
    with pytest.raises(ConfigError, match=r"^--deepspeed-config .*native\.yaml: it is not a DeepSpeed config"):
        config_from_command_line(["--deepspeed-config", str(native)])


def test_a_bad_split_is_found_before_the_process_group(tmp_path):
    """--split is read where it divides data.path, in the trainer's start-up, beside the other problems."""
    import numpy as np

    from hybrid.data.indexed import write_dataset
    from hybrid.training.cli import parse_args

    write_dataset(tmp_path / "d", [np.arange(10)])
    with pytest.raises(ConfigError) as raised:
        parse_args(SMALL + ["--data-path", str(tmp_path / "d"), "--split", "'1,2,3,4'", "--fp8-param-gather"],
                   world_size=1)
    assert "--fp8-param-gather is a Megatron-LM flag" in str(raised.value)
    assert "'data.split': --split '1,2,3,4': expected up to three weights" in str(raised.value)


@pytest.mark.parametrize("strategy,stage", [("no_shard", 0), ("optim", 1), ("optim_grads", 2),
                                            ("optim_grads_params", 3)])
def test_megatron_fsdp_sharding_strategies_are_zero_stages(strategy, stage):
    notes = []
    cfg = config_from_command_line(["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy,
                                    "--use-distributed-optimizer", "--overlap-param-gather"] if stage == 3 else
                                   ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy],
                                   notes=notes)
    assert cfg.zero.stage == stage
    assert f"--data-parallel-sharding-strategy {strategy} (read as --zero-stage {stage})" in notes
    if stage == 3:  # Megatron-FSDP's prefetch is ZeRO-3's own; without --use-megatron-fsdp the rule still holds
        assert not cfg.zero.overlap_param_gather and any(n.startswith("--overlap-param-gather (") for n in notes)
        with pytest.raises(ConfigError, match=r"zero\.overlap_param_gather needs ZeRO stage"):
            config_from_command_line(["--zero-stage", "3", "--overlap-param-gather"])


def test_no_load_optim_and_no_load_rng_are_keys_of_their_own():
    """Megatron-LM's flags resume without the optimizer state or the generators (the engine's part:
    tests/training/test_no_load_state.py)."""
    cfg = config_from_command_line(["--no-load-optim", "--no-load-rng", "--load", "ckpt"])
    assert cfg.checkpoint.no_load_optim and cfg.checkpoint.no_load_rng


def test_key_problems_and_the_worlds_are_named_together():
    from hybrid.training.cli import parse_args

    with pytest.raises(ConfigError) as raised:
        parse_args(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                    "--vocab-size", "64", "--micro-batch-size", "1", "--mock-data", "--tensor-model-parallel-size",
                    "3"], world_size=4)
    message = str(raised.value)
    assert message.startswith("2 config keys need changing: (1) give the run's length") and \
        "(2) world size 4 is not divisible by tensor_parallel_size x pipeline.size = 3 x 1" in message


def test_megatrons_yarn_spellings_set_the_rope_keys():
    cfg = config_from_command_line(["--rope-scaling", "yarn", "--rotary-scaling-factor", "4",
                                    "--yarn-original-max-position-embeddings", "4096"])
    assert (cfg.model.rope_scaling, cfg.model.rope_scaling_factor, cfg.model.rope_original_max_positions) == \
        ("yarn", 4.0, 4096)
