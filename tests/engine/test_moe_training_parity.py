"""An MoE GPT trained 10 AdamW steps in expert-parallel layouts equals one process doing the same in plain PyTorch.

The reference is GPTModel at one process with ``torch.optim.AdamW``: each global batch's micro-batches of
``MICRO`` sequences in order (the balancing loss is a per-micro-batch quantity, so the reference takes the
micro-batches each data-parallel rank takes), each loss over the accumulation count, the balancing losses joined
to backward with the same factor, clipping active on some steps. Dropless routing, the balancing loss on.
Tolerances: tests/engine/parity_training.py.
"""

from __future__ import annotations

import pytest

from tests.engine.parity_training import WORLD, check, reference, train
from tests.multiproc import run_distributed

LAYOUTS = {
    "ep2xdp2-zero1": (1, 1, 2, 1, {}),
    "ep2xtp2-sp-zero1": (2, 1, 2, 1, {}),
    "ep4-zero1": (1, 1, 4, 1, {}),
    "pp2xep2-zero1": (1, 2, 2, 1, {}),
    "ep2xdp2-zero2": (1, 1, 2, 2, {}),
    "ep2xdp2-zero3": (1, 1, 2, 3, {}),
    "pp2-tp2-ep1-zero0": (2, 2, 1, 0, {}),
}


@pytest.mark.slow  # ~45 s each at world 4; the default run keeps tests/model_zoo/test_moe.py's layer-level EP parity
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_trains_as_one_process(name):
    tp, pp, ep, stage, overrides = LAYOUTS[name]
    runs = run_distributed(train, WORLD, tp, pp, ep, stage, overrides, timeout=300)
    check(runs, reference(overrides), overrides)
