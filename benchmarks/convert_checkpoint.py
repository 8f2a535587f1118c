"""Checkpoint conversion: time and peak memory of ``reshard`` and ``to-hf`` against a plain copy, in one run.

    python benchmarks/convert_checkpoint.py --work-dir /tmp/convert_bench          # ~1.0B parameters, ~4 GB
    python benchmarks/convert_checkpoint.py --work-dir /tmp/cb --layers 2 --hidden 512   # a quick smoke run

It first generates (in a child process) a GPT checkpoint with the GPT-2 switches (fp32 weights, saved at TP=2 with
``CheckpointWriter``, ~1.0B parameters by default: 18 layers, hidden 2048, vocabulary 50304), and
the same tensors as plain ``torch.save`` files, one per TP rank. Then each contender runs in its own
subprocess, so that its peak resident set (``ru_maxrss`` from ``wait4``) is its own:

* **plain copy**: ``torch.load`` each TP file, ``torch.save`` it to a new file and ``fsync`` it: the
  least any copy of the same tensors does (no resharding, no checksums);
* **reshard**: ``tools/convert_checkpoint.py reshard --target-tp 4`` (verifies the source sha256s,
  re-splits every tensor, writes checksummed files, fsyncs);
* **to-hf**: ``tools/convert_checkpoint.py to-hf`` (full tensors, ``model-*.safetensors`` with index).

Contenders alternate for ``--rounds`` rounds; the table reports the median wall seconds and CPU
seconds (user + system: less sensitive to other load on a shared machine), the largest peak RSS,
RSS as a fraction of the checkpoint size (target <= 25%) and time relative to the plain copy
(target <= 1.5x). Sources stay in the page cache for every contender
(~8 GB of RAM); outputs are removed after each run (``--keep`` keeps them). Disk use peaks at ~12 GB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from hybrid.argument_parser import ArgumentParser

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# ---- the generated checkpoint ---------------------------------------------------------------------
def generate(work: Path, layers: int, hidden: int, heads: int, vocab: int, tp: int) -> int:
    """Write the hybrid checkpoint and the plain torch.save copies; returns the checkpoint's bytes."""
    import torch
    from safetensors.torch import load_file

    from hybrid.checkpoint import CheckpointWriter, TensorSource
    from hybrid.convert.hf import gpt_param_layout
    from hybrid.layout import ParallelLayout
    from hybrid.convert.ranges import piece_size
    from model_zoo import GPTConfig

    cfg = GPTConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, seq_length=hidden)
    layout = gpt_param_layout(cfg)
    writer = CheckpointWriter(work / "ckpt", 1000, ParallelLayout(tp=tp, dp=1, precision="fp32"))
    writer.prepare()
    gen = torch.Generator().manual_seed(0)
    records, index = [], []
    for rank in range(tp):
        sources = {}
        for name, (full, meta) in layout.items():
            shape = list(full)
            if meta.partitioned:
                shape[meta.dim] = piece_size(meta, full[meta.dim], tp)
            sources[name] = TensorSource(tuple(shape), torch.float32,
                                         lambda shape=tuple(shape): torch.randn(shape, generator=gen) * 0.02)
            if rank == 0:
                index.append({"name": name, "shape": shape, "dtype": "float32", "tp_meta": meta.to_json()})
        records.append(writer.write_model_shard(sources, rank))
    writer.commit(records, model_config=cfg.to_dict(), param_index=index)
    plain = work / "plain_src"
    plain.mkdir(exist_ok=True)
    for rank in range(tp):
        torch.save(load_file(writer.iter_dir / f"model_tp{rank:02d}.safetensors"), plain / f"model_tp{rank:02d}.pt")
    return sum(r.nbytes for r in records)


def plain_copy(src: Path, dst: Path) -> None:
    """The baseline, run in its own process: load and save each file whole, then fsync it."""
    import torch

    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        tensors = torch.load(f, weights_only=True)
        with open(dst / f.name, "wb") as out:
            torch.save(tensors, out)
            out.flush()
            os.fsync(out.fileno())
        del tensors


