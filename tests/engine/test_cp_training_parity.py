"""A GPT trained 10 AdamW steps with its sequences split over context-parallel ranks equals one process doing the
same in plain PyTorch (issue 50's parity: CP2 x DP2 at ZeRO-1 and ZeRO-3, CP2 x PP2, CP2 x TP2 with sequence
parallelism, CP4, a2a; GQA and packed documents). Tolerances: tests/engine/parity_training.py.
"""

from __future__ import annotations

import pytest

from tests.engine.parity_training import WORLD, check, reference, train
from tests.multiproc import run_distributed

DENSE = dict(vocab_size=200, hidden_size=32, num_layers=2, num_heads=4, num_query_groups=2, seq_length=16,
             init_std=0.05, bias=False, position="rope", norm="rmsnorm", mlp="swiglu", tie_embeddings=False)
LAYOUTS = {  # (tp, pp, cp, zero stage, model overrides)
    "cp2xdp2-zero1": (1, 1, 2, 1, {}),
    "cp2xdp2-zero3": (1, 1, 2, 3, {}),
    "cp2xpp2-zero1": (1, 2, 2, 1, {}),
    "cp2xtp2-sp-zero1": (2, 1, 2, 1, {}),
    "cp4-zero2": (1, 1, 4, 2, {}),
    "cp2-a2a-zero1": (1, 1, 2, 1, {"cp_comm_type": "a2a"}),
}


@pytest.mark.slow  # ~30 s each at world 4; the default run keeps tests/context_parallel/test_cp_model.py's CP2 case
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_layout_trains_as_one_process(name):
    tp, pp, cp, stage, overrides = LAYOUTS[name]
    runs = run_distributed(train, WORLD, tp, pp, 1, stage, overrides, cp, DENSE, timeout=300)
    check(runs, reference(overrides, DENSE), overrides, DENSE)
