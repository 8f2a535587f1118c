"""The tokenizer files ``to-hf`` writes beside the weights, in the names ``transformers`` reads, so that
``AutoTokenizer.from_pretrained(export)`` encodes text to the ids the run trained on:

* SentencePiece (``--tokenizer-model spm.model``): ``tokenizer.model`` (the run's bytes), ``tokenizer.json``
  converted from it (:mod:`hybrid.convert.hf_sentencepiece`) and ``tokenizer_config.json`` naming
  ``PreTrainedTokenizerFast``. Not ``LlamaTokenizer``: in ``transformers`` 5 that class rebuilds a fixed pipeline
  with no normalizer, which encodes text differently from a model trained with SentencePiece's default ``nmt_nfkc``
  rule; and a folder with ``tokenizer.model`` alone became a GPT-2 tokenizer (the ``config.json``'s model type);
* GPT-2's byte-level BPE (``--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file``): ``vocab.json``,
  ``merges.txt``, the same pipeline as ``tokenizer.json`` and ``tokenizer_config.json`` naming ``GPT2Tokenizer``;
* a model folder's tokenizer (``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``):
  ``tokenizer.json`` and its ``tokenizer_config.json`` as they are, with ``tokenizer_class`` added when it names
  none (``transformers`` would otherwise pick the class of ``config.json``'s model type).

The configuration names the BOS, EOS (the run's end-of-document), unknown and pad tokens (pad: the tokenizer's own,
else EOS), adds no BOS or EOS the run's encoding does not add, and reads ``<s>`` or ``<|endoftext|>`` inside a text
as text where the run's tokenizer does (``split_special_tokens``). Their ids go to ``config.json`` and
``generation_config.json`` (:attr:`TokenizerExport.token_ids`), so ``generate`` stops at the end of a document.

Every file is checked before any weight is written: the written bytes load as the run's tokenizer type, it has an
end-of-document token, and every id fits the model's vocabulary. Only files the user names are read: never a path
a checkpoint records.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Dict, Optional

from hybrid.convert.consolidate import ConversionError
from hybrid.data.gpt2_bpe import EOD_TOKEN, MERGES_FILE, VOCAB_FILE
from hybrid.data.hf_tokenizer import TOKENIZER_CONFIG, TOKENIZER_JSON, model_files
from hybrid.data.hf_tokenizer import _token_text as token_text
from hybrid.tokenizer_files import TokenizerSpec, flag_of

SENTENCEPIECE_FILE = "tokenizer.model"
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")  # config.json's and generation_config.json's
FAST_CLASS = "PreTrainedTokenizerFast"  # the class that takes tokenizer.json as it is, in transformers 4 and 5


@dataclasses.dataclass(frozen=True)
class TokenizerExport:
    """``files``: ``{file name in the HF directory: its bytes}``; ``token_ids``: ``{bos_token_id, eos_token_id,
    pad_token_id: id or None}`` of that tokenizer, for ``config.json`` and ``generation_config.json``."""

    files: Dict[str, bytes]
    token_ids: Dict[str, Optional[int]]


def tokenizer_files(spec: TokenizerSpec, vocab_size: int, model_max_length: Optional[int] = None) -> TokenizerExport:
    """The files and token ids of the tokenizer ``spec`` names, once the files have loaded as that tokenizer and
    fit ``vocab_size``; ConversionError naming the flag otherwise. ``model_max_length``: the model's positions,
    recorded in ``tokenizer_config.json``."""
    found = spec.problem()
    if found is not None:
        raise ConversionError(found[0])
    flags = " / ".join(f"{flag_of(s)} {getattr(spec, s)}" for s in spec.files)
    files = {name: _read(path, flag) for name, (path, flag) in _sources(spec).items()}
    with tempfile.TemporaryDirectory() as folder:  # load what will be written, not the originals again
        for name, data in files.items():
            Path(folder, name).write_bytes(data)
        tokenizer = _load(spec, folder, flags)
        size = tokenizer.vocab_size
        if size > vocab_size:
            raise ConversionError(f"{flags}: the tokenizer has {size} tokens but the model's vocabulary holds "
                                  f"{vocab_size}; pass the tokenizer the run was trained with")
        files, ids = _hf_files(spec, files, tokenizer, flags)
        for name, data in files.items():  # the added files must load too (as transformers will read them)
            Path(folder, name).write_bytes(data)
        _check_loads(folder, flags)
    if model_max_length is not None:
        config = json.loads(files[TOKENIZER_CONFIG])
        config.setdefault("model_max_length", model_max_length)
        files[TOKENIZER_CONFIG] = _json_bytes(config)
    return TokenizerExport(files, ids)


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


def _json_bytes(value: dict) -> bytes:
    return (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode()


def _load(spec: TokenizerSpec, folder: str, flags: str):
    """The run's tokenizer, from the files in ``folder`` (HF names), checked to end documents."""
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
        local = TokenizerSpec(spec.tokenizer_type, tokenizer_model=os.path.join(folder, SENTENCEPIECE_FILE))
    elif spec.tokenizer_type == "gpt2bpetokenizer":
        local = TokenizerSpec(spec.tokenizer_type, vocab_file=os.path.join(folder, VOCAB_FILE),
                              merge_file=os.path.join(folder, MERGES_FILE))
    else:
        local = TokenizerSpec(spec.tokenizer_type, tokenizer_model=folder)
    try:
        tokenizer = load_tokenizer(local)
        _ = tokenizer.eod_id  # a tokenizer that cannot end a document is no tokenizer to train with
        return tokenizer
    except DataError as e:  # its message names the copy's files: by their names alone
        raise ConversionError(f"{flags}: not a {spec.name} tokenizer ({str(e).replace(folder + os.sep, '')})") \
            from None


