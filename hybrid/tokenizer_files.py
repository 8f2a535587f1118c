"""Which tokenizer a run reads, and from which files: the one rule the configuration, the trainer, the
preprocessing tool and text generation share (plain data; :mod:`hybrid.data.tokenizer_choice` loads them).

Megatron's spellings: ``--tokenizer-type SentencePieceTokenizer --tokenizer-model spm.model``;
``--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt``;
``--tokenizer-type HuggingFaceTokenizer --tokenizer-model MODEL_DIR`` (its ``tokenizer.json``);
``--tokenizer-type TikTokenizer --tokenizer-model VOCAB.json --tiktoken-pattern v2`` (Megatron's tiktoken
vocabulary, :mod:`hybrid.data.tiktokenizer`). Type names are
case-insensitive (kept lower-case, as every choice of the configuration).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Tuple

# each type, as Megatron spells it, and its files by the name of their setting (config key data.<name>, flag
# --<name with dashes>)
_TYPES = {"SentencePieceTokenizer": ("tokenizer_model",), "GPT2BPETokenizer": ("vocab_file", "merge_file"),
          "HuggingFaceTokenizer": ("tokenizer_model",), "TikTokenizer": ("tokenizer_model",)}
TIKTOKEN_PATTERNS = ("v1", "v2")  # Megatron's --tiktoken-pattern choices (hybrid.data.tiktokenizer holds them)
TOKENIZER_FILES: Mapping[str, Tuple[str, ...]] = MappingProxyType({n.lower(): f for n, f in _TYPES.items()})
TOKENIZER_TYPES = tuple(TOKENIZER_FILES)
_NAMES = {name.lower(): name for name in _TYPES}
_SETTINGS = tuple(dict.fromkeys(s for files in TOKENIZER_FILES.values() for s in files))  # each file setting once


def flag_of(setting: str) -> str:
    """``vocab_file`` -> ``--vocab-file``."""
    return "--" + setting.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer type and its files (unset files: no tokenizer, as with mock data). An unset type is the one
    the files given say: GPT2BPETokenizer for a vocabulary or merges file (as Megatron's GPT-2 scripts give
    them, with no type), else SentencePieceTokenizer; HuggingFaceTokenizer is always named."""

    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tiktoken_pattern: Optional[str] = None  # TikTokenizer: its pre-tokenizer, one of TIKTOKEN_PATTERNS
    tiktoken_num_special_tokens: int = 1000  # TikTokenizer: the ids before the vocabulary's (Megatron's default)

    def __post_init__(self):
        kind = self.tokenizer_type
        if kind is None:
            kind = "gpt2bpetokenizer" if self.vocab_file is not None or self.merge_file is not None \
                else "sentencepiecetokenizer"
        object.__setattr__(self, "tokenizer_type", str(kind).lower())

    @property
    def name(self) -> str:
        """The type as Megatron spells it (``GPT2BPETokenizer``)."""
        return _NAMES.get(self.tokenizer_type, self.tokenizer_type)

    @property
    def files(self) -> Tuple[str, ...]:
        """The settings this type reads its files from."""
        return TOKENIZER_FILES[self.tokenizer_type]

    @property
    def given(self) -> bool:
        """Whether any tokenizer file is set."""
        return any(getattr(self, s) is not None for s in _SETTINGS)

    def problem(self, name_of: Callable[[str], str] = flag_of) -> Optional[Tuple[str, Tuple[str, ...]]]:
        """``(message, settings)`` when the files set do not fit the type: a file another type reads, or only
        some of this type's files; None when they fit (none at all fits too). ``name_of`` names a setting in the
        message (default: its flag)."""
        kind = name_of("tokenizer_type")
        if self.tokenizer_type not in TOKENIZER_FILES:
            return f"{kind} must be one of {', '.join(_NAMES.values())}, got {self.tokenizer_type!r}", \
                ("tokenizer_type",)
        mine = " and ".join(name_of(s) for s in self.files)
        foreign = [s for s in _SETTINGS if s not in self.files and getattr(self, s) is not None]
        if foreign:
            owners = " or ".join(_NAMES[t] for t, files in TOKENIZER_FILES.items() if foreign[0] in files)
            return (f"{name_of(foreign[0])} is a file of {owners}, but {kind} is {self.name}; set {kind} to "
                    f"{owners}, or give {mine}", (foreign[0], "tokenizer_type"))
        if self.tokenizer_type == "tiktokenizer" and self.given and self.tiktoken_pattern not in TIKTOKEN_PATTERNS:
            return (f"{self.name} splits text by Megatron's pattern before its merges: give "
                    f"{name_of('tiktoken_pattern')} {' or '.join(TIKTOKEN_PATTERNS)}", ("tiktoken_pattern",))
        missing = [s for s in self.files if getattr(self, s) is None]
        if self.given and missing:
            return (f"{self.name} reads {mine}; {', '.join(name_of(s) for s in missing)} is missing",
                    tuple(missing))
        return None


def type_names() -> tuple:
    """The types as Megatron spells them, in :data:`TOKENIZER_TYPES` order."""
    return tuple(_TYPES)
