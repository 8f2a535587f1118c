"""Checkpoints of context-parallel runs (issue 50): saved at CP2, resumed at CP2, at CP1 x DP2 and at one process.

A CP run's checkpoint is that of a run at ``dp x cp`` data-parallel ranks (hybrid.engine.checkpoint): the cp ranks
hold the same parameters and ZeRO partitions over all of them. So

* resumed in the layout that saved it, every tensor and generator comes back bit for bit and the same kernels run
  in the same order: the continuation is bit-identical to the run that never stopped;
* a CP2 x DP1 checkpoint *is* a DP2 one: CP1 x DP2 loads it on the same-layout path, and one process reshards it
  (the fp32 masters and Adam moments are copied, not recomputed). Both start their first step from the very state
  the CP2 run had; they then differ from it only by rounding (attention over a split sequence against a whole one,
  another reduction order), bounded as tests/engine/parity_training.py bounds two runs of one training: the
  forward's rounding (tests/numerics.transformer_bound, for each of the two fp32 runs) on the first step's loss,
  plus Adam's drift (tests/numerics.adam_trajectory_tolerance) over the steps since the resume;
* ``tools/convert_checkpoint.py reshard`` writes it for one process ahead of time, and that run then loads on the
  exact path into the state the reshard on load gives: bit-identical continuations.

The batches pack documents (``document_ids``: attention stays inside each, as ``--reset-attention-mask`` makes
the trainer do) whose boundaries fall inside the ranks' chunks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from tests.engine.parity_training import MOE
from tests.multiproc import run_distributed
from tests.numerics import adam_trajectory_tolerance, max_ratio, record, transformer_bound

REPO = Path(__file__).resolve().parents[2]
DENSE = dict(vocab_size=200, hidden_size=32, num_layers=2, num_heads=4, num_query_groups=2, seq_length=16,
             init_std=0.05, bias=False, position="rope", norm="rmsnorm", mlp="swiglu", tie_embeddings=False)
MICRO, GLOBAL, STEPS, SAVED = 2, 4, 4, 2  # the checkpoint is taken after step SAVED of STEPS
LR = 0.01
CFG = {"optimizer": {"type": "adamw", "lr": LR, "betas": [0.9, 0.95], "weight_decay": 0.1},
       "steps_per_print": 0, "micro_batch_size": MICRO, "global_batch_size": GLOBAL, "clip_grad": 1.0}


def _data():
    """``STEPS x GLOBAL`` samples: input ids, labels and document ids (2 or 3 packed documents per sample)."""
    g = torch.Generator().manual_seed(4)
    shape = (STEPS * GLOBAL, DENSE["seq_length"])
    ids = torch.randint(0, DENSE["vocab_size"], shape, generator=g)
    labels = torch.randint(0, DENSE["vocab_size"], shape, generator=g)
    starts = torch.zeros(shape, dtype=torch.long)
    for row in range(shape[0]):  # document starts anywhere after the first token: inside a rank's chunks too
        starts[row, torch.randint(1, shape[1], (2,), generator=g)] = 1
    return ids, labels, starts.cumsum(1)


def _engine(tp: int, cp: int, stage: int, ep: int = 1, seed: int = 5, topo=None):
    """An engine training DENSE (at ``ep > 1`` the tiny MoE model of tests/engine/parity_training.py, with the
    same vocabulary and sequence length) on ``topo`` (default: a new one of these sizes)."""
    import hybrid
    from hybrid.config.parse import config_from_dict
    from model_zoo import GPTConfig, GPTModel

    if topo is None:
        topo = hybrid.Topology(tp=tp, cp=cp, ep=ep, timeout_s=60) if _distributed() else hybrid.Topology.local()
    zero = {"stage": stage, **({"persistence_threshold": 0} if stage == 3 else {})}
    model = GPTModel(GPTConfig(**{**(MOE if ep > 1 else DENSE), "sequence_parallel": tp > 1}), topo, seed=seed)
    return hybrid.initialize(model, config_from_dict({**CFG, "zero": zero}), topology=topo), model, topo


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _steps(engine, topo, first: int, last: int) -> list:
    """Steps ``first + 1 .. last``: this data-parallel rank's share of each global batch (every cp rank of a
    group takes the same samples); returns the global batches' losses."""
    ids, labels, docs = _data()
    share = GLOBAL // topo.dp_size
    losses = []
    for step in range(first, last):
        start = step * GLOBAL + topo.dp_rank * share
        batch = [{"input_ids": ids[k:k + MICRO], "labels": labels[k:k + MICRO], "document_ids": docs[k:k + MICRO]}
                 for k in range(start, start + share, MICRO)]
        losses.append(engine.train_batch(batch, dp_mean=True)[1])
    return losses


