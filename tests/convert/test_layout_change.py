"""Continue training in a new layout (issue 6 acceptance), on 4 gloo ranks, fp32, in one spawn.

1. Train the tiny GPT at TP=2 x DP=2 with ZeRO-2 for K steps and save; the
   same run goes on uninterrupted to 2K steps.
2. Load that checkpoint at TP=1 x DP=4 with ZeRO-1 and at TP=4 x DP=1 with
   ZeRO-0 (resharded on load) and train K more steps; also reshard it offline
   for TP=4 x DP=1 first and load that (the same-layout path).
3. Both continuations match the uninterrupted run within 1e-5 relative on
   every loss and every final gathered weight; the offline and on-load
   reshards give bit-identical runs.

The same for bf16 -> fp32: a bf16 TP=2 x DP=2 ZeRO-2 checkpoint loaded into
fp32 runs at TP=2 x DP=2, TP=1 x DP=4 and TP=4 x DP=1 starts from the fp32
master weights exactly, and the three continuations agree within 1e-5.

Finally a GPT-2 imported from transformers at TP=2 (``from-hf``) is loaded
by the trainer with ``--finetune`` at TP=2 x DP=2 and gives the HF logits.

About the attention key bias: its true gradient is exactly zero (softmax is
invariant to adding the same number to every score of a row), so what it
receives is rounding noise that depends on the reduction order, which Adam
normalises into steps of up to ~lr. Across layouts those rows differ by
4e-7 to 1.4e-6 absolute depending on the CPU's kernels, so they are compared
in absolute terms against what Adam can move them (a hundredth of K steps of
lr, tests/numerics.py); every other parameter, the q and v biases included,
is compared at 1e-5 relative.
"""

import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hybrid.checkpoint import CheckpointReader
from hybrid.convert.consolidate import WEIGHT, CheckpointSource
from hybrid.convert.fp32 import export_fp32
from tests.multiproc import run_distributed
from tests.numerics import adam_trajectory_tolerance

K = 3
LR = 1e-3  # the runs' --lr
HIDDEN = 64
TOL = 1e-5
SMALL_MODEL = ["--num-layers", "2", "--hidden-size", str(HIDDEN), "--num-attention-heads", "4", "--seq-length", "32",
               "--vocab-size", "512", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "4",
               "--lr", str(LR), "--lr-warmup-iters", "1", "--log-interval", "100", "--eval-interval", "0",
               "--weight-decay", "0.1", "--clip-grad", "1.0", "--peak-tflops", "1", "--train-iters", str(2 * K)]


def _layout(tp, stage):
    return ["--tensor-model-parallel-size", str(tp), "--zero-stage", str(stage)]


def _trainer(argv):
    from hybrid.training import Trainer, parse_args, validate

    args = parse_args(argv + ["--lr-decay-style", "cosine"])  # loads rely on decay_iters derived from train_iters
    validate(args, world_size=int(os.environ["WORLD_SIZE"]))
    return Trainer(args)


def _gathered(trainer):
    """Full weights as numpy arrays on rank 0 (None elsewhere). Collective over "tp"."""
    from hybrid.tensor_parallel.gather import full_state

    with trainer.engine.gathered_parameters():  # whole weights under ZeRO-3
        state = full_state(trainer.model, trainer.topology)
    return {n: t.float().numpy() for n, t in state.items()} if trainer.topology.rank == 0 else None


def _run(argv, weights_before=False):
    trainer = _trainer(argv)
    before = _gathered(trainer) if weights_before else None
    trainer.train()
    return {"losses": [loss for _, loss in trainer.history], "iterations": [it for it, _ in trainer.history],
            "weights": _gathered(trainer), "before": before}


def _hf_logits_at_tp2(root):
    """Import a random GPT-2 from transformers at TP=2, fine-tune-load it at TP=2 x DP=2, return both logits."""
    import torch.distributed as dist

    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    hf_logits = None
    if dist.get_rank() == 0:
        import transformers

        from hybrid.convert.hf import import_from_hf

        torch.manual_seed(5)
        cfg = transformers.GPT2Config(vocab_size=512, n_positions=32, n_embd=HIDDEN, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=0)
        hf = transformers.GPT2LMHeadModel(cfg).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "ln" in name or name.endswith(".bias"):
                    p.add_(0.1 * torch.randn(p.shape))
            hf_logits = hf(input_ids=ids).logits.numpy()
        hf.save_pretrained(os.path.join(root, "hf"))
        import_from_hf(os.path.join(root, "hf"), os.path.join(root, "imported"), tp=2)
    dist.barrier()
    trainer = _trainer(SMALL_MODEL + _layout(2, 1) + ["--load", os.path.join(root, "imported"), "--finetune"])
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model.gather_logits(trainer.model(ids)).numpy()
    return {"hf": hf_logits, "ours": logits}


