"""The launch paths end to end: the tiny demo script, SIGTERM during training, and a two-node torchrun."""

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybrid.checkpoint import CheckpointReader
from tests.multiproc import free_port

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "512", "--mock-data", "--micro-batch-size", "1", "--lr", "1e-3", "--eval-interval", "0"]


def _env(**extra):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
    env.pop("WORLD_SIZE", None)
    return env


def _torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *args]


# A variant of the main job kept short: 8 iterations on a small corpus, evaluated, saved and sampled at the end.
SHORT_DEMO = dict(TRAIN_ITERS="8", EVAL_INTERVAL="8", SAVE_INTERVAL="8", LOG_INTERVAL="4", MAX_DOCUMENTS="1500",
                  SEQ_LENGTH="64", MAX_NEW_TOKENS="8")


def _demo(work: Path, timeout: float = 600, **env) -> str:
    """Run launch_scripts/pretrain_gpt_tiny.sh in ``work`` with ``env``; its stdout, once it exited 0."""
    proc = subprocess.run(["bash", str(REPO / "launch_scripts/pretrain_gpt_tiny.sh")], cwd=REPO, text=True,
                          capture_output=True, timeout=timeout, env=_env(SETUP="0", WORK_DIR=str(work), **env))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _validation_losses(out: str):
    return [float(line.split("lm loss:")[1].split("|")[0]) for line in out.splitlines()
            if line.startswith("validation at iteration")]


def _assert_compiled(out: str, work: Path):
    """The main job compiled: each transformer block compiled (--torch-compile) on TP=2 x DP=2, the compile
    reported once, inductor's cache kept under the checkpoint folder (its 4 ranks share it: docs/compile.md,
    "Compile cost")."""
    reports = [line for line in out.splitlines() if line.startswith("torch.compile: ")]
    assert len(reports) == 1 and reports[0].startswith("torch.compile: 4 transformer blocks as one compiled "
                                                       "function (inductor): "), reports
    assert any((work / "checkpoints" / "compile-cache").iterdir())


