"""Cluster flags, layout enumeration and ranking, and the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybrid.layout import LayoutError, ParallelLayout, ZeroStage
from hybrid.plan.candidate import Candidate
from hybrid.plan.cli import build_parser, main
from hybrid.plan.cluster import Cluster, ClusterError, parse_size
from hybrid.plan.layouts import Choices, enumerate_layouts, plan
from hybrid.plan.setup import TrainingSetup
from model_zoo import get_preset

TNLG = ["--model", "turing-nlg-17b", "--gpus", "256", "--gpus-per-node", "16", "--gpu-memory", "32GiB",
        "--seq-length", "1024", "--global-batch-size", "512"]


def test_sizes_read_both_unit_systems():
    assert parse_size("32GiB") == 32 * 2**30
    assert parse_size("80 GB") == 80 * 10**9
    assert parse_size("1.5TiB") == int(1.5 * 2**40)
    assert parse_size("4096") == 4096
    with pytest.raises(ClusterError, match="--gpu-memory.*32GiB"):
        parse_size("32 gigs", "--gpu-memory")


def test_cluster_flags_are_checked():
    with pytest.raises(ClusterError, match="--gpus-per-node 16"):
        Cluster(gpus=24, gpus_per_node=16, gpu_memory=32 * 2**30)
    with pytest.raises(ClusterError, match="--mfu"):
        Cluster(gpus=16, gpus_per_node=16, gpu_memory=32 * 2**30, mfu=1.5)
    assert Cluster(gpus=4, gpus_per_node=16, gpu_memory=2**34).node_size == 4


def test_enumeration_rules():
    config = get_preset("turing-nlg-17b")  # 28 heads
    cluster = Cluster(gpus=256, gpus_per_node=16, gpu_memory=32 * 2**30)
    layouts = enumerate_layouts(config, cluster, 512)
    assert {lay.tp for lay in layouts} == {1, 2, 4}  # divide 16 and 28
    assert all(lay.tp * lay.dp == 256 for lay in layouts)
    assert all((512 // lay.dp) % lay.micro_batch == 0 for lay in layouts)
    assert not [lay for lay in layouts if lay.offload == "cpu" and not lay.traits.allows_offload]
    assert {lay.offload for lay in layouts} == {"none", "cpu"}
    assert {lay.recompute for lay in layouts} == {"none", "selective", "full"}
    assert {lay.zero_stage for lay in layouts} == set(ZeroStage)
    assert {lay.precision for lay in layouts} == {"bf16"}
    with pytest.raises(LayoutError, match="valid sizes here are"):
        enumerate_layouts(config, cluster, 512, Choices(tp=[3]))
    with pytest.raises(LayoutError, match="global-batch-size 100"):
        enumerate_layouts(config, cluster, 100)



@pytest.mark.parametrize("field, value", [("pp", [0]), ("tp", [2, -1]), ("micro_batches", [0]),
                                          ("virtual_stages", [1.5]), ("max_micro_batch", 0)])
def test_choices_built_in_code_refuse_sizes_below_one(field, value):
    # the command line's flags refuse these themselves; in code, pp=[0] used to end in a ZeroDivisionError
    with pytest.raises(LayoutError, match=f"Choices.{field} must hold positive integers"):
        Choices(**{field: value})

def test_ranking_puts_fitting_then_faster_layouts_first():
    config = get_preset("gpt2-xl")
    cluster = Cluster(gpus=16, gpus_per_node=8, gpu_memory=16 * 2**30)
    ranked = plan(config, cluster, 64, TrainingSetup())
    fits = [e.fits and e.host_fits for e in ranked]
    assert fits[0] and not fits[-1]
    assert fits == sorted(fits, reverse=True)
    fitting = [e for e in ranked if e.fits]
    assert [e.time.total for e in fitting] == sorted(e.time.total for e in fitting)
    assert all(e.memory.total <= cluster.usable_memory for e in fitting)
    # Stage 0 keeps 16 bytes per parameter (1.56B x 16 > 16 GiB): it never fits without TP.
    assert not [e for e in fitting if e.candidate.zero_stage == ZeroStage.DISABLED and e.candidate.tp == 1]


def test_a_candidate_is_a_validated_parallel_layout():
    """Sizes, stage and precision are checked by ParallelLayout, offload by the one rule of hybrid.layout."""
    candidate = Candidate(ParallelLayout(tp=4, dp=64, zero_stage=2, precision="bf16"), offload="cpu",
                          recompute="full", micro_batch=2, sequence_parallel=True)
    assert candidate.traits.gradients and not candidate.traits.parameters
    assert candidate.describe() == "tp=4+sp dp=64 zero=2 offload=cpu recompute=full micro=2"
    with pytest.raises(LayoutError, match="offload to cpu needs ZeRO stage"):
        Candidate(ParallelLayout(tp=1, dp=8), offload="cpu")
    with pytest.raises(LayoutError, match="zero_stage"):
        Candidate(ParallelLayout(tp=1, dp=8, zero_stage=4))
    with pytest.raises(LayoutError, match="use stage 0, 1 or 2 with pipeline parallelism"):
        Candidate(ParallelLayout(tp=1, dp=8, pp=2, zero_stage=3))
    with pytest.raises(LayoutError, match="pipeline schedule must be one of"):
        Candidate(ParallelLayout(tp=1, dp=8, pp=2), pipeline_schedule="zigzag")
    with pytest.raises(LayoutError, match="need a pipeline"):
        Candidate(ParallelLayout(tp=1, dp=8, pp=2), virtual_stages=2)
    assert (Candidate(ParallelLayout(tp=2, dp=8, pp=4), pipeline_schedule="interleaved", virtual_stages=2)
            .describe() == "tp=2 dp=8 pp=4 interleaved v=2 zero=0 offload=none recompute=none micro=1")
    with pytest.raises(LayoutError, match="recompute"):
        Candidate(ParallelLayout(tp=1, dp=8), recompute="some")
    with pytest.raises(LayoutError, match="micro_batch"):
        Candidate(ParallelLayout(tp=1, dp=8), micro_batch=0)


def test_zero_knob_defaults_are_the_configs():
    from hybrid.config import ZeroConfig

    setup, zero = TrainingSetup(), ZeroConfig()
    assert (setup.bucket_size, setup.stage3_persistence_threshold, setup.stage3_live_parameters,
            setup.stage3_prefetch) == (zero.bucket_size, zero.persistence_threshold, zero.max_live_parameters,
                                       zero.prefetch_bucket_size)


def test_turing_nlg_table_on_256_v100s(capsys):
    assert main(TNLG + ["--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "17.18B parameters" in out and "256 GPUs (16 node(s) of 16)" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:2].strip().isdigit() and "yes" in line]
    assert len(rows) == 5
    assert "layouts fit; best:" in out


def test_json_output_and_config_file(tmp_path, capsys):
    path = tmp_path / "model.yaml"
    path.write_text("vocab_size: 32000\nhidden_size: 1024\nnum_layers: 8\nnum_heads: 16\nseq_length: 512\n")
    assert main(["--config", str(path), "--gpus", "8", "--gpus-per-node", "8", "--gpu-memory", "24GiB",
                 "--global-batch-size", "64", "--zero-stage", "2", "--recompute", "full", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(r["zero_stage"] == 2 and r["recompute"] == "full" for r in rows)
    assert rows[0]["fits"] and rows[0]["bytes"]["total"] <= 23 * 2**30
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hidden_size": 64, "num_layer": 2}))
    with pytest.raises(SystemExit, match="num_layer"):
        main(["--config", str(bad), "--gpus", "8", "--gpus-per-node", "8", "--gpu-memory", "24GiB",
              "--global-batch-size", "64"])


def test_bad_flags_exit_with_a_message(capsys):
    assert main(TNLG[:-2] + ["--global-batch-size", "512", "--gpu-memory", "32 gigs"]) == 2
    assert "--gpu-memory" in capsys.readouterr().err
    assert main(TNLG + ["--tp", "3"]) == 2
    assert "tensor-parallel" in capsys.readouterr().err


SMALL = ["--model", "gpt2-small", "--gpus", "8", "--gpus-per-node", "8", "--gpu-memory", "80GiB",
         "--global-batch-size", "64"]


@pytest.mark.parametrize("flags, message", [
    (["--pp", "0"], "--pp 0: must be an integer >= 1; give --pp 1 or more"),
    (["--pp", "1", "2", "-4"], "--pp -4: must be an integer >= 1"),
    (["--micro-batch", "0"], "--micro-batch 0: must be an integer >= 1"),
    (["--max-micro-batch", "0"], "--max-micro-batch 0: must be an integer >= 1"),
    (["--tp", "0"], "--tp 0: must be an integer >= 1"),
    (["--virtual-stages", "0"], "--virtual-stages 0: must be an integer >= 1"),
    (["--seq-length", "0"], "--seq-length 0: must be an integer >= 1"),
    (["--top", "0"], "--top 0: must be an integer >= 1"),
    (["--top=-1"], "--top -1: must be an integer >= 1"),
    (["--bucket-size", "0"], "--bucket-size 0: must be an integer >= 1 (as config key zero.bucket_size)"),
    (["--stage3-live-parameters=-1"], "--stage3-live-parameters -1: must be an integer >= 1 (as config key "
                                      "zero.max_live_parameters)"),
    (["--stage3-prefetch=-1"], "--stage3-prefetch -1: must be an integer >= 0"),
    (["--stage3-reuse=-1"], "--stage3-reuse -1: must be an integer >= 0"),
    (["--stage3-persistence-threshold=-1"], "--stage3-persistence-threshold -1: must be an integer >= 0"),
    (["--async-save-chunk-mb", "0"], "--async-save-chunk-mb 0: must be an integer >= 1 (as config key "
                                     "checkpoint.async_save_chunk_mb)"),
    (["--zero-quantization-block", "0"], "--zero-quantization-block 0: must be an integer >= 8"),
    (["--zero-hpz-partition-size", "0"], "--zero-hpz-partition-size 0: must be an integer >= 1"),
])
def test_integer_flags_below_their_minimum_exit_with_one_line(flags, message, capsys):
    assert main(SMALL + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_integer_flag_minimums_are_the_training_configs():
    """The flags that set a config key refuse what the config refuses, read from its field."""
    from hybrid.plan.setup import checkpoint_field, zero_field

    for flag, field in (("--async-save-chunk-mb", checkpoint_field("async_save_chunk_mb")),
                        ("--bucket-size", zero_field("bucket_size")),
                        ("--stage3-prefetch", zero_field("prefetch_bucket_size"))):
        action = next(a for a in build_parser()._actions if flag in a.option_strings)
        assert action.minimum == field.metadata["ge"]


def test_zero_means_off_for_the_stage3_window_flags(capsys):
    assert main(SMALL + ["--zero-stage", "3", "--stage3-prefetch", "0", "--stage3-reuse", "0",
                         "--stage3-persistence-threshold", "0", "--top", "1"]) == 0
    assert "layouts fit" in capsys.readouterr().out


def test_help_says_achieved_tflops_wins_over_peak_and_mfu():
    helps = {a.option_strings[0]: a.help for a in build_parser()._actions if a.option_strings}
    assert "not used when --achieved-tflops is given" in helps["--mfu"]
    assert "not used when --achieved-tflops is given" in helps["--peak-tflops"]


def test_config_file_of_random_bytes_names_the_file(tmp_path):
    path = tmp_path / "noise.yaml"
    path.write_bytes(bytes(range(128, 256)) * 4)
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(path)] + SMALL[2:])
    message = str(exit_.value.code)
    assert message.startswith("--config") and str(path) in message and "\n" not in message, message


def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "hybrid.plan", *TNLG, "--top", "3"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "layouts fit" in out.stdout