# ---- measuring ------------------------------------------------------------------------------------------
def measure(cmd: list) -> tuple:
    """Run ``cmd``; returns (wall seconds, CPU seconds (user + system), peak RSS bytes), of that process alone."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    err = proc.stderr.read().decode()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err}")
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024  # Linux reports KiB


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", required=True, help="scratch directory (~12 GB at the default size)")
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--rounds", type=int, default=3, help="runs of each contender (median time, max RSS)")
    p.add_argument("--keep", action="store_true", help="keep the generated checkpoint and every output")
    # Internal modes, each run in a child process.
    p.add_argument("--plain-copy", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    p.add_argument("--generate-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    work = Path(args.work_dir)
    if args.plain_copy:
        plain_copy(Path(args.plain_copy[0]), Path(args.plain_copy[1]))
        return 0
    if args.generate_only:
        size = generate(work, args.layers, args.hidden, args.heads, args.vocab, tp=2)
        (work / "size").write_text(str(size))
        return 0

    # This process stays small (no torch): a child's peak RSS as wait4 reports it starts from the
    # RSS of the process that forked it.
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    measure([sys.executable, __file__, "--work-dir", str(work), "--layers", str(args.layers), "--hidden",
             str(args.hidden), "--heads", str(args.heads), "--vocab", str(args.vocab), "--generate-only"])
    size = int((work / "size").read_text())
    params = size / 4
    print(f"generated a {params / 1e9:.2f}B-parameter fp32 checkpoint at TP=2 ({size / 1e9:.2f} GB) "
          f"in {time.perf_counter() - t0:.0f}s", flush=True)
    tool = [sys.executable, str(REPO / "tools" / "convert_checkpoint.py")]
    contenders = [
        ("plain copy (torch.load + torch.save + fsync)",
         [sys.executable, __file__, "--work-dir", str(work), "--plain-copy", str(work / "plain_src"),
          str(work / "plain_out")], work / "plain_out"),
        ("reshard TP=2 -> TP=4", tool + ["reshard", "--load", str(work / "ckpt"), "--save", str(work / "tp4"),
                                         "--target-tp", "4", "--no-progress"], work / "tp4"),
        ("to-hf (GPT2LMHeadModel)", tool + ["to-hf", "--load", str(work / "ckpt"), "--output", str(work / "hf"),
                                            "--no-progress"], work / "hf"),
    ]
    results = {label: [] for label, _, _ in contenders}
    for round_ in range(args.rounds):  # contenders alternate, so a slow spell hits all of them
        for label, cmd, out in contenders:
            shutil.rmtree(out, ignore_errors=True)
            seconds, cpu, rss = measure(cmd)
            results[label].append((seconds, cpu, rss))
            print(f"  round {round_ + 1}: {label}: {seconds:.1f}s ({cpu:.1f} CPU s), peak RSS {rss / 2**20:.0f} MiB",
                  flush=True)
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
    rows = [(label, statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
             max(r[2] for r in runs)) for label, runs in results.items()]
    base, base_cpu = rows[0][1], rows[0][2]
    print(f"\ncheckpoint: {params / 1e9:.2f}B parameters, {size / 2**30:.2f} GiB "
          f"(host: {os.cpu_count()} CPUs, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB)")
    print(f"median of {args.rounds} round(s)")
    print(f"| {'contender':<46} | {'time s':>7} | {'vs plain':>8} | {'CPU s':>6} | {'vs plain':>8} | "
          f"{'peak RSS MiB':>12} | {'RSS / ckpt':>10} |")
    print(f"|{'-' * 48}|{'-' * 9}|{'-' * 10}|{'-' * 8}|{'-' * 10}|{'-' * 14}|{'-' * 12}|")
    for label, seconds, cpu, rss in rows:
        print(f"| {label:<46} | {seconds:7.1f} | {seconds / base:7.2f}x | {cpu:6.1f} | {cpu / base_cpu:7.2f}x | "
              f"{rss / 2**20:12.0f} | {rss / size:9.1%} |")
    print("targets: peak RSS <= 25% of the checkpoint, time <= 1.5x the plain copy")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
