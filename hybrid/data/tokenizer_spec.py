"""Which tokenizer a run reads, and from which files: the one rule the trainer, the preprocessing tool and text
generation share.

Megatron's spellings: ``--tokenizer-type SentencePieceTokenizer --tokenizer-model spm.model``, or
``--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt``. Type names are
case-insensitive (kept lower-case, as every choice of the configuration).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Tuple

# each type's files, by the name of their setting (config key data.<name>, flag --<name with dashes>)
TOKENIZER_FILES: Mapping[str, Tuple[str, ...]] = MappingProxyType({
    "sentencepiecetokenizer": ("tokenizer_model",),
    "gpt2bpetokenizer": ("vocab_file", "merge_file"),
})
TOKENIZER_TYPES = tuple(TOKENIZER_FILES)
_NAMES = {"sentencepiecetokenizer": "SentencePieceTokenizer", "gpt2bpetokenizer": "GPT2BPETokenizer"}


def flag_of(setting: str) -> str:
    """``vocab_file`` -> ``--vocab-file``."""
    return "--" + setting.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer type and its files (unset files: no tokenizer, as with mock data)."""

    tokenizer_type: str = "sentencepiecetokenizer"
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None

    def __post_init__(self):
        object.__setattr__(self, "tokenizer_type", str(self.tokenizer_type).lower())

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
        return any(getattr(self, s) is not None for files in TOKENIZER_FILES.values() for s in files)

    def problem(self, name_of: Callable[[str], str] = flag_of) -> Optional[Tuple[str, Tuple[str, ...]]]:
        """``(message, settings)`` when the files set do not fit the type: a file another type reads, or only
        some of this type's files; None when they fit (none at all fits too). ``name_of`` names a setting in the
        message (default: its flag)."""
        kind = name_of("tokenizer_type")
        if self.tokenizer_type not in TOKENIZER_FILES:
            return f"{kind} must be one of {', '.join(_NAMES.values())}, got {self.tokenizer_type!r}", \
                ("tokenizer_type",)
        mine = " and ".join(name_of(s) for s in self.files)
        foreign = [s for files in TOKENIZER_FILES.values() for s in files
                   if s not in self.files and getattr(self, s) is not None]
        if foreign:
            owner = _NAMES[next(t for t, files in TOKENIZER_FILES.items() if foreign[0] in files)]
            return (f"{name_of(foreign[0])} is a file of {owner}, but {kind} is {self.name}; set {kind} to {owner}, "
                    f"or give {mine}", (foreign[0], "tokenizer_type"))
        missing = [s for s in self.files if getattr(self, s) is None]
        if self.given and missing:
            return (f"{self.name} reads {mine}; {', '.join(name_of(s) for s in missing)} is missing",
                    tuple(missing))
        return None

    def load(self):
        """The tokenizer (None when no file is set); raises ValueError for :meth:`problem`, and
        :class:`~hybrid.data.errors.DataError` for a file that is missing or not a tokenizer."""
        found = self.problem()
        if found is not None:
            raise ValueError(found[0])
        if not self.given:
            return None
        if self.tokenizer_type == "gpt2bpetokenizer":
            from .gpt2_bpe import GPT2BPETokenizer

            return GPT2BPETokenizer(self.vocab_file, self.merge_file)
        from .tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer(self.tokenizer_model)


# ---- the same settings on a tool's command line -----------------------------------------------------
def add_tokenizer_arguments(parser, what: str) -> None:
    """``--tokenizer-type``, ``--tokenizer-model``, ``--vocab-file`` and ``--merge-file`` on an argparse parser
    (``what``: the tokenizer the tool wants, for the help)."""
    names = ",".join(_NAMES.values())
    parser.add_argument("--tokenizer-type", type=str.lower, choices=TOKENIZER_TYPES, default=TOKENIZER_TYPES[0],
                        metavar="{" + names + "}", help=f"{what}: its type (default SentencePieceTokenizer)")
    parser.add_argument("--tokenizer-model", help="SentencePieceTokenizer: the .model file")
    parser.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    parser.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")


def spec_from_arguments(args) -> TokenizerSpec:
    """The :class:`TokenizerSpec` of arguments :func:`add_tokenizer_arguments` parsed; ValueError when none is
    given or the files do not fit the type."""
    spec = TokenizerSpec(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file)
    if not spec.given:
        raise ValueError(f"give the tokenizer: {' and '.join(flag_of(s) for s in spec.files)} (--tokenizer-type "
                         f"{spec.name})")
    found = spec.problem()
    if found is not None:
        raise ValueError(found[0])
    return spec
