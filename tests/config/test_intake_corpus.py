"""Real launch scripts and DeepSpeed configs, as their repositories have them, through hybrid's start-up.

The corpus (tests/fixtures/intake_corpus/, its README.md says how it was recorded):

* ``scripts/*.json``: the argument list each Megatron-LM or Megatron-DeepSpeed launch script builds in its
  default mode (run unmodified, the launcher a stub), its world size, and the DeepSpeed config it writes, if any;
  the data, tokenizer, checkpoint and log paths are placeholders this test fills with files of its own;
* ``deepspeed/*.json``: DeepSpeed configs as they are, each beside ``*.source.json`` (repo, commit, path, and
  for a template the values its script fills in).

Each script runs through the trainer's start-up (``parse_args`` with its world size: parsing and every rule,
no process group); each config through the DeepSpeed intake. Either is accepted, or refused with exactly the
features listed here, all of them in one error.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybrid.config import ConfigError, from_deepspeed
from hybrid.config.deepspeed import deepspeed_notes
from hybrid.training.cli import parse_args

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "fixtures" / "intake_corpus"
SCRIPTS = {p.stem: json.loads(p.read_text()) for p in sorted((CORPUS / "scripts").glob("*.json"))}
CONFIGS = sorted(p.stem for p in (CORPUS / "deepspeed").glob("*.json") if not p.name.endswith(".source.json"))

_FP8 = {"--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather"}
# script -> the features its first launch refuses (empty: accepted as it is)
EXPECTED_SCRIPTS = {
    "megatron_gpt3_175b": set(),  # its --step-batch-size-schedule: tests/config/test_step_batch_schedule.py
    "megatron_llama3_8b_fp8_mock": set(_FP8),  # its --grad-reduce-in-bf16 is noted: hybrid's bf16 reduce
    "megatron_llama3_8b_fp8_data": set(_FP8),
    "megatron_fsdp_llama3_8b_fp8_mock": set(_FP8),  # Megatron-FSDP itself is ZeRO stage 3
    "megatron_mixtral_8x7b": set(),  # its MoE flags are keys (docs/moe.md), at the 32 ranks its EP 8 x PP 4 needs
    # its MoE flags are keys or no-ops (--moe-permute-fusion...); gpt-oss's attention and MLP variants are not
    "megatron_gptoss_train": _FP8 | {
        "--export-force-local-attention", "--quick-geglu", "--glu-linear-offset",
        "--softmax-type", "--window-attn-skip-freq", "--activation-func-clamp-value", "--window-size",
        "--enable-gpt-oss", "--accumulate-allreduce-grads-in-fp32",
        "--disable-bf16-reduced-precision-matmul"},
    "megatron_detxoify_finetune_1.3b": {"--data-path2"},
    "mds_pretrain_llama": set(),
    "mds_pretrain_llama2": set(),
    "mds_rebase_gpt_125m": {"--log-optimizer-states-to-tensorboard"},
    "mds_moe_gpt_350m_dense": set(),  # its token-based schedule: test_the_token_counts_are_read_as_samples
    "mds_universal_ckpt_gpt_bf16": {"data_types.grad_accum_dtype"},
}
# config -> the DeepSpeed keys its intake refuses (empty: accepted)
EXPECTED_CONFIGS = {
    "dse_autotuning_fp16_z2": {"train_micro_batch_size_per_gpu"}, "dse_autotuning_z3": {"train_micro_batch_size_per_gpu"},
    "dse_bing_bert_lamb_seq128": {"sparse_attention"},
    "dse_bing_bert_onebitlamb_seq128": {"optimizer.type"},
    "dse_bing_bert_pld_seq128": {"progressive_layer_drop"},
    "dse_zenflow": {"zero_optimization.zenflow"},
    "mds_curriculum_baseline": {"optimizer.params.max_grad_norm"},
    "mds_offload_pp_template": {"zero_optimization.offload_optimizer.ratio"},
    "mds_universal_checkpointing": {"data_types.grad_accum_dtype"},
}


def refused_features(err: ConfigError) -> set:
    """What each problem of one error is about: the DeepSpeed key it names, else the flag it starts with, else
    its config key."""
    features = set()
    for problem in getattr(err, "problems", (err,)):
        text = str(problem)
        key = re.search(r"DeepSpeed (?:key|optimizer\.type) '?([\w.]+)", text)
        if key:
            features.add(key.group(1) if not text.count("optimizer.type") else "optimizer.type")
        elif text.startswith("--"):
            features.add(text.split()[0])
        else:
            features.add(problem.keys[0] if problem.keys else text)
    return features


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The files the placeholders name: a dataset, GPT-2 BPE, SentencePiece and Hugging Face tokenizers."""
    from hybrid.data.gpt2_bpe import train_gpt2_bpe
    from hybrid.data.indexed import write_dataset
    from tests.data.test_hf_tokenizer import make_model_folder
    from tests.data.testkit import synthetic_documents, train_tokenizer

    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    write_dataset(root / "data", [rng.integers(3, 250, size=80) for _ in range(400)])
    vocab, merge = train_gpt2_bpe(synthetic_documents(300, seed=5), root / "gpt2", vocab_size=700)
    (root / "load").mkdir()
    return {"data": str(root / "data"), "vocab": str(vocab), "merge": str(merge),
            "spm": train_tokenizer(root / "spm"), "hf": str(make_model_folder(root / "hf")),
            "save": str(root / "save"), "load": str(root / "load"), "tb": str(root / "tb"),
            "cache": str(root / "cache"), "root": root}


