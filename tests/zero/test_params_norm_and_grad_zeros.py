"""``engine.get_params_norm()`` and ``engine.get_num_zeros_in_grad()`` (``--log-params-norm``,
``--log-num-zeros-in-grad``) report what one process holding the whole model sees, in every layout.

World 4, gloo, fp32: ZeRO stages 0-3 at DP 4 and TP 2 x DP 2, and two pipeline stages at DP 2 with the word
embedding tied across them. Each layout trains two steps through ``Engine.train_batch``
(:mod:`tests.pipeline.gpt_parity`'s model and batches) with zero counting on.

* **Zeros** are structural: the rows of the (untied) word embedding that no token of the global batch looks
  up get exactly zero gradient, in any layout and any summation order, and so do the padded vocabulary rows.
  The count must equal, exactly, that of one process's ``backward`` on the same global batch. Counting a
  TP-replicated or DP-replicated element twice, or missing a partition, changes it by thousands.
* **The params norm** must equal the float64 norm of the same weights gathered whole (TP-merged, each
  pipeline stage's own, the tied copy once), within the rounding bound of an fp32 norm: each rank sums the
  squares of at most N elements in fp32, so the relative error of the squared norm is below ``gamma(N)``
  (``tests/numerics.py``); the norm's is half that. Before the first step the same holds against one process's
  freshly built model (weights depend on (seed, name) only). Counting the TP-replicated norm weights twice
  moves the norm by 9%, far outside the bound (gamma(N) / 2 = 5e-3 at this model's N = 1.65e5).
"""

import math

import pytest
import torch

from tests.multiproc import run_distributed
from tests.numerics import gamma
from tests.pipeline import gpt_parity as gp
from tests.zero.common import token_batch

CASES = {
    "dp4-z0": dict(tp=1, pp=1, stage=0, micro=1, layers=2, tie=False),
    "dp4-z1": dict(tp=1, pp=1, stage=1, micro=1, layers=2, tie=False),
    "tp2-dp2-z2": dict(tp=2, pp=1, stage=2, micro=2, layers=2, tie=False),
    "tp2-dp2-z3": dict(tp=2, pp=1, stage=3, micro=2, layers=2, tie=False, persist=100),
    "pp2-dp2-z1-tied": dict(tp=1, pp=2, stage=1, micro=1, layers=2, tie=True),
    "pp2-dp2-z2-untied": dict(tp=1, pp=2, stage=2, micro=2, layers=2, tie=False),
}
STEPS = 2


def _whole_sq(engine, model, topo) -> tuple:
    """(sum of squares in float64, element count) of the whole model's weights, each counted once: TP-merged,
    added over the pipeline stages, the tied embedding's copy on the last stage left out."""
    from hybrid.tensor_parallel.gather import full_state

    sq = torch.zeros(2, dtype=torch.float64)
    with engine.gathered_parameters():  # whole under ZeRO-3
        whole = full_state(model, topo)
    for name, t in whole.items():
        tied_copy = topo.pp_rank > 0 and topo.pp_size > 1 and "embedding" in name and "position" not in name \
            and model.config.tie_embeddings
        if topo.tp_rank == 0 and topo.dp_rank == 0 and not tied_copy:
            sq[0] += t.double().square().sum()
            sq[1] += t.numel()
    torch.distributed.all_reduce(sq)
    return float(sq[0].item()), int(sq[1].item())


def _run(cases):
    out = []
    for case in cases:
        topo, cfg, model, engine = gp._build(case)
        engine.count_grad_zeros = True
        before = engine.get_params_norm()
        whole_before = _whole_sq(engine, model, topo)
        zeros, norms = [], []
        for s in range(STEPS):
            gp._steps(engine, topo, cfg, case["micro"], [s])
            zeros.append(engine.get_num_zeros_in_grad())
            norms.append((engine.get_params_norm(), _whole_sq(engine, model, topo)))
        engine.count_grad_zeros = False
        gp._steps(engine, topo, cfg, case["micro"], [STEPS])
        out.append({"before": before, "whole_before": whole_before, "zeros": zeros, "norms": norms,
                    "not_counted": engine.get_num_zeros_in_grad()})
        engine.close()
        topo.close()
    return out


@pytest.fixture(scope="module")
def results():
    per_rank = run_distributed(_run, 4, list(CASES.values()), timeout=300)
    return {name: [rank[i] for rank in per_rank] for i, name in enumerate(CASES)}


def _reference(case):
    """One process: the float64 norm of the fresh model, and the zeros of each step's whole-batch gradient."""
    from hybrid import Topology
    from model_zoo import GPTModel

    cfg = gp.gpt_config(case["layers"], case["tie"])
    model = GPTModel(cfg, Topology.local())
    norm = math.sqrt(sum(float(p.detach().double().square().sum()) for p in model.parameters()))
    zeros = []
    for s in range(STEPS):
        model.zero_grad()
        x, y = token_batch(s, gp.GLOBAL, cfg.vocab_size, cfg.seq_length)
        model(x, y).backward()
        zeros.append(sum(int((p.grad == 0).sum()) for p in model.parameters() if p.grad is not None))
    return norm, zeros


@pytest.mark.parametrize("name", list(CASES))
def test_layout_reports_the_norm_and_zeros_of_one_process(results, name):
    ranks = results[name]
    ref_norm, ref_zeros = _reference(CASES[name])
    for r in ranks:
        # zeros: exact, on every rank, and none counted once counting is off
        assert r["zeros"] == ref_zeros, (name, r["zeros"], ref_zeros)
        assert r["not_counted"] is None
        # params norm before any step: the whole model's, as one process builds it
        _, count = r["whole_before"]
        bound = gamma(count) / 2  # on the norm: half the squared norm's relative bound
        assert abs(r["before"] - ref_norm) <= bound * ref_norm, (name, r["before"], ref_norm)
        assert abs(r["before"] - math.sqrt(r["whole_before"][0])) <= bound * r["before"]
        # and after each step: the norm of the weights the step left, gathered whole
        for got, (whole_sq, _) in r["norms"]:
            assert abs(got - math.sqrt(whole_sq)) <= bound * got, (name, got, math.sqrt(whole_sq))
    assert all(z > 1000 for z in ref_zeros) or CASES[name]["tie"]  # the untied layouts have rows to count
    assert len({r["before"] for r in ranks}) == 1  # one all-reduce: every rank reports the same value
