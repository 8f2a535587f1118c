"""Loading the tokenizer a :class:`~hybrid.tokenizer_files.TokenizerSpec` names, and the same settings on a
tool's command line (``tools/preprocess_data.py``, ``hybrid.training.generate``)."""

from __future__ import annotations

from hybrid.tokenizer_files import TIKTOKEN_PATTERNS, TOKENIZER_TYPES, TokenizerSpec, flag_of, type_names


def load_tokenizer(spec: TokenizerSpec):
    """The tokenizer ``spec`` names (None when it names no file); raises ValueError when its files do not fit
    its type, and :class:`~hybrid.data.errors.DataError` for a file that is missing or not that tokenizer's."""
    found = spec.problem()
    if found is not None:
        raise ValueError(found[0])
    if not spec.given:
        return None
    if spec.tokenizer_type == "gpt2bpetokenizer":
        from .gpt2_bpe import GPT2BPETokenizer

        return GPT2BPETokenizer(spec.vocab_file, spec.merge_file)
    if spec.tokenizer_type == "tiktokenizer":
        from .tiktokenizer import TikTokenizer

        return TikTokenizer(spec.tokenizer_model, spec.tiktoken_pattern, spec.tiktoken_num_special_tokens)
    if spec.tokenizer_type == "huggingfacetokenizer":
        from .hf_tokenizer import HuggingFaceTokenizer

        return HuggingFaceTokenizer(spec.tokenizer_model)
    from .tokenizer import SentencePieceTokenizer

    return SentencePieceTokenizer(spec.tokenizer_model)


# ---- the same settings on a tool's command line -----------------------------------------------------
def add_tokenizer_arguments(parser, what: str) -> None:
    """``--tokenizer-type``, ``--tokenizer-model``, ``--vocab-file`` and ``--merge-file`` on an argparse parser
    (``what``: the tokenizer the tool wants, for the help)."""
    names = ",".join(type_names())
    parser.add_argument("--tokenizer-type", type=str.lower, choices=TOKENIZER_TYPES, default=None,
                        metavar="{" + names + "}", help=f"{what}: its type (default: GPT2BPETokenizer with "
                                                       f"--vocab-file/--merge-file, else SentencePieceTokenizer)")
    parser.add_argument("--tokenizer-model", help="SentencePieceTokenizer: the .model file; HuggingFaceTokenizer: "
                                                  "the model's folder (its tokenizer.json); TikTokenizer: the "
                                                  "vocabulary .json")
    parser.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    parser.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    parser.add_argument("--tiktoken-pattern", choices=TIKTOKEN_PATTERNS, default=None,
                        help="TikTokenizer (--tokenizer-model: Megatron's tiktoken vocabulary .json): its pattern")
    parser.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                        help="TikTokenizer: the special ids before the vocabulary's (default 1000, Megatron's)")


def spec_from_arguments(args) -> TokenizerSpec:
    """The :class:`TokenizerSpec` of arguments :func:`add_tokenizer_arguments` parsed; ValueError when none is
    given or the files do not fit the type."""
    spec = TokenizerSpec(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file,
                         args.tiktoken_pattern, args.tiktoken_num_special_tokens)
    if not spec.given:
        raise ValueError(f"give the tokenizer: {' and '.join(flag_of(s) for s in spec.files)} (--tokenizer-type "
                         f"{spec.name})")
    found = spec.problem()
    if found is not None:
        raise ValueError(found[0])
    return spec