def script_argv(name: str, files: dict, **paths) -> list:
    """The script's arguments with the placeholders filled (and its DeepSpeed config written)."""
    record = SCRIPTS[name]
    ds_config = files["root"] / f"{name}.ds_config.json"
    if record["deepspeed_config"] is not None:
        ds_config.write_text(json.dumps(record["deepspeed_config"]))
    tokenizer = files["hf"] if "HFTOKENIZER" in record["positional"] else files["spm"]
    fill = {**{k: files[k] for k in ("data", "vocab", "merge", "save", "load", "tb", "cache")},
            "tokenizer": tokenizer, "ds_config": str(ds_config), **paths}
    return [arg.format(**fill) if "{" in arg else arg for arg in record["argv"]]


def test_the_corpus_covers_the_issues_set():
    assert set(SCRIPTS) == set(EXPECTED_SCRIPTS) and len(CONFIGS) >= 35
    for record in SCRIPTS.values():
        assert set(record["source"]) == {"repo", "commit", "path"} and record["world_size"] >= 1
    for name in CONFIGS:
        source = json.loads((CORPUS / "deepspeed" / f"{name}.source.json").read_text())
        assert re.fullmatch(r"[0-9a-f]{40}", source["commit"]) and source["path"].endswith(".json")


@pytest.mark.parametrize("name", sorted(EXPECTED_SCRIPTS))
def test_each_script_is_accepted_or_refused_with_every_feature_in_one_launch(name, files, capsys):
    argv, world = script_argv(name, files), SCRIPTS[name]["world_size"]
    expected = EXPECTED_SCRIPTS[name]
    if not expected:
        parse_args(argv, world_size=world)
        return
    with pytest.raises(ConfigError) as raised:
        parse_args(argv, world_size=world)
    message = str(raised.value)
    assert "\n" not in message and "unrecognized" not in message
    assert refused_features(raised.value) == expected, message
    for problem in getattr(raised.value, "problems", (raised.value,)):  # each with its reason
        assert re.search(r"(does not take|not supported[^:]*): \S", str(problem)), problem


def test_a_refused_script_lists_the_problems_of_its_values_too(files):
    """Beside the refused flags, a value no rule accepts (here the global batch 64 on 3 data-parallel ranks of
    micro-batches of 4) is in the same error."""
    argv = script_argv("megatron_detxoify_finetune_1.3b", files)
    with pytest.raises(ConfigError) as raised:
        parse_args(argv, world_size=3)
    assert refused_features(raised.value) == {"--data-path2", "micro_batch_size"}


def test_the_gpt3_script_takes_its_step_wise_batch(files):
    """Megatron-LM's GPT-3 175B script: its global batch grows from 16 to 1536 in steps of 2.4B tokens, each
    2.4e9 / 2048 = 1171875 samples, at TP 8 x PP 16 on its 16 nodes (one micro-batch a data-parallel rank)."""
    cfg = parse_args(script_argv("megatron_gpt3_175b", files), world_size=128)
    batch = cfg.resolve_batch(1)
    assert batch.steps == tuple((k * 1171875, n) for k, n in enumerate((16, 320, 624, 928, 1232, 1536)))
    assert batch.accumulations() == (16, 320, 624, 928, 1232, 1536)