def test_tiny_demo_end_to_end(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hybrid.monitor import TEST_TAGS, TRAIN_TAGS, VALID_TAGS

    work = tmp_path / "tiny"
    out = _demo(work, TRAIN_ITERS="24", EVAL_INTERVAL="8", SAVE_INTERVAL="12", LOG_INTERVAL="4", MAX_DOCUMENTS="3000",
                SEQ_LENGTH="64")
    assert "tensorboard --logdir" in out and "a sample from the trained model" in out
    # Validation loss clearly falls: from about ln(vocab) = 8.3 at initialisation to well below it at every
    # evaluation, and on from the first evaluation. (Not monotone: this corpus has batches whose gradient
    # norm spikes 50-100x at any layout, one process included, and 24 steps leave no time to recover.)
    valid = _validation_losses(out)
    assert len(valid) == 3 and max(valid) < math.log(4096) - 0.8 and min(valid[1:]) < valid[0], valid
    # The test split (the demo's --split 90,5,5), once, at the end
    test = [line for line in out.splitlines() if line.startswith("test at iteration")]
    assert len(test) == 1 and test[0].startswith("test at iteration 24 |"), test
    # Every TensorBoard tag is there with finite values.
    (event_dir,) = {p.parent for p in (work / "tensorboard").rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(event_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    for tag in list(TRAIN_TAGS) + list(VALID_TAGS) + list(TEST_TAGS):
        assert tag in scalars, f"{tag} missing from {sorted(scalars)}"
        assert all(math.isfinite(e.value) for e in acc.Scalars(tag)), tag
    assert [e.step for e in acc.Scalars("train/lm_loss")] == [4, 8, 12, 16, 20, 24]
    assert acc.Tags()["tensors"], "hyperparameters text is missing"
    reader = CheckpointReader(work / "checkpoints")
    assert reader.iteration == 24
    reader.verify_all()
    # --log-params-norm: the last line's norm is that of the weights the checkpoint holds, consolidated. The
    # fp32 sum of n positive squares is within gamma(n) of exact in any order (tests/numerics.py), so the norm
    # within gamma(n) / 2 relative; the line rounds it to 3 decimals. That still tells a wiring mistake apart:
    # one TP shard's norm alone is ~1/sqrt(2) of the whole, a double count ~sqrt(2).
    from safetensors.torch import load_file

    from hybrid.convert.fp32 import export_fp32
    from tests.numerics import gamma

    weights = load_file(str(export_fp32(work / "checkpoints", tmp_path / "w.safetensors")))
    whole = math.sqrt(sum(float(t.double().square().sum()) for t in weights.values()))
    last = [line for line in out.splitlines() if line.startswith("iteration") and "/24" in line][-1]
    printed = float(last.split("params norm:")[1].split("|")[0])
    n = sum(t.numel() for t in weights.values())
    assert abs(printed - whole) <= 5e-4 + gamma(n) / 2 * whole, (printed, whole)
    # --log-num-zeros-in-grad: the line's count is the TensorBoard point of the same step
    zeros = int(last.split("num zeros:")[1].split("|")[0])
    assert {e.step: e.value for e in acc.Scalars("train/num_zeros")}[24] == zeros


def test_tiny_demo_trains_compiled(tmp_path):
    """The main job compiled (issue 51): COMPILE=1, the short variant (the compile is most of its time)."""
    work = tmp_path / "compiled"
    out = _demo(work, timeout=900, COMPILE="1", **SHORT_DEMO)
    _assert_compiled(out, work)
    valid = _validation_losses(out)
    assert valid and valid[-1] < math.log(4096) - 0.3, valid  # learning: well below the untrained ln(vocab)
    reader = CheckpointReader(work / "checkpoints")
    assert reader.iteration == 8
    reader.verify_all()
    assert "a sample from the trained model" in out


def test_tiny_moe_demo_trains_expert_parallel(tmp_path):
    """The main job's MoE variant (issue 49): MODEL=tiny-moe trains with its experts over 2 expert-parallel ranks
    (TP=2 x DP=2, EP=2, sequence parallelism) on 4 processes, reports its routing, saves a checkpoint holding every
    expert, and the sample at the end is generated from it."""
    work = tmp_path / "moe"
    out = _demo(work, MODEL="tiny-moe", **SHORT_DEMO)
    assert "tp=2 dp=2 pp=1 ep=2" in out
    trained = [line for line in out.splitlines() if line.startswith("iteration") and "/8 |" in line]
    assert len(trained) == 2 and all("moe load max/mean:" in line and "moe aux loss:" in line for line in trained)
    valid = _validation_losses(out)
    assert valid and valid[-1] < math.log(4096) - 0.3, valid  # learning: well below the untrained ln(vocab)
    reader = CheckpointReader(work / "checkpoints")
    assert reader.iteration == 8 and reader.layout.ep == 2
    reader.verify_all()
    assert "a sample from the trained model" in out


def test_tiny_cp_demo_trains_context_parallel_with_document_masking(tmp_path):
    """The main job's long-context variant (issue 50): CP=2 splits each sequence over 2 context-parallel ranks
    (TP=2 x CP=2 on 4 processes, ring attention) with attention kept inside each packed document
    (--reset-attention-mask), learns, saves a checkpoint (that of its dp x cp = 2 data ranks: docs/checkpoints.md)
    and the sample at the end is generated from it."""
    from hybrid.config import saved_setting

    work = tmp_path / "cp"
    out = _demo(work, CP="2", **SHORT_DEMO)
    assert "world=4 tp=2 dp=1 pp=1 cp=2" in out
    valid = _validation_losses(out)
    assert valid and valid[-1] < math.log(4096) - 0.3, valid  # learning: well below the untrained ln(vocab)
    reader = CheckpointReader(work / "checkpoints")
    assert reader.iteration == 8 and (reader.layout.tp, reader.layout.dp) == (2, 2)
    reader.verify_all()
    args = reader.trainer_state["client"]["args"]
    assert saved_setting(args, "context_parallel_size") == 2 and saved_setting(args, "data.reset_attention_mask")
    assert "a sample from the trained model" in out


def test_sigterm_saves_a_loadable_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    cmd = _torchrun("--standalone", "--nproc-per-node", "2", "-m", "hybrid.train", *SMALL,
                    "--tensor-model-parallel-size", "2", "--train-iters", "100000", "--log-interval", "1",
                    "--save", str(save))
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines = []
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("iteration") and "/100000" in line and int(line.split("/")[0].split()[-1]) >= 3:
                break
            assert time.monotonic() < deadline, "".join(lines[-30:])
        # SLURM and torchrun signal every process of the job.
        os.killpg(proc.pid, signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = "".join(lines) + rest
    assert "exiting at iteration" in log and "received a termination signal" in log, log[-3000:]
    reader = CheckpointReader(save)
    assert 3 <= reader.iteration < 100000
    reader.verify_all()
    # And the same command resumes from it (here for one more iteration).
    resumed = subprocess.run(_torchrun("--standalone", "--nproc-per-node", "2", "-m", "hybrid.train", *SMALL,
                                       "--tensor-model-parallel-size", "2", "--train-iters", "100000",
                                       "--exit-interval", str(reader.iteration + 1), "--log-interval", "1",
                                       "--load", str(save)),
                             cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"loaded {reader.path}" in resumed.stdout
    assert f"exiting at iteration {reader.iteration + 1}: reached --exit-interval" in resumed.stdout


@pytest.mark.slow  # the default run keeps tests/test_emulated_cluster.py's two-node training
def test_two_node_rendezvous_on_one_machine(tmp_path):
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hybrid-test", "-m", "hybrid.train", *SMALL,
              "--tensor-model-parallel-size", "2", "--zero-stage", "1", "--train-iters", "3", "--log-interval", "1",
              "--save", str(tmp_path / "ckpt")]
    agents = [subprocess.Popen(_torchrun("--node-rank", str(n), *common), cwd=REPO, env=_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    outs = [a.communicate(timeout=240)[0] for a in agents]
    for a, out in zip(agents, outs):
        assert a.returncode == 0, out[-3000:]
    log = "".join(outs)
    assert "world=4 tp=2 dp=2" in log
    assert "iteration 3/3" in log
    assert CheckpointReader(tmp_path / "ckpt").layout.dp == 2