def _params(engine, model, topo) -> dict:
    from hybrid.tensor_parallel.gather import full_state

    with engine.gathered_parameters():  # numpy: torch tensors would cross the result queue as shared memory
        return {n: t.detach().float().numpy().copy() for n, t in full_state(model, topo).items()}


def _save_run(tp: int, cp: int, stage: int, save_dir: str, resume: bool, ep: int = 1) -> dict:
    """Train STEPS steps saving after SAVED; with ``resume``, then a new engine (other initial weights) loads that
    checkpoint and trains the remaining steps in the same processes."""
    engine, model, topo = _engine(tp, cp, stage, ep)
    losses = _steps(engine, topo, 0, SAVED)
    engine.save_checkpoint(save_dir)
    losses += _steps(engine, topo, SAVED, STEPS)
    out = {"losses": losses, "params": _params(engine, model, topo), "layout": engine.checkpoints.layout.to_json()}
    engine.close()
    if resume:
        engine, model, _ = _engine(tp, cp, stage, ep, seed=99, topo=topo)
        engine.load_checkpoint(save_dir)
        out["resumed"] = {"losses": _steps(engine, topo, SAVED, STEPS), "params": _params(engine, model, topo)}
        engine.close()
    topo.close()
    return out


def _resume_run(tp: int, cp: int, stage: int, save_dir: str, measure: bool = False) -> dict:
    """Load the checkpoint after step SAVED into this layout and train the remaining steps. ``measure`` (one
    process): also each of those steps' gradient l1 norm, what scales Adam's drift into the loss (as
    tests/engine/parity_training.py takes it), from a plain model holding the engine's weights."""
    engine, model, topo = _engine(tp, cp, stage)
    info = engine.load_checkpoint(save_dir)
    out = {"losses": [], "grad_l1": [], "iteration": info["iteration"]}
    for step in range(SAVED, STEPS):
        if measure:
            out["grad_l1"].append(_grad_l1({n: p.detach() for n, p in model.named_parameters()}, step))
        out["losses"] += _steps(engine, topo, step, step + 1)
    out["params"] = _params(engine, model, topo)
    engine.close()
    if _distributed():
        topo.close()
    return out