def test_the_token_counts_are_read_as_samples(files, capsys):
    """Megatron-DeepSpeed's 350M dense MoE-example script gives its run and schedule in tokens at --seq-length
    2048 and global batch 256: it trains while fewer than 300B tokens are consumed, 300e9 / 2048 = 146484375
    samples, so 572205 steps (572204 x 256 = 146484224 fall short) of 146484480 samples, before its
    --train-samples 439453125 would end it; warmup 375e6 / 2048 = 183105.47 samples (to the nearest: 183105),
    decay 260e9 / 2048 = 126953125 samples exactly."""
    cfg = parse_args(script_argv("mds_moe_gpt_350m_dense", files), world_size=8)
    assert (cfg.run.train_samples, cfg.run.train_iters, cfg.run.train_tokens) == (146484480, None, None)
    sched = cfg.scheduler
    assert (sched.warmup_samples, sched.decay_samples, sched.warmup_tokens, sched.decay_tokens) == \
        (183105, 126953125, None, None)
    assert cfg.resolve_batch(8).schedule.steps_within(cfg.run.train_samples) == 572205
    text = capsys.readouterr().err
    assert "--lr-warmup-tokens 375000000 (read as --lr-warmup-samples 183105: tokens / --seq-length 2048, to the " \
           "nearest sample)" in text
    assert "--lr-decay-tokens 260000000000 (read as --lr-decay-samples 126953125: tokens / --seq-length 2048)" in text
    assert "--train-tokens 300000000000 (read as --train-samples 146484480: the run ends after 572205 steps" in text


def test_the_mixtral_script_trains_its_moe_as_megatron_core_would(files):
    """Megatron-LM's Mixtral 8x7B script: 8 experts, top-2, Switch balancing, its 8 expert-parallel ranks over the
    data-parallel ones of 32 (PP 4 x DP 8). On the single 8-GPU node its launcher defaults to, DP is 2 and EP 8
    cannot divide it: refused in one line naming the rule and the fix."""
    argv = script_argv("megatron_mixtral_8x7b", files)
    cfg = parse_args(argv, world_size=32)
    m = cfg.model
    assert (m.num_experts, m.moe_router_topk, m.moe_router_load_balancing_type, m.moe_aux_loss_coeff) == \
        (8, 2, "aux_loss", 1e-2)
    assert m.moe_grouped_gemm and m.moe_token_dispatcher_type == "alltoall" and cfg.expert_parallel_size == 8
    from hybrid.grid import Grid
    from hybrid.training.model import model_config

    gpt = model_config(cfg, vocab_size=32000)
    assert gpt.is_moe and gpt.moe_layer_pattern() == (True,) * 32  # --moe-layer-freq's default: every layer
    assert Grid.build(32, tp=1, pp=4, ep=8).dp == 8
    with pytest.raises(ConfigError) as raised:
        parse_args(argv, world_size=8)
    assert refused_features(raised.value) == {"--expert-model-parallel-size"}
    assert re.search(r"--expert-model-parallel-size 8 must divide the data-parallel ranks dp\*cp = 2\*1 = 2: .*choose "
                     r"a divisor of 2 \(world size 8 = tp 1 x pp 4 x dp 2\)", str(raised.value)), str(raised.value)


def _load_config(name: str) -> dict:
    text = (CORPUS / "deepspeed" / f"{name}.json").read_text()
    source = json.loads((CORPUS / "deepspeed" / f"{name}.source.json").read_text())
    for placeholder, value in sorted(source.get("fill", {}).items(), key=lambda kv: -len(kv[0])):
        text = text.replace(placeholder, value)
    return json.loads(text)


@pytest.mark.parametrize("name", CONFIGS)
def test_each_deepspeed_config_is_accepted_or_refused_naming_its_keys(name):
    data = _load_config(name)
    expected = EXPECTED_CONFIGS.get(name, set())
    if not expected:
        from_deepspeed(data)
        return
    with pytest.raises(ConfigError) as raised:
        from_deepspeed(data)
    assert refused_features(raised.value) == expected, str(raised.value)
    assert "unknown DeepSpeed key" not in str(raised.value)


def test_most_real_configs_are_accepted():
    accepted = [name for name in CONFIGS if name not in EXPECTED_CONFIGS]
    assert len(accepted) >= 27, accepted


# the configs that switch Adam's, AdamW's or OneBitAdam's bias correction off
_UNCORRECTED = ("ds_test_bingbertsquad_fp16", "ds_test_bingbertsquad_fp16_zero2", "ds_test_bingbertsquad_fp32",
                "dse_bingbertsquad_bsz24", "dse_bingbertsquad_onebitadam")