def _all_runs(root):
    import torch.distributed as dist

    from hybrid.convert.reshard import reshard_checkpoint

    out = {}
    fp32 = os.path.join(root, "fp32")
    out["straight"] = _run(SMALL_MODEL + _layout(2, 2) + ["--save", fp32, "--save-interval", str(K)])
    at_k = os.path.join(fp32, f"iter_{K:07d}")
    out["tp1_dp4"] = _run(SMALL_MODEL + _layout(1, 1) + ["--load", at_k])
    out["tp4_dp1"] = _run(SMALL_MODEL + _layout(4, 0) + ["--load", at_k])
    if dist.get_rank() == 0:
        reshard_checkpoint(at_k, os.path.join(root, "offline"), target_tp=4, target_dp=1, target_zero_stage=0)
    dist.barrier()
    out["tp4_dp1_offline"] = _run(SMALL_MODEL + _layout(4, 0) + ["--load", os.path.join(root, "offline")])

    bf16 = os.path.join(root, "bf16")
    _run(SMALL_MODEL[:-1] + [str(K), "--lr-decay-iters", str(2 * K), "--bf16", "--save", bf16] + _layout(2, 2))
    for key, layout in (("bf16_tp2_dp2", _layout(2, 2)), ("bf16_tp1_dp4", _layout(1, 1)),
                        ("bf16_tp4_dp1", _layout(4, 0))):
        out[key] = _run(SMALL_MODEL + layout + ["--load", bf16], weights_before=True)
    out["hf"] = _hf_logits_at_tp2(root)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return run_distributed(_all_runs, 4, str(root), timeout=280)[0], root


def _rel(a, b):
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _assert_weights_close(got, want):
    assert got.keys() == want.keys()
    for name in want:
        a, b = got[name], want[name]
        if name.endswith("attention.qkv_proj.bias"):  # rows [h, 2h) are the key bias: see the module docstring
            key = slice(HIDDEN, 2 * HIDDEN)
            # Noise-driven: bounded by what Adam can move in K steps at lr 1e-3 (tests/numerics.py).
            bound = adam_trajectory_tolerance(K, LR)
            assert np.abs(a[key] - b[key]).max() <= bound, f"{name}: key bias moved apart"
            a, b = np.delete(a, np.s_[key]), np.delete(b, np.s_[key])
        assert _rel(a, b) <= TOL, f"{name}: relative difference {_rel(a, b):.2e}"


def _assert_losses_close(got, want):
    assert len(got) == len(want) == K
    for a, b in zip(got, want):
        assert abs(a - b) <= TOL * abs(b), (got, want)


@pytest.mark.parametrize("layout", ["tp1_dp4", "tp4_dp1"])
def test_continuation_in_a_new_layout_matches_the_uninterrupted_run(runs, layout):
    out, _ = runs
    straight, resumed = out["straight"], out[layout]
    assert straight["iterations"] == list(range(1, 2 * K + 1))
    assert resumed["iterations"] == list(range(K + 1, 2 * K + 1))
    _assert_losses_close(resumed["losses"], straight["losses"][K:])
    _assert_weights_close(resumed["weights"], straight["weights"])


def test_offline_reshard_and_reshard_on_load_train_identically(runs):
    out, _ = runs
    a, b = out["tp4_dp1_offline"], out["tp4_dp1"]
    assert a["losses"] == b["losses"]
    assert all(np.array_equal(a["weights"][n], b["weights"][n]) for n in b["weights"])


def test_to_fp32_equals_the_gathered_model(runs):
    out, root = runs
    # The uninterrupted run saved its final state too (iteration 2K).
    got = load_file(export_fp32(root / "fp32", root / "final.safetensors"))
    want = out["straight"]["weights"]
    assert got.keys() == want.keys()
    assert all(np.array_equal(got[n].numpy(), want[n]) for n in want)


def test_bf16_checkpoint_continues_from_the_fp32_masters(runs):
    out, root = runs
    masters = load_file(export_fp32(root / "bf16", root / "bf16_masters.safetensors"))
    assert CheckpointReader(root / "bf16").layout.precision == "bf16"
    with CheckpointSource(CheckpointReader(root / "bf16")) as src:
        rounded = {n: src.read(n, WEIGHT, dtype=torch.float32) for n in src.tensors}
    assert any(not torch.equal(masters[n], rounded[n]) for n in masters)  # the masters carry more bits
    for key in ("bf16_tp2_dp2", "bf16_tp1_dp4", "bf16_tp4_dp1"):
        before = out[key]["before"]
        assert all(np.array_equal(before[n], masters[n].numpy()) for n in masters), key
    reference = out["bf16_tp2_dp2"]
    for key in ("bf16_tp1_dp4", "bf16_tp4_dp1"):
        _assert_losses_close(out[key]["losses"], reference["losses"])
        _assert_weights_close(out[key]["weights"], reference["weights"])


def test_imported_gpt2_finetune_loads_at_tp2_with_the_hf_logits(runs):
    out, _ = runs
    hf, ours = out["hf"]["hf"], out["hf"]["ours"]
    assert ours.shape == hf.shape == (2, 32, 512)
    assert _rel(ours, hf) < TOL
