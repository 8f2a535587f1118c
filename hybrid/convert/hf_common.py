"""What an architecture map (:mod:`~hybrid.convert.hf_gpt2`, the families of :mod:`~hybrid.convert.hf_llama` and
:mod:`~hybrid.convert.hf_moe`) provides.

A map relates the *full* (TP-merged, unpadded) hybrid state of a
:class:`model_zoo.GPTModel` to a Hugging Face ``transformers`` state dict,
tensor by tensor, with :class:`Link` records. Each map module defines:

* ``ARCHITECTURE`` / ``MODEL_TYPE``: the ``config.json`` names;
* ``mismatches(config) -> list[str]``: why a :class:`GPTConfig` is not of
  this family (empty when it is);
* ``hf_config(config, dtype_name) -> dict``: the ``config.json`` contents;
* ``config_from_hf(hf, where) -> GPTConfig``: the reverse, refusing HF
  settings hybrid cannot reproduce;
* ``links(config) -> list[Link]``;
* ``ignored(name, config) -> bool``: HF tensors that carry no information
  of their own (a tied head, old attention-mask buffers).

and may define (the MoE families do):

* ``adapt(hf_directory, config)``: present other namings HF reads of the
  same tensors under the names ``links`` uses (``HFDirectory.alias``);
* ``buffers(config) -> dict[str, Tensor]``: what import writes for the
  model's persistent buffers (checked against ``GPTModel``'s);
* ``unexported(name, config) -> bool``: saved hybrid tensors export leaves
  out because the HF model computes without them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

from hybrid.convert.consolidate import ConversionError


@dataclasses.dataclass(frozen=True)
class Link:
    """One hybrid tensor and the HF tensors it is made of.

    The hybrid tensor is the HF tensors concatenated along dim 0 (``[q; k; v]``
    from three projections), each one transposed first when ``transpose``
    (GPT-2's ``Conv1D`` stores ``[in, out]``; hybrid linear layers ``[out, in]``).
    ``rows``: how many rows of the hybrid tensor each HF tensor makes (None:
    equal shares; grouped-query attention has smaller k and v).
    """

    hybrid: str
    hf: Tuple[str, ...]
    transpose: bool = False
    rows: Optional[Tuple[int, ...]] = None
    # added to the hybrid tensor to make the HF one: 1 for a zero-centred norm weight (apply_layernorm_1p stores
    # gamma - 1; Hugging Face's norms store gamma itself)
    offset: float = 0.0

    def row_range(self, index: int, total: int) -> Tuple[int, int]:
        """Rows ``[lo, hi)`` of the hybrid tensor (``total`` rows) that HF tensor ``index`` makes."""
        sizes = self.rows or (total // len(self.hf),) * len(self.hf)
        if sum(sizes) != total:
            raise ConversionError(f"{self.hybrid}: {total} rows cannot be cut into {list(sizes)}")
        lo = sum(sizes[:index])
        return lo, lo + sizes[index]


def norm_weight(cfg, hybrid: str, hf: str) -> Link:
    """The link of a norm's weight ``[h]``: exported as ``1 + weight`` when ``cfg.apply_layernorm_1p`` (the model
    stores gamma - 1), as stored otherwise."""
    return Link(hybrid, (hf,), offset=1.0 if cfg.apply_layernorm_1p else 0.0)


def require(hf: Dict[str, Any], key: str, where: str) -> Any:
    """``hf[key]``, or a :class:`ConversionError` naming the key and the file."""
    if key not in hf or hf[key] is None:
        raise ConversionError(f"{where} lacks {key!r}, which is needed to build the model")
    return hf[key]


_REQUIRED = object()  # the default of a setting the model cannot be built without
# config.json's value types, as JSON spells them: what each accepts (a JSON true is no integer, 128.0 no size)
_KINDS = {"an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "true or false": lambda v: isinstance(v, bool)}


def setting(hf: Dict[str, Any], key: str, where: str, kind: str, default: Any = _REQUIRED) -> Any:
    """``hf[key]`` checked to be of ``kind`` (a key of :data:`_KINDS`: ``"an integer"``, ``"a number"``,
    ``"true or false"``); ``default`` when it is absent or null (an error naming the key when it is required).

    A value of another type is refused here, naming the file, the key and the type expected: converted later it
    would fail far from its cause (``float("tiny")``) or be blamed on a flag (a hidden size of ``128.0``
    "cannot be split over --tp").
    """
    value = hf.get(key)
    if value is None:
        return require(hf, key, where) if default is _REQUIRED else default
    if not _KINDS[kind](value):
        raise ConversionError(f"{where}: {key} is {value!r} ({_json_type(value)}), expected {kind}; fix that key "
                              f"of the file")
    return float(value) if kind == "a number" else value


def _json_type(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a JSON number with a point", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def refuse(where: str, key: str, value: Any, why: str) -> ConversionError:
    return ConversionError(f"{where}: {key}={value!r} is not supported ({why})")
