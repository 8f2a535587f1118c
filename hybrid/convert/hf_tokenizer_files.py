"""The tokenizer files ``to-hf`` writes beside the weights, in the names ``transformers`` reads, each checked
(it loads as its type's tokenizer, and every id fits the model's vocabulary) before any weight is written:

* SentencePiece (``--tokenizer-model spm.model``): ``tokenizer.model``;
* GPT-2's byte-level BPE (``--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file``): ``vocab.json`` and
  ``merges.txt``;
* a model folder's tokenizer (``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``):
  ``tokenizer.json`` and, when it has one, ``tokenizer_config.json``.

The bytes checked are the bytes written. Only files the user names are read: never a path a checkpoint records.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Dict

from hybrid.convert.consolidate import ConversionError
from hybrid.data.gpt2_bpe import MERGES_FILE, VOCAB_FILE
from hybrid.data.hf_tokenizer import TOKENIZER_CONFIG, TOKENIZER_JSON, model_files
from hybrid.tokenizer_files import TokenizerSpec, flag_of

SENTENCEPIECE_FILE = "tokenizer.model"


def tokenizer_files(spec: TokenizerSpec, vocab_size: int) -> Dict[str, bytes]:
    """``{file name in the HF directory: its bytes}`` for the tokenizer ``spec`` names, once they have loaded as
    that tokenizer and fit ``vocab_size``; ConversionError naming the flag otherwise."""
    found = spec.problem()
    if found is not None:
        raise ConversionError(found[0])
    flags = " / ".join(f"{flag_of(s)} {getattr(spec, s)}" for s in spec.files)
    files = {name: _read(path, flag) for name, (path, flag) in _sources(spec).items()}
    with tempfile.TemporaryDirectory() as folder:  # load what will be written, not the originals again
        for name, data in files.items():
            Path(folder, name).write_bytes(data)
        size = _loaded_size(spec, folder, flags)
    if size > vocab_size:
        raise ConversionError(f"{flags}: the tokenizer has {size} tokens but the model's vocabulary holds "
                              f"{vocab_size}; pass the tokenizer the run was trained with")
    return files


def _sources(spec: TokenizerSpec) -> Dict[str, tuple]:
    """``{file name in the HF directory: (source path, its flag)}``."""
    if spec.tokenizer_type == "gpt2bpetokenizer":
        return {VOCAB_FILE: (spec.vocab_file, "--vocab-file"), MERGES_FILE: (spec.merge_file, "--merge-file")}
    if spec.tokenizer_type == "huggingfacetokenizer":
        json_path, config_path = model_files(spec.tokenizer_model)
        out = {TOKENIZER_JSON: (json_path, "--tokenizer-model")}
        if os.path.isfile(config_path):
            out[TOKENIZER_CONFIG] = (config_path, "--tokenizer-model")
        return out
    return {SENTENCEPIECE_FILE: (spec.tokenizer_model, "--tokenizer-model")}


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConversionError(f"{flag} {path}: {e.strerror or e}") from None


def _loaded_size(spec: TokenizerSpec, folder: str, flags: str) -> int:
    """The vocabulary size of the tokenizer the files in ``folder`` (HF names) make."""
    from hybrid.data.errors import DataError
    from hybrid.data.tokenizer_choice import load_tokenizer

    if spec.tokenizer_type == "sentencepiecetokenizer":
        import sentencepiece

        data = Path(folder, SENTENCEPIECE_FILE).read_bytes()
        try:
            # An empty file "loads" as a model of no pieces, hence the check for pieces as well.
            pieces = sentencepiece.SentencePieceProcessor(model_proto=data).get_piece_size() if data else 0
        except (RuntimeError, TypeError, ValueError):
            pieces = 0
        if pieces == 0:
            raise ConversionError(f"{flags} is not a SentencePiece model (it does not load as one); pass the "
                                  f".model file the run was trained with")
        return pieces
    if spec.tokenizer_type == "gpt2bpetokenizer":
        local = TokenizerSpec(spec.tokenizer_type, vocab_file=os.path.join(folder, VOCAB_FILE),
                              merge_file=os.path.join(folder, MERGES_FILE))
    else:
        local = TokenizerSpec(spec.tokenizer_type, tokenizer_model=folder)
    try:
        tokenizer = load_tokenizer(local)
        _ = tokenizer.eod_id  # a tokenizer that cannot end a document is no tokenizer to train with
        return tokenizer.vocab_size
    except DataError as e:  # its message names the copy's files: by their names alone
        raise ConversionError(f"{flags}: not a {spec.name} tokenizer ({str(e).replace(folder + os.sep, '')})") \
            from None
