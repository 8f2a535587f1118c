"""Checkpoint conversion: any TP/DP/ZeRO layout to any other, to one fp32 file, to and from Hugging Face.

Modules (``tools/convert_checkpoint.py`` is the command line; docs/convert.md):

* :mod:`~hybrid.convert.ranges` - full-tensor <-> TP-piece index arithmetic;
* :mod:`~hybrid.convert.consolidate` - :class:`CheckpointSource`: a saved
  checkpoint read one parameter at a time (weights and ZeRO optimizer state);
* :mod:`~hybrid.convert.reshard` - write a checkpoint in another layout offline;
* :mod:`~hybrid.convert.fp32` - one consolidated fp32 safetensors file;
* :mod:`~hybrid.convert.hf` with :mod:`~hybrid.convert.hf_gpt2`,
  :mod:`~hybrid.convert.hf_llama` and :mod:`~hybrid.convert.hf_moe` - Hugging
  Face ``transformers`` directories.

Only the generic reading side is imported here: the engine uses it to load
resharded checkpoints, and it does not depend on ``model_zoo``.
"""

from hybrid.convert.consolidate import CheckpointSource, ConversionError, SavedTensor, Target

__all__ = ["CheckpointSource", "ConversionError", "SavedTensor", "Target"]
