"""A SentencePiece ``.model`` as a Hugging Face ``tokenizer.json`` that encodes text to the same ids.

``transformers`` 5 maps a folder holding only ``tokenizer.model`` to a class that rebuilds a fixed pipeline:
``LlamaTokenizer`` has no normalizer, so a model trained with SentencePiece's default ``nmt_nfkc`` rule and
whitespace clean-up (what ``tools/train_tokenizer.py`` trains) encodes most texts differently (4643 of the 6783
documents of the demo's corpus; a newline, a double space, a ligature). The pipeline here follows the model's own
settings, read from its protobuf (:func:`read_model`, no ``protobuf`` package needed):

* normalizer, in SentencePiece's order: the precompiled character map (NFKC and friends), removal of leading,
  trailing and repeated spaces, the dummy-prefix space, spaces escaped as ``▁``;
* pre-tokenizer: user-defined pieces isolated (SentencePiece emits them whole and never merges them);
* model: BPE with the merges ranked by the score of the piece each makes (SentencePiece merges the pair whose
  result scores highest), or Unigram with the pieces' scores; byte fallback and the unknown piece as the model's;
* decoder: ``▁`` back to spaces, byte pieces back to bytes, the dummy prefix dropped.

Control pieces (``<s>``, ``</s>``) are special added tokens. SentencePiece itself never reads them out of a
text, so ``tokenizer_config.json`` sets ``split_special_tokens`` (:mod:`hybrid.convert.hf_tokenizer_files`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from typing import Dict, Iterator, List, Optional, Tuple

# SentencePiece's sentencepiece_model.proto: field numbers and proto2 defaults of what encoding reads
_MODEL_PIECES, _MODEL_TRAINER, _MODEL_NORMALIZER = 1, 2, 3
_PIECE_TEXT, _PIECE_SCORE, _PIECE_TYPE = 1, 2, 3
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_UNIGRAM, _BPE = 1, 2
_MODEL_TYPE_NAMES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}
# TrainerSpec: number -> (name, default)
_TRAINER_FIELDS = {3: ("model_type", _UNIGRAM), 24: ("treat_whitespace_as_suffix", False),
                   35: ("byte_fallback", False), 40: ("unk_id", 0), 41: ("bos_id", 1), 42: ("eos_id", 2),
                   43: ("pad_id", -1), 45: ("unk_piece", "<unk>"), 46: ("bos_piece", "<s>"),
                   47: ("eos_piece", "</s>"), 48: ("pad_piece", "<pad>")}
_NORMALIZER_FIELDS = {1: ("name", ""), 2: ("precompiled_charsmap", b""), 3: ("add_dummy_prefix", True),
                      4: ("remove_extra_whitespaces", True), 5: ("escape_whitespaces", True)}
SPACE = "\u2581"  # SentencePiece's visible space


class NotSentencePiece(ValueError):
    """The bytes are not a SentencePiece model this module can read, or one it cannot reproduce (the message
    says which setting)."""


# ---- protobuf wire format -------------------------------------------------------------------------------------
def _varint(data: bytes, pos: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise NotSentencePiece("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def _fields(data: bytes) -> Iterator[Tuple[int, int, object]]:
    """``(field number, wire type, value)`` of each field of one message: an int for varints, bytes for
    length-delimited fields, the 4 or 8 raw bytes of fixed-width ones."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos: pos + size], pos + size
            if len(value) != size:
                raise NotSentencePiece("truncated field")
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            value, pos = data[pos: pos + width], pos + width
            if len(value) != width:
                raise NotSentencePiece("truncated field")
        else:
            raise NotSentencePiece(f"wire type {wire}")
        yield number, wire, value


