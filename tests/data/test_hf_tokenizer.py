"""``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``: a model folder's ``tokenizer.json`` and
``tokenizer_config.json``, read offline, encode and end documents as ``transformers`` does with the same folder.

The folder is made here in the shape Llama 3's ships: a byte-level BPE whose template puts ``<|begin_of_text|>``
first, and ``<|end_of_text|>`` as the configured eos token.
"""

import json

import numpy as np
import pytest

from hybrid.data import IndexedDataset, preprocess
from hybrid.data.errors import DataError, DataFileNotFoundError
from hybrid.data.hf_tokenizer import HuggingFaceTokenizer
from hybrid.tokenizer_files import TokenizerSpec
from tests.data.testkit import synthetic_documents, write_jsonl

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
TEXTS = ["Hello world! It's 2026: the naïve café.", "  spaces\tand\nlines ", "日本語 😀", ""]


def make_model_folder(folder, eos_entry=EOS, config=True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(synthetic_documents(300, seed=4), trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config:
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": eos_entry}))
    return folder


# the eos token as a string, and in the older AddedToken form (Llama 2's tokenizer_config.json)
@pytest.mark.parametrize("eos_entry", [EOS, {"__type": "AddedToken", "content": EOS, "lstrip": False,
                                             "normalized": False, "rstrip": False, "single_word": False}])
def test_ids_eos_and_size_are_those_transformers_reads_from_the_folder(tmp_path, eos_entry):
    from transformers import AutoTokenizer

    folder = make_model_folder(tmp_path / "model", eos_entry)
    ours, ref = HuggingFaceTokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS + synthetic_documents(30, seed=8):
        ids = ours.encode(text)
        assert ids == ref(text).input_ids, text
        assert ours.id_to_piece(ids[0]) == BOS  # Llama 3's template
        assert ours.decode(ids) == text  # the begin-of-text mark is left out of the text
    assert ours.eod_id == ref.eos_token_id and ours.id_to_piece(ours.eod_id) == EOS
    assert ours.vocab_size == len(ref) == 600
    assert HuggingFaceTokenizer(folder / "tokenizer.json").eod_id == ours.eod_id  # the file itself works too


def test_a_folder_that_cannot_say_where_documents_end_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataFileNotFoundError, match=r"--tokenizer-model .*empty: no tokenizer\.json there"):
        HuggingFaceTokenizer(tmp_path / "empty")
    bare = make_model_folder(tmp_path / "bare", config=False)
    with pytest.raises(DataError, match=r"no eos_token in a tokenizer_config\.json beside"):
        _ = HuggingFaceTokenizer(bare).eod_id
    odd = make_model_folder(tmp_path / "odd", eos_entry="<eos>")
    with pytest.raises(DataError, match=r"its eos_token '<eos>' is not a token of"):
        _ = HuggingFaceTokenizer(odd).eod_id
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError, match=r"is not a Hugging Face tokenizer\.json"):
        HuggingFaceTokenizer(tmp_path / "broken")


def test_preprocessing_keeps_the_template_and_appends_the_eos(tmp_path):
    folder = make_model_folder(tmp_path / "model")
    docs = synthetic_documents(20, seed=2)
    spec = TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=str(folder))
    result = preprocess(str(write_jsonl(tmp_path / "c.jsonl", docs)), spec, str(tmp_path / "out"), workers=2,
                        append_eod=True, chunk_docs=4, progress=False)
    tok = HuggingFaceTokenizer(folder)
    ds = IndexedDataset(result.output_prefixes["text"])
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], tok.encode(doc) + [tok.eod_id])
        assert tok.id_to_piece(int(ds[i][0])) == BOS


def test_the_trainer_takes_its_vocabulary_from_the_folder(tmp_path):
    from hybrid.training.cli import parse_args, validate
    from hybrid.training.model import model_config

    folder = make_model_folder(tmp_path / "model")
    cfg = parse_args(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(folder), "--mock-data",
                      "--train-iters", "1", "--micro-batch-size", "1", "--num-layers", "1", "--hidden-size", "32",
                      "--num-attention-heads", "4", "--seq-length", "16"])
    validate(cfg, world_size=1)
    assert model_config(cfg, HuggingFaceTokenizer(folder).vocab_size).vocab_size == 600