def _grad_l1(params: dict, step: int) -> float:
    """The l1 norm of the gradient of global batch ``step``'s mean loss at ``params`` (a one-process model's
    parameters, the vocabulary padded), in a plain model."""
    from hybrid.topology import Topology
    from model_zoo import GPTConfig, GPTModel

    model = GPTModel(GPTConfig(**DENSE), Topology.local(), seed=5)
    model.load_state_dict(params, strict=False)  # params: every trained tensor (buffers stay as built)
    ids, labels, docs = _data()
    for k in range(step * GLOBAL, (step + 1) * GLOBAL, MICRO):
        loss = model(ids[k:k + MICRO], labels=labels[k:k + MICRO], document_ids=docs[k:k + MICRO])
        (loss / (GLOBAL // MICRO)).backward()
    return sum(float(p.grad.abs().sum()) for p in model.parameters())


def _assert_bit_identical(run: dict) -> None:
    assert run["resumed"]["losses"] == run["losses"][SAVED:]
    for name, value in run["params"].items():
        assert (run["resumed"]["params"][name] == value).all(), name


def test_cp2_checkpoint_resumes_bit_identically(tmp_path):
    """CP2 (2 ranks, ZeRO-1 over the 2 data ranks) saved after 2 steps, resumed in the same layout: the 2 steps
    after it are bit-identical to those of the run that went on; the checkpoint is a DP2 one."""
    from hybrid.checkpoint import CheckpointReader

    runs = run_distributed(_save_run, 2, 1, 2, 1, str(tmp_path), True)
    for run in runs:
        _assert_bit_identical(run)
    assert runs[0]["params"].keys() == runs[1]["params"].keys()
    reader = CheckpointReader(tmp_path)
    assert reader.iteration == SAVED and reader.layout.to_json() == runs[0]["layout"]
    assert (reader.layout.tp, reader.layout.dp, reader.layout.pp) == (1, 2, 1)
    reader.verify_all()


@pytest.mark.slow
def test_cp2_x_dp2_zero3_checkpoint_resumes_bit_identically(tmp_path):
    """CP2 x DP2 at ZeRO-3 (4 ranks, parameters partitioned over the 4 data ranks): the same, on a checkpoint
    whose model file DP rank 0 of the data view gathers."""
    for run in run_distributed(_save_run, 4, 1, 2, 3, str(tmp_path), True, timeout=300):
        _assert_bit_identical(run)


@pytest.mark.slow
def test_cp2_x_ep2_moe_checkpoint_resumes_bit_identically(tmp_path):
    """A tiny MoE GPT at CP2 x EP2 (2 ranks: each cp rank holds half the experts): its optimizer files hold the
    dense partition over the 2 data ranks and each ep rank's experts (docs/checkpoints.md); resumed, bit-identical."""
    from hybrid.checkpoint import CheckpointReader

    for run in run_distributed(_save_run, 2, 1, 2, 1, str(tmp_path), True, 2):
        _assert_bit_identical(run)
    layout = CheckpointReader(tmp_path).layout
    assert (layout.dp, layout.ep) == (2, 2)


def _bounds():
    """The loss bound of each step after the resume (relative part, absolute part per gradient l1) and the
    parameters' bound after them: see the module docstring."""
    from model_zoo import GPTConfig

    cfg = GPTConfig(**DENSE)
    fwd = 2 * transformer_bound(cfg, MICRO * cfg.seq_length, part="loss")  # two fp32 runs, each within it of exact
    return fwd, [adam_trajectory_tolerance(i, LR) for i in range(STEPS - SAVED)], \
        adam_trajectory_tolerance(STEPS - SAVED, LR)


def _assert_close(got: dict, want: dict, grad_l1: list) -> None:
    fwd, drift, params = _bounds()
    for i, (a, b) in enumerate(zip(got["losses"], want["losses"][SAVED:])):
        bound = fwd * abs(b) + grad_l1[i] * drift[i]
        ratio = record(abs(a - b) / bound if a != b else 0.0)
        assert ratio <= 1, f"step {SAVED + i + 1}: loss {a} vs {b}, {ratio:.2f} x the bound"
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["params"].items():
        ratio = max_ratio(torch.from_numpy(got["params"][name]), torch.from_numpy(value), params)
        assert ratio <= 1, f"{name}: {ratio:.2f} x the bound"


@pytest.mark.slow
def test_cp2_checkpoint_resumes_at_cp1_x_dp2_and_at_one_process(tmp_path):
    """A CP2 x DP1 checkpoint (2 ranks) continues at CP1 x DP2 (its same-layout path: the file names are a DP2
    run's) and at one process (resharded), each within the bounds of the module docstring of the CP2 run that
    went on."""
    from hybrid.checkpoint import CheckpointReader

    (saved, _) = run_distributed(_save_run, 2, 1, 2, 1, str(tmp_path), False)
    assert CheckpointReader(tmp_path).layout.dp == 2
    one = _resume_run(1, 1, 1, str(tmp_path), measure=True)  # in this process
    assert one["iteration"] == SAVED
    _assert_close(one, saved, one["grad_l1"])
    for run in run_distributed(_resume_run, 2, 1, 1, 1, str(tmp_path)):
        assert run["iteration"] == SAVED
        _assert_close(run, saved, one["grad_l1"])
    # Resharded ahead of time for one process (tools/convert_checkpoint.py reshard), it loads on the exact path
    # into the very state the reshard on load gave: the continuation is bit-identical to that one.
    cmd = [sys.executable, str(REPO / "tools/convert_checkpoint.py"), "reshard", "--load", str(tmp_path),
           "--save", str(tmp_path / "dp1"), "--target-tp", "1", "--target-dp", "1", "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from hybrid.engine import reshard

    with mock.patch.object(reshard, "load_resharded", side_effect=AssertionError("resharded on load")):
        offline = _resume_run(1, 1, 1, str(tmp_path / "dp1"))
    assert offline["losses"] == one["losses"]
    for name, value in one["params"].items():
        assert (offline["params"][name] == value).all(), name
