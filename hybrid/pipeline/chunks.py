"""The model chunks one pipeline rank runs, and the parameters each chunk's backward reaches.

A pipeline-aware model (such as :class:`model_zoo.GPTModel`) carries its stage
split (``model.split``) and names the parameters each of its parts computes
with (``model.parameters_of_part``). The engine hands both to the ZeRO
optimizer, which ends its flat segments where the chunks change and reduces a
chunk's segments after that chunk's passes. The offline tools (the resharder,
the planner) read the same from a model built on ``meta``, so that the
layouts they compute are the optimizer's.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch


def chunk_parameters(model: torch.nn.Module,
                     pp_rank: int) -> Tuple[int, Optional[List[List[torch.nn.Parameter]]]]:
    """``(chunks, params)``: how many model chunks pipeline rank ``pp_rank`` of ``model`` runs (1 for a model
    without a stage split), and per chunk the parameters its backward passes give gradients to (None when the
    model does not say: then every pass reaches every parameter)."""
    split = getattr(model, "split", None)
    if split is None:
        return 1, None
    of_part = getattr(model, "parameters_of_part", None)
    if of_part is None:
        return split.chunks, None
    return split.chunks, [list(of_part(split.part(pp_rank, c))) for c in range(split.chunks)]