@pytest.mark.parametrize("name", _UNCORRECTED)
def test_bias_correction_false_is_read_as_the_optimizers_switch(name):
    optimizer = from_deepspeed(_load_config(name)).optimizer
    assert optimizer.bias_correction is False
    assert optimizer.type == ("onebit_adam" if "onebitadam" in name else "adamw")


def test_keys_that_change_nothing_are_named_in_one_note():
    notes = deepspeed_notes(_load_config("dse_imagenet_fp16_z1"))
    assert notes[0].startswith("DeepSpeed keys with no effect here: prescale_gradients (hybrid averages gradients")
    assert "zero_allow_untested_optimizer (" in notes[0] and "fp16.auto_cast (" in notes[0]
    assert notes[1].startswith("DeepSpeed keys DeepSpeed itself ignores, ignored: cuda_visible_devices (")
    cfg = from_deepspeed(_load_config("ds_test_gpt2_bs8_zero2_gas3"))
    assert cfg.recompute == "full"  # activation_checkpointing
    assert from_deepspeed(_load_config("ds_test_gpt2_bs4_zero2_offload")).zero.offload_optimizer == "cpu"
    # DeepSpeed's ZeRO-3 example: a consolidated 16-bit model with each save; its optimizer sub-groups noted
    sdma = _load_config("ds_example_sdma_zero3")
    assert from_deepspeed(sdma).checkpoint.save_16bit_model is True
    assert "zero_optimization.sub_group_size (DeepSpeed's ZeRO-3 steps the optimizer over sub-groups" in \
        deepspeed_notes(sdma)[0]


# ---- a shrunk script trains ------------------------------------------------------------------------------

# A script shrunk: its model, batch and run lengths small, each flag it gives replaced (one it does not give is
# not added). Megatron-DeepSpeed's pretrain_llama2_distributed.sh with these trains at TP 2 x PP 2 on 4
# processes, as the script lays them out (its DeepSpeed config read through --deepspeed_config).
SHRUNK = {"--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "172", "--num-attention-heads": "4",
          "--num-key-value-heads": "2", "--num-query-groups": "2", "--kv-channels": "16", "--seq-length": "32",
          "--max-position-embeddings": "32", "--vocab-size": "256", "--micro-batch-size": "1",
          "--global-batch-size": "4", "--train-iters": "3", "--lr-warmup-iters": "1", "--lr-decay-iters": "3",
          "--train-samples": "12", "--lr-warmup-samples": "4", "--lr-decay-samples": "12", "--eval-interval": "2",
          "--eval-iters": "1", "--log-interval": "1"}
# The DeepSpeed config's batch keys, shrunk as their flags are.
SHRUNK_DS = {"train_batch_size": "--global-batch-size", "train_micro_batch_size_per_gpu": "--micro-batch-size"}


def _shrunk(argv: list, **sizes) -> list:
    """``argv`` with the value of each flag of SHRUNK (and ``sizes``: ``tensor_model_parallel_size="2"`` for
    ``--tensor-model-parallel-size 2``) it gives replaced."""
    out = list(argv)
    for flag, value in {**SHRUNK, **{"--" + k.replace("_", "-"): v for k, v in sizes.items()}}.items():
        if flag in out:
            out[out.index(flag) + 1] = value
    return out


