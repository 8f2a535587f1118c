"""Seeding every global random generator a run may draw from, from the one ``seed`` setting."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch (CPU and every CUDA device).

    Model code, data code and user hooks may draw from any of the three; a run
    is reproducible only if all start from ``seed``. (Checkpoints capture all
    three, so a resumed run continues each stream where it stopped.)
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
