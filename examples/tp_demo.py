"""Train a tiny GPT with tensor parallelism on CPU processes and print its loss.

The interim "main job" until the trainer exists. It starts its own gloo
processes (``--nproc``, default 2) or joins the ones torchrun started::

    python examples/tp_demo.py                      # 2 processes, TP=2
    python examples/tp_demo.py --nproc 4 --tp 2     # TP=2 x DP=2
    torchrun --nproc_per_node 2 examples/tp_demo.py

The data are synthetic: sequences over the first ``--data-vocab`` token ids
in which each token follows from the previous one by a fixed rule, so the
loss falls from ln(vocab) towards zero within a few dozen steps. Every TP rank of one data-parallel replica sees the same batch;
gradients are averaged over the data-parallel ranks.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch

if __package__ in (None, ""):  # run as a script from a checkout: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hybrid  # noqa: E402
from hybrid.topology import Topology  # noqa: E402
from model_zoo import GPTModel, count_parameters, get_preset, list_presets  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", choices=list_presets())
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (divides the number of processes)")
    p.add_argument("--nproc", type=int, default=2, help="processes to spawn when not started by torchrun")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="sequences per data-parallel rank and step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data-vocab", type=int, default=64, help="token ids the synthetic data use")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--recompute", default="none", choices=("none", "full", "selective"))
    return p.parse_args(argv)


def synthetic_batch(vocab: int, batch: int, seq: int, step: int, dp_rank: int, seed: int):
    """Sequences over ``vocab`` token ids that follow one fixed rule, ``next = (5 * prev + 3) % vocab``.

    Returns (input_ids, labels), both ``[batch, seq]``. Seeded by (seed, step,
    dp_rank): the TP ranks of one replica draw the same batch.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + dp_rank)
    tokens = [torch.randint(0, vocab, (batch,), generator=g)]
    for _ in range(seq):
        tokens.append((5 * tokens[-1] + 3) % vocab)
    tokens = torch.stack(tokens, dim=1)
    return tokens[:, :-1], tokens[:, 1:]


def train(args: argparse.Namespace) -> float:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("WORLD_SIZE", "1")))))
    info = hybrid.init_distributed(timeout_s=300)
    topo = Topology(tp=args.tp)
    config = get_preset(args.preset, seq_length=args.seq, sequence_parallel=args.sequence_parallel,
                        recompute=args.recompute)
    model = GPTModel(config, topo, seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    log = topo.rank == 0
    if log:
        print(f"{topo.describe()} | backend {info.backend or 'none'} | preset {args.preset}: "
              f"{count_parameters(config):,} parameters, vocab {config.vocab_size} "
              f"(padded {config.padded_vocab_size(topo.tp_size)}), seq {args.seq}", flush=True)
    reported = torch.tensor(float("nan"))
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, labels = synthetic_batch(min(args.data_vocab, config.vocab_size), args.batch, args.seq, step, topo.dp_rank, args.seed)
        optimizer.zero_grad(set_to_none=True)
        loss = model(ids.to(topo.device), labels=labels.to(topo.device))
        loss.backward()
        for p in model.parameters():
            topo.comm.all_reduce(p.grad, "dp", op="avg")
        optimizer.step()
        reported = loss.detach().clone()
        topo.comm.all_reduce(reported, "dp", op="avg")
        if log and (step == 1 or step % 5 == 0 or step == args.steps):
            print(f"step {step:4d} | loss {reported.item():.4f} | "
                  f"{(time.perf_counter() - start) / step * 1000:.0f} ms/step", flush=True)
    hybrid.distributed.destroy_distributed()
    return reported.item()


def _spawned(local_rank: int, nproc: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update({"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(nproc),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    train(args)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # started by torchrun
        train(args)
        return
    if args.nproc % args.tp != 0:
        raise SystemExit(f"--nproc {args.nproc} must be a multiple of --tp {args.tp}")
    torch.multiprocessing.spawn(_spawned, args=(args.nproc, _free_port(), args), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
