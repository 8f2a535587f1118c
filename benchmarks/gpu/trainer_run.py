"""Part 6 of the GPU verification run: the trainer end to end on CUDA at world 1.

What runs: the CPU demo's data, made here exactly as launch_scripts/pretrain_gpt_tiny.sh makes it (a
corpus of the standard library's docstrings, a SentencePiece tokenizer, an indexed dataset; nothing
downloaded), then ``python -m hybrid.train`` through torchrun with one process: the demo's ``tiny`` GPT,
bf16, ZeRO stage 1, 30 iterations, TensorBoard logs and a checkpoint at the last iteration.

What it checks: torchrun exits 0 within the part's budget; the trainer's "training ..." line names the
GPU as its device (one process under torchrun makes no process group, and the trainer must still train on the
GPU; the CPU in the dry run); the TensorBoard folder holds an event file;
the save folder's ``latest`` names the last iteration, and every file of that checkpoint matches its
recorded checksum (``hybrid.checkpoint.CheckpointReader.verify_all``). Dry run: the same on the CPU
(gloo), 4 iterations.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.gpu.results import PartResult, dry_run_choice, run_part, spec_peak_bf16_tflops  # noqa: E402

DOCUMENTS, VOCAB, SEQ, MICRO = 400, 512, 128, 4


def make_demo_data(work: Path) -> None:
    """The demo's three data steps (launch_scripts/pretrain_gpt_tiny.sh, stages 1-2), smaller."""
    py = sys.executable
    _run([py, "tools/make_stdlib_corpus.py", "--output", work / "corpus.jsonl", "--max-documents", DOCUMENTS])
    _run([py, "tools/train_tokenizer.py", "--input", work / "corpus.jsonl", "--output-prefix", work / "tokenizer",
          "--vocab-size", VOCAB, "--model-type", "bpe", "--no-progress"])
    _run([py, "tools/preprocess_data.py", "--input", work / "corpus.jsonl", "--tokenizer-model",
          work / "tokenizer.model", "--output-prefix", work / "corpus", "--append-eod", "--workers", 1,
          "--no-progress"])


def _run(cmd, timeout: float = 120) -> None:
    subprocess.run([str(c) for c in cmd], cwd=REPO, check=True, timeout=timeout)


def trainer_command(work: Path, iters: int, port: int) -> list:
    """torchrun with one process on this node, the demo's trainer flags (bf16, ZeRO-1, tp 1)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"gpu-check-{port}",
            "-m", "hybrid.train", "--model", "tiny", "--seq-length", SEQ, "--max-position-embeddings", SEQ,
            "--tensor-model-parallel-size", 1, "--zero-stage", 1, "--bf16",
            "--micro-batch-size", MICRO, "--global-batch-size", MICRO, "--train-iters", iters,
            "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", 2,
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--data-path", work / "corpus_text_document",
            "--split", "95,5,0", "--tokenizer-model", work / "tokenizer.model", "--save", work / "checkpoints",
            "--save-interval", iters, "--eval-interval", 0, "--log-interval", max(1, iters // 3),
            "--tensorboard-dir", work / "tensorboard", "--seed", 1234,
            # the trainer's MFU against the same spec peak as part 5 (and no matmul probe at start-up)
            "--peak-tflops", spec_peak_bf16_tflops()]


# An overrunning torchrun gets this long to stop its worker on SIGTERM before both are killed.
STOP_GRACE_S = 3.0


def run_with_deadline(cmd: list, timeout: float):
    """``(exit code or None when it overran, stdout and stderr)`` of ``cmd``; torchrun and its worker (in a
    session of its own) are stopped together (:func:`hybrid.processes.stop_tree`) when it overruns or when
    this part is stopped."""
    from hybrid.processes import stop_tree

    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        stop_tree(proc.pid, STOP_GRACE_S)
        output, _ = proc.communicate(timeout=30)
        return None, output
    finally:
        if proc.poll() is None:  # this part stopped by its own timeout meanwhile
            stop_tree(proc.pid, STOP_GRACE_S)


def body(res: PartResult) -> None:
    from hybrid.checkpoint import CheckpointReader

    iters = dry_run_choice(res.dry_run, 30, 4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="hybrid-gpu-trainer-") as tmp:
        work = Path(tmp)
        make_demo_data(work)
        cmd = [str(c) for c in trainer_command(work, iters, port)]
        res.info.update(iterations=iters, command=" ".join(cmd))
        # ending (with the grace to stop it) a few seconds before run_all.sh's own stop, so that this part, not
        # its timeout, reports it
        timeout = max(10.0, res.budget.left_before_stop() - STOP_GRACE_S - 3)
        returncode, output = run_with_deadline(cmd, timeout)
        tail = output[-3000:]
        print(tail, flush=True)
        res.info["output_tail"] = tail
        ended = f"exit code {returncode}" if returncode is not None else f"still running after {timeout:.0f} s"
        if not res.check("torchrun -m hybrid.train exits 0", returncode == 0, ended):
            return
        device = "cpu" if res.dry_run else "cuda"
        trained_on = [line for line in output.splitlines() if line.startswith("training ")]
        res.check(f"the trainer trained on {device}", any(f"device {device}," in line for line in trained_on),
                  f"its line: {trained_on[:1]}")
        events = list((work / "tensorboard").rglob("events.out.tfevents.*"))
        res.check("TensorBoard event file written", bool(events), f"none under {work / 'tensorboard'}")
        reader = CheckpointReader(work / "checkpoints")
        res.check(f"checkpoint of iteration {iters}", reader.iteration == iters, f"latest is {reader.iteration}")
        reader.verify_all()  # raises ChecksumMismatchError / MissingShardError on a bad file
        res.headline = (f"torchrun -m hybrid.train, {iters} iterations: exit 0, {len(events)} TensorBoard "
                        f"event file(s), checkpoint iteration {reader.iteration} verified")


if __name__ == "__main__":
    sys.exit(run_part(6, "trainer", body, __doc__))