def _train_shrunk(argv: list, processes: int, iterations: int = 3) -> subprocess.CompletedProcess:
    """Run ``hybrid.train`` with ``argv`` on ``processes`` CPU processes; it must log ``iterations`` iterations,
    each with a finite loss."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(processes), "-m", "hybrid.train", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    # the launcher's report of the failed processes ends stderr: their own errors are the lines with 'error:'
    errors = sorted({line for line in proc.stderr.splitlines() if "error:" in line})
    assert proc.returncode == 0, "\n".join([proc.stdout[-3000:], *errors] or [proc.stderr[-3000:]])
    logged = [line for line in proc.stdout.splitlines() if line.startswith("iteration")]
    assert len(logged) == iterations, proc.stdout
    for line in logged:
        loss = re.search(r"lm loss:? ([-+0-9.eE]+|nan|inf)", line)
        assert loss and np.isfinite(float(loss.group(1))), line
    return proc


@pytest.mark.slow
def test_the_shrunk_megatron_deepspeed_llama2_script_trains_on_4_processes(files, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    proc = _train_shrunk(_shrunk(script_argv("mds_pretrain_llama2", files, save=ckpt, load=ckpt)), 4)
    assert "tp=2 dp=1 pp=2" in proc.stdout
    notes = [line for line in proc.stderr.splitlines() if "note:" in line]
    assert len(notes) == 1 and "--deepspeed (" in notes[0] and "--num-key-value-heads 2 (read as" in notes[0]


def test_the_shrunk_script_at_one_pipeline_stage_trains_on_2_processes(files, tmp_path):
    """The same script with its pipeline size set to 1 as well, to fit the suite's two processes (TP 2)."""
    ckpt = str(tmp_path / "ckpt")
    argv = _shrunk(script_argv("mds_pretrain_llama2", files, save=ckpt, load=ckpt),
                   pipeline_model_parallel_size="1")
    proc = _train_shrunk(argv, 2)
    assert "tp=2 dp=1 pp=1" in proc.stdout and "bf16" in proc.stdout  # bf16 from its DeepSpeed config


# The fp8 Llama 3 8B scripts' only refusals (EXPECTED_SCRIPTS): the shrunk runs leave them out, with their values.
_FP8_VALUES = {"--fp8-format": 1, "--fp8-amax-history-len": 1, "--fp8-amax-compute-algo": 1, "--fp8-param-gather": 0}
# script -> processes, the layout it trains at, the sizes beside SHRUNK. Each axis the script uses above 1 stays
# above 1 (EP within DP for Mixtral); a script at TP 1 x PP 1 trains data-parallel on 2 processes.
SHRUNK_RUNS = {
    # TP 8 x PP 16 -> TP 2 x PP 2; its step-wise batch 16 to 1536 over 12B tokens -> 1, 2, 3 over 96 tokens (3
    # samples of 32): the 3 iterations take 1, 2 and 3 samples; its decay 430000 -> 1000 iterations, so that its
    # --lr-warmup-fraction .001 is one warmup step (hybrid refuses a fraction that rounds to none)
    "megatron_gpt3_175b": (4, "tp=2 dp=1 pp=2", dict(tensor_model_parallel_size="2", pipeline_model_parallel_size="2",
                                                     global_batch_size="3", lr_decay_iters="1000")),
    # PP 4 x EP 8 over DP 8 -> PP 2 x EP 2 over DP 2; 8 experts top-2 kept
    "megatron_mixtral_8x7b": (4, "tp=1 dp=2 pp=2", dict(pipeline_model_parallel_size="2",
                                                        expert_model_parallel_size="2")),
    "megatron_llama3_8b_fp8_mock": (2, "tp=1 dp=2 pp=1", {}),
    # its --vocab-size at least the test tokenizer's 600 tokens
    "megatron_llama3_8b_fp8_data": (2, "tp=1 dp=2 pp=1", dict(vocab_size="640")),
    "megatron_fsdp_llama3_8b_fp8_mock": (2, "tp=1 dp=2 pp=1", {}),
    "mds_pretrain_llama": (4, "tp=2 dp=1 pp=2", {}),
    # its run and schedule in tokens at --seq-length 32: 3 iterations of 4 samples, warmup 1 sample, decay 12
    "mds_moe_gpt_350m_dense": (2, "tp=1 dp=2 pp=1", dict(train_tokens=str(3 * 4 * 32), train_samples="16",
                                                          lr_warmup_tokens="32", lr_decay_tokens=str(12 * 32))),
}
# script -> the documents its dataset needs: the Mixtral script's --split 99990,8,2 gives its valid split 8/100000
# of them, at least one document of seq_length + 1 tokens for its evaluation
SHRUNK_DOCUMENTS = {"megatron_mixtral_8x7b": 25000}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHRUNK_RUNS))
def test_each_accepted_script_shrunk_trains(name, files, tmp_path):
    """Each accepted Megatron-LM HEAD script, the fp8 Llama 3 8B ones without their fp8 flags (their only
    refusals), and the accepted Megatron-DeepSpeed ones, with their model and batch sizes shrunk (SHRUNK and
    SHRUNK_RUNS: nothing else of the script changes but the run's length and log interval), train on 2-4 CPU
    processes: every iteration logged with a finite loss, at the layout printed."""
    processes, layout, sizes = SHRUNK_RUNS[name]
    ckpt = str(tmp_path / "ckpt")
    data = {}
    if name in SHRUNK_DOCUMENTS:
        from hybrid.data.indexed import write_dataset

        rng = np.random.default_rng(1)
        write_dataset(tmp_path / "data", [rng.integers(3, 250, size=40) for _ in range(SHRUNK_DOCUMENTS[name])])
        data = {"data": str(tmp_path / "data")}
    argv = script_argv(name, files, save=ckpt, load=ckpt, **data)
    for flag, takes_value in _FP8_VALUES.items():
        if flag in argv:
            del argv[argv.index(flag):argv.index(flag) + 1 + takes_value]
    if name == "megatron_gpt3_175b":
        at = argv.index("--step-batch-size-schedule") + 1
        argv[at:at + 6] = ["0:1", "32:2", "96:3"]
    argv = _shrunk(argv, **sizes)
    config = SCRIPTS[name]["deepspeed_config"]
    if config is not None:  # its DeepSpeed config's batch sizes shrunk as the flags are
        shrunk = {key: int(argv[argv.index(flag) + 1]) for key, flag in SHRUNK_DS.items()}
        (files["root"] / f"{name}.ds_config.json").write_text(json.dumps({**config, **shrunk}))
    proc = _train_shrunk(argv, processes)
    assert layout in proc.stdout, proc.stdout[-2000:]
    if name == "megatron_gpt3_175b":  # the step-wise batch grew
        assert re.findall(r"global batch size: (\d+)", proc.stdout) == ["1", "2", "3"], proc.stdout[-2000:]