def _hf_files(spec: TokenizerSpec, files: Dict[str, bytes], tokenizer, flags: str):
    """``(files with the ones transformers needs added, {bos_token_id, eos_token_id, pad_token_id: id or None})``.
    The ids are the run's tokenizer's: EOS its end of document, pad its own pad token or else EOS."""
    eod = tokenizer.eod_id
    if spec.tokenizer_type == "sentencepiecetokenizer":
        from hybrid.convert.hf_sentencepiece import NotSentencePiece, read_model, tokenizer_json

        try:
            model = read_model(files[SENTENCEPIECE_FILE])
            text = tokenizer_json(model)
        except NotSentencePiece as e:
            raise ConversionError(f"{flags}: this SentencePiece model cannot be written as a {TOKENIZER_JSON} "
                                  f"that encodes as it does ({e})") from None
        ids = {"bos_token_id": model.special_id("bos"), "eos_token_id": eod,
               "pad_token_id": eod if model.special_id("pad") is None else model.special_id("pad")}
        tokens = {role: model.pieces[i][0] for role, i in (("bos_token", ids["bos_token_id"]), ("eos_token", eod),
                                                            ("unk_token", model.special_id("unk")),
                                                            ("pad_token", ids["pad_token_id"])) if i is not None}
        # The run encodes a document with no BOS or EOS and reads "<s>" in a text as text
        config = {"tokenizer_class": FAST_CLASS, **tokens, "add_bos_token": False, "add_eos_token": False,
                  "split_special_tokens": True, "clean_up_tokenization_spaces": False}
        return {**files, TOKENIZER_JSON: text.encode(), TOKENIZER_CONFIG: _json_bytes(config)}, ids
    backend = tokenizer._tok  # the tokenizers pipeline the run encodes with (hybrid.data.library_tokenizer)
    if spec.tokenizer_type == "gpt2bpetokenizer":
        # GPT-2's one special token ends documents, begins them and pads; the run reads it in a text as text
        tokens = dict.fromkeys(("bos_token", "eos_token", "unk_token", "pad_token"), EOD_TOKEN)
        config = {"tokenizer_class": "GPT2Tokenizer", **tokens, "add_bos_token": False, "add_prefix_space": False,
                  "split_special_tokens": True, "clean_up_tokenization_spaces": False}
        files = {**files, TOKENIZER_JSON: backend.to_str(pretty=True).encode(), TOKENIZER_CONFIG: _json_bytes(config)}
        return files, dict.fromkeys(TOKEN_ID_KEYS, eod)
    config = json.loads(files[TOKENIZER_CONFIG])  # present: the run's tokenizer read its eos_token from it
    bos, pad = (token_text(config.get(key)) for key in ("bos_token", "pad_token"))
    ids = {"bos_token_id": None if bos is None else backend.token_to_id(bos), "eos_token_id": eod,
           "pad_token_id": eod if pad is None else backend.token_to_id(pad)}
    if not config.get("tokenizer_class"):
        files = {**files, TOKENIZER_CONFIG: _json_bytes({**config, "tokenizer_class": FAST_CLASS})}
    return files, ids


def _check_loads(folder: str, flags: str) -> None:
    """The written ``tokenizer.json`` parses (what every ``transformers`` class reads first)."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(os.path.join(folder, TOKENIZER_JSON))
    except Exception as e:  # the library raises its own exception type
        raise ConversionError(f"{flags}: the {TOKENIZER_JSON} written for it does not load ({e})") from None
