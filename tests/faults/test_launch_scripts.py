"""Every launch script runs, on this CPU, at a tiny size: none can break unseen again.

Each script keeps its real defaults; the environment variables listed in its
header shrink it here (a one-layer model, one or two processes, two
iterations, random tokens). Each run is a first launch: ``--save`` and
``--load`` name a folder that does not exist yet, as on a fresh cluster.

The SLURM batch script runs too: ``srun`` and ``scontrol`` are replaced by
stand-ins on ``PATH`` (one task on this node, whose host name is 127.0.0.1),
so what is tested is everything the script itself does (the rendezvous
endpoint, the variables it exports, the per-node script it starts). Every
script also passes ``bash -n``.

The single-node scripts rendezvous on 127.0.0.1; ``setup_env.sh`` (which the
CPU demo sources) must find the environment complete and install nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid.checkpoint import CheckpointReader
from tests.multiproc import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "launch_scripts"
TINY_MODEL = "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --vocab-size 128"
SMALL = {"MOCK_DATA": "1", "MODEL_ARGS": TINY_MODEL, "TP": "1", "MICRO_BATCH": "1", "GLOBAL_BATCH": "1",
         "SEQ_LENGTH": "16", "TRAIN_ITERS": "2", "WARMUP_ITERS": "1", "SAVE_INTERVAL": "1", "EVAL_INTERVAL": "0",
         "LOG_INTERVAL": "1"}


def _env(tmp_path: Path, **extra) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           # torchrun and python of this test's environment
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "CHECKPOINT_DIR": str(tmp_path / "checkpoints"), "TENSORBOARD_DIR": str(tmp_path / "tensorboard"),
           "MASTER_PORT": str(free_port()), **extra}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR"):
        env.pop(name, None)
    return env


def _run(argv, env, timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _trained(proc: subprocess.CompletedProcess, checkpoints: Path, iterations: int = 2) -> None:
    assert f"iteration {iterations}/{iterations}" in proc.stdout, proc.stdout[-3000:]
    assert "no checkpoint there yet, starting from scratch" in proc.stdout  # the first launch of --load DIR
    reader = CheckpointReader(checkpoints)
    assert reader.iteration == iterations
    reader.verify_all()


@pytest.mark.parametrize("script", sorted(p.relative_to(ROOT).as_posix() for p in SCRIPTS.rglob("*")
                                          if p.suffix in (".sh", ".sbatch")))
def test_every_script_parses(script):
    subprocess.run(["bash", "-n", script], cwd=ROOT, check=True, timeout=30)


def test_single_node_scripts_rendezvous_on_loopback_only():
    for script in ("pretrain_gpt_tiny.sh", "pretrain_gpt2_1.5b.sh"):
        text = (SCRIPTS / script).read_text()
        assert "--standalone" not in text.replace("torchrun --standalone would", ""), script
        assert '--rdzv-endpoint "127.0.0.1:$MASTER_PORT"' in text, script


@pytest.mark.parametrize("stage", ["2", pytest.param("3", marks=pytest.mark.slow)])  # stage 3 slow: ~6 s more
def test_gpt2_1_5b_script(tmp_path, stage):
    # stage 3: the trainer's train_batch must run the model through its hooks (the tied head's weight, a unit of
    # its own under a persistence threshold of 100 elements, is read outside its module)
    extra = {"EXTRA_ARGS": "--zero-persistence-threshold 100"} if stage == "3" else {}
    env = _env(tmp_path, **SMALL, GPUS_PER_NODE="1", ZERO_STAGE=stage, **extra)
    proc = _run(["bash", str(SCRIPTS / "pretrain_gpt2_1.5b.sh")], env)
    _trained(proc, tmp_path / "checkpoints")


def test_turing_nlg_script_two_processes_in_a_pipeline(tmp_path):
    # TP inside the node is the tiny demo's; this script's own switch here is PP (two stages, 1F1B).
    env = _env(tmp_path, **{**SMALL, "PP": "2", "GLOBAL_BATCH": "2"}, GPUS_PER_NODE="2", NNODES="1",
               NODE_RANK="0", MASTER_ADDR="127.0.0.1", RDZV_ID="launch-test")
    proc = _run(["bash", str(SCRIPTS / "pretrain_turing_nlg_17b.sh")], env)
    assert "world=2 tp=1 dp=1 pp=2" in proc.stdout
    _trained(proc, tmp_path / "checkpoints")


def test_slurm_script_with_srun_and_scontrol_stand_ins(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\n# 'scontrol show hostnames LIST': this node\n"
                                      "echo 127.0.0.1\n")
    (bin_dir / "srun").write_text("#!/usr/bin/env bash\n# one task on this node: drop srun's options, run the rest\n"
                                  "while [[ \"${1:-}\" == -* ]]; do shift; done\n"
                                  "export SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0\nexec \"$@\"\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = _env(tmp_path, **SMALL, GPUS_PER_NODE="1", SLURM_JOB_NODELIST="localhost", SLURM_JOB_NUM_NODES="1",
               SLURM_JOB_ID="4242")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    proc = _run(["bash", str(SCRIPTS / "slurm" / "pretrain_turing_nlg_17b.sbatch")], env)
    _trained(proc, tmp_path / "checkpoints")


@pytest.mark.slow  # a second full run of the demo script; tests/training/test_launch.py keeps its main case
def test_tiny_demo_script_reuses_the_environment_and_trains_grouped_query_attention_in_a_pipeline(tmp_path):
    from hybrid.convert.hf import export_to_hf
    from hybrid.convert.reshard import reshard_checkpoint

    dist_info = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    installed = sorted(dist_info.glob("hybrid-*.dist-info"))
    before = [p.stat().st_mtime_ns for p in installed]
    env = _env(tmp_path, SETUP="1", WORK_DIR=str(tmp_path / "tiny"), MODEL="tiny-gqa", NPROC="2", TP="1", PP="2",
               ZERO_STAGE="1",
               TRAIN_ITERS="2", MICRO_BATCH="1", GLOBAL_BATCH="2", SEQ_LENGTH="32", VOCAB_SIZE="300",
               MAX_DOCUMENTS="200", EVAL_INTERVAL="0", LOG_INTERVAL="1", SAVE_INTERVAL="2", MAX_NEW_TOKENS="4")
    proc = _run(["bash", str(SCRIPTS / "pretrain_gpt_tiny.sh")], env)
    assert "iteration 2/2" in proc.stdout and "a sample from the trained model" in proc.stdout, proc.stdout[-3000:]
    assert "tp=1 dp=1 pp=2" in proc.stdout
    reader = CheckpointReader(tmp_path / "tiny" / "checkpoints")
    assert reader.iteration == 2 and reader.layout.pp == 2
    # to-hf reads the two-stage checkpoint exactly as its offline rewrite without stages
    reshard_checkpoint(tmp_path / "tiny" / "checkpoints", tmp_path / "flat", target_tp=1, pipeline={"size": 1})
    for src, out in ((tmp_path / "tiny" / "checkpoints", tmp_path / "hf_pp"), (tmp_path / "flat", tmp_path / "hf_flat")):
        export_to_hf(src, out)
    assert _safetensors(tmp_path / "hf_pp") == _safetensors(tmp_path / "hf_flat")
    # The demo's MODEL switch: a Llama-style model with 2 key/value groups for its 8 query heads.
    cfg = reader.model_config
    assert (cfg["num_heads"], cfg["num_query_groups"], cfg["rope_scaling"], cfg["norm"]) == (8, 2, "llama3", "rmsnorm")
    # setup_env.sh found everything in place: it reported the environment and reinstalled nothing.
    assert "hybrid 0.1.0 with torch" in proc.stdout
    assert [p.stat().st_mtime_ns for p in installed] == before and installed


def _safetensors(directory: Path) -> dict:
    from safetensors.numpy import load_file

    return {k: v.tobytes() for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
