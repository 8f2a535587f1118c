"""Which ZeRO collectives travel compressed, and in what format: the one definition of the settings' rules.

Two settings of the ``zero`` section choose a format:

* ``zero.quantized_gradients`` (``off``, ``int8``, ``int4``): the data-parallel
  gradient reduction sends blockwise-quantized values through an all-to-all
  and every receiver dequantizes and sums in fp32 (never summing quantized
  integers). Stage 0's all-reduce becomes that reduce-scatter plus an
  all-gather of the summed chunk in the same format.
* ``zero.quantized_weights`` (``off``, ``int8``): the all-gather of updated
  parameters (stages 1-2 after every step, stage 3 before every use) sends
  quantized chunks. Every rank, the owner included, then computes with the
  same dequantized weights; the fp32 master partition stays exact.

``zero.quantization_block`` sets the elements per block (one fp32 scale
each). The format itself (:mod:`hybrid.kernels.quantize`) and its error bound
are in ``docs/compression.md``.

Three more settings cut the bytes that cross nodes:

* ``zero.hpz_partition_size`` (stage 3): a secondary copy of the parameters
  sharded over the ranks of one node, so backward re-gathers inside the node;
* ``optimizer.type = onebit_adam``: after ``optimizer.freeze_step`` AdamW
  steps the variance freezes and the momentum travels as 1-bit signs with
  error feedback (stages 0-2), :mod:`hybrid.zero.onebit`;
* ``optimizer.type = zero_one_adam`` (stage 0): 0/1 Adam, exact reductions
  only on ever rarer variance steps, 1-bit exchanges otherwise, then local
  steps synchronized by 1-bit exchanges, :mod:`hybrid.zero.zero_one_adam`.

This module is plain data, like :mod:`hybrid.layout`: configuration
validation and the planner read it without torch.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from hybrid.layout import STAGE_TRAITS, ZeroStage, stage_traits

OFF = "off"
# format name -> bits per value; ``off`` sends the tensors' own dtype
GRADIENT_FORMATS: Dict[str, int] = {OFF: 0, "int8": 8, "int4": 4}
WEIGHT_FORMATS: Dict[str, int] = {OFF: 0, "int8": 8}
DEFAULT_BLOCK = 256
SCALE_BYTES = 4  # one fp32 scale per block
BITS = (8, 4, 1)  # the codec's formats: int8, int4, 1-bit signs


def packed_bytes(numel: int, bits: int, block: int) -> int:
    """Bytes of ``numel`` values packed by :mod:`hybrid.kernels.quantize`: ``ceil(numel / block)`` whole blocks of
    ``block * bits / 8`` data bytes (the last one zero-padded), plus one fp32 scale per block."""
    return -(-numel // block) * (block * bits // 8 + SCALE_BYTES)


@dataclasses.dataclass(frozen=True)
class Quantization:
    """Blockwise symmetric quantization of a collective's payload: ``bits`` per value, ``block`` values per scale."""

    bits: int
    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"quantization bits must be one of {BITS}, got {self.bits!r}")
        problem = block_problem(self.block)
        if problem:
            raise ValueError(problem)

    def wire_bytes(self, numel: int) -> int:
        """Bytes of ``numel`` values once packed (:func:`packed_bytes`)."""
        return packed_bytes(numel, self.bits, self.block)

    def describe(self) -> str:
        return f"int{self.bits}/{self.block}"


