"""``to-fp32``: one consolidated fp32 safetensors file of the full model.

Each tensor is the logical full (TP-merged, unpadded) parameter under its
model name, as :func:`hybrid.tensor_parallel.gather.full_state` would gather
it from a running job. For bf16/fp16 runs saved with optimizer state the
values are the fp32 master weights (the saved bf16 weights are those masters
rounded); otherwise the saved weights, upcast. Reads only safetensors, JSON
and ``weights_only`` files, one tensor at a time; needs no process group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from hybrid.checkpoint import CheckpointReader
from hybrid.convert.consolidate import CheckpointSource
from hybrid.convert.output import (ProgressFactory, nbytes_of, open_bar, read_ahead, tracked,
                                   write_safetensors_file)


def export_fp32(load, output, *, progress: Optional[ProgressFactory] = None,
                dtype: torch.dtype = torch.float32) -> Path:
    """Write the checkpoint at ``load`` (a save dir or ``DIR/iter_N``) to ``output`` (.safetensors), each tensor
    rounded to ``dtype`` (from the fp32 masters, when saved)."""
    output = Path(output)
    if output.suffix != ".safetensors":
        raise ValueError(f"--output {output}: the consolidated file is safetensors; name it *.safetensors")
    output.parent.mkdir(parents=True, exist_ok=True)
    with CheckpointSource(CheckpointReader(load)) as src:
        total = sum(nbytes_of(t.full_shape, dtype) for t in src.tensors.values())
        bar = open_bar(progress, "to-fp32", total)
        try:
            tensors = {name: tracked(t.full_shape, dtype,
                                     lambda name=name: src.read_weight(name, dtype=torch.float32).to(dtype), bar)
                       for name, t in src.tensors.items()}
            with read_ahead(tensors) as tensors:
                write_safetensors_file(output, tensors, {
                    "format": "pt", "source": str(src.reader.path), "iteration": str(src.reader.iteration),
                    "weights": "fp32 master" if src.weights_from_master else f"saved {src.layout.precision}"})
        finally:
            bar.close()
    return output