def _signed(value: int) -> int:
    """An int32 field: negative values travel as 64-bit two's complement."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _settings(data: bytes, spec: Dict[int, Tuple[str, object]]) -> Dict[str, object]:
    out = {name: default for name, default in spec.values()}
    for number, wire, value in _fields(data):
        if number not in spec:
            continue
        name, default = spec[number]
        if isinstance(default, bool):
            out[name] = bool(value)
        elif isinstance(default, int):
            out[name] = _signed(value)
        elif isinstance(default, str):
            out[name] = bytes(value).decode("utf-8")
        else:
            out[name] = bytes(value)
    return out


@dataclasses.dataclass(frozen=True)
class SentencePieceModel:
    """What encoding needs from a ``.model``: ``pieces[i] = (text, score, type)`` for id ``i``, and the
    trainer's and normalizer's settings by their proto names."""

    pieces: Tuple[Tuple[str, float, int], ...]
    trainer: Dict[str, object]
    normalizer: Dict[str, object]

    def special(self, name: str) -> Optional[str]:
        """The text of piece ``name`` (``unk``, ``bos``, ``eos``, ``pad``), None when the model has none."""
        i = self.trainer[f"{name}_id"]
        return self.pieces[i][0] if 0 <= i < len(self.pieces) else None

    def special_id(self, name: str) -> Optional[int]:
        i = self.trainer[f"{name}_id"]
        return i if 0 <= i < len(self.pieces) else None


def read_model(data: bytes) -> SentencePieceModel:
    """Parse a serialized ``ModelProto``; NotSentencePiece when it is none."""
    pieces: List[Tuple[str, float, int]] = []
    trainer = normalizer = b""
    for number, wire, value in _fields(data):
        if number == _MODEL_PIECES and wire == 2:
            text, score, kind = "", 0.0, NORMAL
            for n, w, v in _fields(value):
                if n == _PIECE_TEXT and w == 2:
                    text = bytes(v).decode("utf-8")
                elif n == _PIECE_SCORE and w == 5:
                    score = struct.unpack("<f", v)[0]
                elif n == _PIECE_TYPE and w == 0:
                    kind = v
            pieces.append((text, score, kind))
        elif number == _MODEL_TRAINER and wire == 2:
            trainer = value
        elif number == _MODEL_NORMALIZER and wire == 2:
            normalizer = value
    if not pieces:
        raise NotSentencePiece("no pieces")
    return SentencePieceModel(tuple(pieces), _settings(trainer, _TRAINER_FIELDS),
                              _settings(normalizer, _NORMALIZER_FIELDS))


# ---- the tokenizers pipeline ----------------------------------------------------------------------------------
def bpe_merges(model: SentencePieceModel) -> List[Tuple[str, str]]:
    """Every pair of normal pieces that joins into a normal piece, best first: by the joined piece's score
    (higher first), then its id, as SentencePiece's BPE picks the pair to merge."""
    normal = {text: (score, i) for i, (text, score, kind) in enumerate(model.pieces) if kind == NORMAL}
    ranked = []
    for text, (score, i) in normal.items():
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in normal and right in normal:
                ranked.append((-score, i, left, right))
    return [(left, right) for _, _, left, right in sorted(ranked)]


def tokenizer_json(model: SentencePieceModel) -> str:
    """The ``tokenizer.json`` text of ``model``; NotSentencePiece naming a setting it cannot reproduce."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    trainer, spec = model.trainer, model.normalizer
    kind = trainer["model_type"]
    if kind not in (_BPE, _UNIGRAM):
        raise NotSentencePiece(f"model_type {_MODEL_TYPE_NAMES.get(kind, kind)} (only bpe and unigram convert)")
    if trainer["treat_whitespace_as_suffix"]:
        raise NotSentencePiece("treat_whitespace_as_suffix is set (the converted pipeline puts the space first)")
    byte_fallback = bool(trainer["byte_fallback"])
    unk = model.special("unk")
    if kind == _BPE:
        vocab = {text: i for i, (text, _, _) in enumerate(model.pieces)}
        if len(vocab) != len(model.pieces):
            raise NotSentencePiece("two pieces share one text")
        user_defined = any(k == USER_DEFINED for _, _, k in model.pieces)
        tok = Tokenizer(models.BPE(vocab=vocab, merges=bpe_merges(model), unk_token=unk, fuse_unk=True,
                                   byte_fallback=byte_fallback, ignore_merges=user_defined))
    else:
        tok = Tokenizer(models.Unigram([(text, score) for text, score, _ in model.pieces],
                                       unk_id=model.special_id("unk"), byte_fallback=byte_fallback))
    steps = []
    if spec["precompiled_charsmap"]:
        steps.append(normalizers.Precompiled(spec["precompiled_charsmap"]))
    if spec["remove_extra_whitespaces"]:  # spaces only: other whitespace is the character map's business
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    space = SPACE if spec["escape_whitespaces"] else " "
    if spec["add_dummy_prefix"]:  # always, even before a text that starts with a space (Metaspace would not)
        steps.append(normalizers.Prepend(" "))
    if spec["escape_whitespaces"]:
        steps.append(normalizers.Replace(" ", SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    user = [text for text, _, k in model.pieces if k == USER_DEFINED]
    if user:
        pattern = "|".join(re.escape(t) for t in sorted(user, key=len, reverse=True))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    back = [decoders.Replace(SPACE, " ")] if space == SPACE else []
    if byte_fallback:
        back.append(decoders.ByteFallback())
    back.append(decoders.Fuse())
    if spec["add_dummy_prefix"]:
        back.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(back)
    control = [(i, text) for i, (text, _, k) in enumerate(model.pieces) if k in (CONTROL, UNKNOWN)]
    tok.add_special_tokens([AddedToken(text, special=True, normalized=False) for _, text in control])
    for i, text in control:  # added tokens keep the model's ids (they are pieces of it already)
        if tok.token_to_id(text) != i:
            raise NotSentencePiece(f"control piece {text!r} does not keep id {i}")
    return json.dumps(json.loads(tok.to_str()), ensure_ascii=False, indent=2)