def block_problem(block: int) -> Optional[str]:
    """Why ``block`` cannot be a quantization block (None when it can): 1-bit signs pack 8 to a byte."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 8 or block % 8:
        return f"a quantization block must be a positive multiple of 8 elements (1-bit signs pack 8 to a byte), got {block!r}"
    return None


def _format(kind: str, formats: Dict[str, int], value: str, block: int) -> Optional[Quantization]:
    if value not in formats:
        raise ValueError(f"zero.quantized_{kind} must be one of {', '.join(formats)}, got {value!r}")
    bits = formats[value]
    return Quantization(bits, block) if bits else None


def gradient_quantization(value: str, block: int = DEFAULT_BLOCK) -> Optional[Quantization]:
    """``zero.quantized_gradients`` as a :class:`Quantization` (None when ``off``)."""
    return _format("gradients", GRADIENT_FORMATS, value, block)


def weight_quantization(value: str, block: int = DEFAULT_BLOCK) -> Optional[Quantization]:
    """``zero.quantized_weights`` as a :class:`Quantization` (None when ``off``)."""
    return _format("weights", WEIGHT_FORMATS, value, block)


def quantized_weights_problem(stage: int, value: str) -> Optional[str]:
    """Why ``zero.quantized_weights`` cannot be used at ``stage`` (None when it can).

    Only a stage that all-gathers parameters has a weight collective to compress: stages 1-2 gather the updated
    partitions after each step, stage 3 gathers each unit before it is used.
    """
    if value == OFF:
        return None
    if not stage_traits(stage).optimizer_states:
        allowed = [str(int(s)) for s in ZeroStage if STAGE_TRAITS[s].optimizer_states]
        return (f"quantized weights need ZeRO stage {', '.join(allowed[:-1])} or {allowed[-1]}: stage "
                f"{int(stage)} keeps every weight on every rank and gathers none")
    return None


def compression_problem(stage: int, gradients: str, weights: str, block: int) -> Optional[Tuple[str, str]]:
    """The first problem of a ``zero`` section's compression settings, as (the key at fault, why); None when
    they can be used. Configuration validation and the optimizers both ask this."""
    if gradients not in GRADIENT_FORMATS:
        return "zero.quantized_gradients", f"it must be one of {', '.join(GRADIENT_FORMATS)}"
    if weights not in WEIGHT_FORMATS:
        return "zero.quantized_weights", f"it must be one of {', '.join(WEIGHT_FORMATS)}"
    if (gradients != OFF or weights != OFF) and block_problem(block):
        return "zero.quantization_block", block_problem(block)
    problem = quantized_weights_problem(stage, weights)
    if problem:
        return "zero.quantized_weights", problem
    return None


ONEBIT_ADAM = "onebit_adam"  # optimizer.type of the 1-bit compressed Adam
ZERO_ONE_ADAM = "zero_one_adam"  # optimizer.type of 0/1 Adam (1-bit, adaptive variance freezing, local steps)
# the 1-bit optimizers: each rank keeps its whole local gradient, and 1-bit exchanges replace reductions
ONE_BIT_OPTIMIZERS = (ONEBIT_ADAM, ZERO_ONE_ADAM)
ONEBIT_BITS = 1


def hpz_problem(stage: int, size: int) -> Optional[str]:
    """Why ``zero.hpz_partition_size`` cannot be ``size`` at ``stage`` (None when it can); 1 is off."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return f"it must be a positive number of data-parallel ranks (1: off), got {size!r}"
    if size > 1 and not stage_traits(stage).parameters:
        return ("a secondary weight partition needs ZeRO stage 3: only stage 3 gathers the parameters in "
                "backward; set zero.stage to 3 or zero.hpz_partition_size to 1")
    return None


def onebit_problem(stage: int, offload: str, two_level: bool, optimizer: str = ONEBIT_ADAM) -> Optional[Tuple[str, str]]:
    """Why a 1-bit optimizer (``optimizer.type`` onebit_adam or zero_one_adam) cannot run with these ``zero``
    settings, as (the key at fault, why); None when it can. 1-bit Adam exchanges the momentum of whole flat
    buffers (stages 0-2); 0/1 Adam also steps every rank on its own between exchanges, so each rank needs the
    whole optimizer state (stage 0)."""
    if optimizer == ZERO_ONE_ADAM and stage_traits(stage).optimizer_states:
        return "zero.stage", ("zero_one_adam takes local steps on every rank's whole optimizer state: it runs at "
                              "ZeRO stage 0; use stage 0 or optimizer.type onebit_adam")
    if stage_traits(stage).parameters:
        return "zero.stage", (f"{optimizer} composes with ZeRO stages 0-2 (every rank keeps whole buffers to "
                              "compress); use stage 2 or optimizer.type adamw")
    if offload != "none":
        return "zero.offload_optimizer", f"{optimizer} steps on the device; set zero.offload_optimizer to none"
    if two_level:
        return "zero.two_level_reduce", (f"{optimizer}'s compressed exchange crosses once over dp; set "
                                         "zero.two_level_reduce to false")
    return None


def formats_for_deepspeed() -> Tuple[str, str]:
    """What DeepSpeed's ``zero_quantized_gradients: true`` and ``zero_quantized_weights: true`` select.

    ZeRO++ sends gradients in 4 bits and weights in 8 bits; a ported config keeps those formats.
    """
    return "int4", "int8"