# The keys DeepSpeed's own ZeRO and offload configs define (deepspeed/runtime/zero/config.py and offload_config.py
# at deepspeedai/DeepSpeed edaa722: field names and their aliases), and top-level keys its runtime config reads.
DEEPSPEED_ZERO_KEYS = (
    "allgather_bucket_size allgather_partitions allgather_sequential contiguous_gradients cpu_offload "
    "cpu_offload_param cpu_offload_use_pin_memory elastic_checkpoint enable_sanity_checks "
    "gather_16bit_weights_on_model_save ignore_unused_parameters leaf_module legacy_stage1 load_from_fp32_weights "
    "log_trace_cache_warnings max_live_parameters max_reuse_distance memory_efficient_linear "
    "mics_hierarchical_params_gather mics_shard_size model_persistence_threshold module_granularity_threshold "
    "offload_optimizer offload_param overlap_comm override_module_apply param_persistence_threshold "
    "pipeline_loading_checkpoint prefetch_bucket_size reduce_bucket_size reduce_scatter round_robin_gradients "
    "save_muon_momentum_buffer_in_memory stage stage3_allgather_sequential stage3_gather_16bit_weights_on_model_save "
    "stage3_gather_fp16_weights_on_model_save stage3_max_live_parameters stage3_max_reuse_distance "
    "stage3_model_persistence_threshold stage3_module_granularity_threshold stage3_param_persistence_threshold "
    "stage3_prefetch_bucket_size stage3_use_all_reduce_for_fetch_params sub_group_size "
    "use_all_reduce_for_fetch_params use_multi_rank_bucket_allreduce zenflow zero_hpz_partition_size "
    "zero_quantized_gradients zero_quantized_nontrainable_weights zero_quantized_weights zeropp_loco_param").split()
DEEPSPEED_OFFLOAD_KEYS = ("buffer_count buffer_size cpuadam_cores_perc device fast_init max_in_cpu nvme_path "
                          "pin_memory pipeline_read pipeline_write ratio super_offload").split()
DEEPSPEED_TOP_KEYS = ("gradient_allreduce_op log_level managed_gradient_accumulation "
                      "use_data_before_expert_parallelism cuda_visible_devices disable_allgather").split()


@pytest.mark.parametrize("section,keys", [("zero_optimization", DEEPSPEED_ZERO_KEYS),
                                          ("zero_optimization.offload_optimizer", DEEPSPEED_OFFLOAD_KEYS),
                                          ("", DEEPSPEED_TOP_KEYS)])
def test_no_key_deepspeed_defines_is_called_unknown(section, keys):
    for key in keys:
        data = {key: 7}  # a value of the wrong type for most: what matters is how the key is named
        if section == "zero_optimization":
            data = {"zero_optimization": data}
        elif section:
            data = {"zero_optimization": {"stage": 1, "offload_optimizer": data}}
        try:
            from_deepspeed(data)
        except ConfigError as err:
            assert "unknown DeepSpeed key" not in str(err), (key, str(err))
