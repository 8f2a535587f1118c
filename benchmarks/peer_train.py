"""A peer's trainer under torchrun: DeepSpeed ZeRO or torch FSDP2 training the GPT of ``zero_vs_peers``.

For benchmarks that run hybrid as ``python -m hybrid.train`` under torchrun
(the emulated slow-link cluster, ``benchmarks/slow_link.py``) and want a peer
beside it, launched the same way. The model is ``zero_vs_peers.PlainGPT``,
built with the weights of model_zoo's GPT of the same flags, and each peer
is set up by ``zero_vs_peers``'s own builders at the peer's defaults (see that
module). Data: ``zero_vs_peers.batch``, random token copies of the same shape
as ``hybrid.train --mock-data``'s batches. Every step is one micro-batch per
rank (``--micro-batch-size`` must be global batch / world).

Prints one line per iteration from rank 0, then the trainer's closing
``run profile: {...}`` line (:mod:`hybrid.training.profile`): rank 0's median
iteration time over the iterations after the first, and every rank's peak
RSS. Peers do not count their blocked communication, so the exposed
communication figures are null. Example (4 local ranks)::

    DS_ACCELERATOR=cpu torchrun --standalone --nproc-per-node 4 benchmarks/peer_train.py --peer deepspeed-z2 \\
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --vocab-size 1024 \\
        --global-batch-size 16 --micro-batch-size 4 --train-iters 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import zero_vs_peers as zvp  # noqa: E402
from hybrid.argument_parser import ArgumentParser  # noqa: E402

# --peer name -> the zero_vs_peers contender: its defaults, or "-matched": hybrid's bucket size (--zero-bucket-size)
# and overlap setting, as zero_vs_peers' matched table sets them
PEERS = {
    "deepspeed-z2": zvp.DEEPSPEED[2],
    "deepspeed-z3": zvp.DEEPSPEED[3],
    "deepspeed-z2-matched": zvp._matched(zvp.DEEPSPEED[2]),
    "deepspeed-z3-matched": zvp._matched(zvp.DEEPSPEED[3]),
    "fsdp2": zvp.FSDP2_R1,  # reshard_after_forward=True, FSDP2's default (ZeRO-3-like)
    "fsdp2-noreshard": zvp.FSDP2_R0,  # ZeRO-2-like
}


def parse(argv=None) -> argparse.Namespace:
    """The flags share ``hybrid.train``'s names, so a benchmark passes both the same model flags."""
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer", required=True, choices=sorted(PEERS))
    ap.add_argument("--num-layers", dest="layers", type=int, required=True)
    ap.add_argument("--hidden-size", dest="hidden", type=int, required=True)
    ap.add_argument("--num-attention-heads", dest="heads", type=int, required=True)
    ap.add_argument("--seq-length", dest="seq", type=int, required=True)
    ap.add_argument("--vocab-size", dest="vocab", type=int, required=True)
    ap.add_argument("--global-batch-size", dest="global_batch", type=int, required=True)
    ap.add_argument("--micro-batch-size", dest="micro_batch", type=int, required=True)
    ap.add_argument("--train-iters", dest="iters", type=int, required=True)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", dest="wd", type=float, default=0.0)
    ap.add_argument("--zero-bucket-size", dest="bucket", type=int, default=0,
                    help="the -matched peers' bucket size in elements (0: hybrid's default); the others ignore it")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    import torch
    import torch.distributed as dist

    import hybrid
    from hybrid.training.profile import PROFILE_PREFIX, WARMUP_ITERATIONS, peak_rss_mib

    peer = PEERS[args.peer]
    hybrid.init_distributed(backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.micro_batch * world != args.global_batch or world != zvp.WORLD:
        if rank == 0:
            print(f"peer_train: needs {zvp.WORLD} ranks and --micro-batch-size x ranks = --global-batch-size "
                  f"(one micro-batch per step); got {world} ranks, {args.micro_batch} x {world} vs "
                  f"{args.global_batch}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    build = zvp._build_deepspeed if peer.kind == "deepspeed" else zvp._build_torch
    step, dp_rank, _, _, _ = build(peer, args)
    lo, hi = dp_rank * args.micro_batch, (dp_rank + 1) * args.micro_batch
    times = []
    for it in range(1, args.iters + 1):
        x, y = zvp.batch(it - 1, args)
        start = time.perf_counter()
        loss = float(step(x[lo:hi], y[lo:hi]).detach())
        times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"{args.peer} iteration {it}/{args.iters} | lm loss: {loss:.6E} | "
                  f"iteration time: {1000 * times[-1]:.1f} ms", flush=True)
    rss = [None] * world
    dist.all_gather_object(rss, peak_rss_mib())
    measured = times[WARMUP_ITERATIONS:] if len(times) > WARMUP_ITERATIONS else times
    if rank == 0:
        profile = {"iterations_measured": len(measured), "iteration_ms_median": 1000 * statistics.median(measured),
                   "exposed_comm_ms_median": None, "compute_ms_median": None, "peak_rss_mib": rss}
        print(PROFILE_PREFIX + json.dumps(profile), flush=True)
    # every rank done with every collective before any tears its group down: a gloo group destroyed under a
    # peer's pending operation aborts that peer ("terminate called without an active exception")
    dist.barrier()
    # The peer's model and optimizer (FSDP2's states hold its process groups and device mesh) go now, while
    # the interpreter is whole: left to its finalization they were torn down in an order that aborted 1 run in
    # about 5 the same way, after the run's last line.
    del step
    gc.collect()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
