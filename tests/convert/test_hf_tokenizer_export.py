"""``to-hf`` writes GPT-2's and a model folder's tokenizer beside the weights, in the files ``transformers`` reads:
the exported folder's ``AutoTokenizer`` encodes as the run's tokenizer did."""

import pytest

from hybrid.convert.consolidate import ConversionError
from hybrid.convert.hf import export_to_hf
from hybrid.data.gpt2_bpe import GPT2BPETokenizer, train_gpt2_bpe
from hybrid.data.hf_tokenizer import HuggingFaceTokenizer
from hybrid.tokenizer_files import TokenizerSpec
from tests.convert.common import GPT2_CFG, LLAMA_CFG, VOCAB, randomized_state, write_weights_checkpoint
from tests.data.test_hf_tokenizer import make_model_folder
from tests.data.testkit import synthetic_documents

transformers = pytest.importorskip("transformers")
TEXTS = ["Hello world! It's 2026.", "  spaces\tand\nlines ", "naïve café 😀"] + synthetic_documents(10, seed=6)


def test_gpt2_vocab_and_merges_travel_with_the_weights(tmp_path):
    vocab, merges = train_gpt2_bpe(synthetic_documents(200, seed=5), tmp_path / "tok" / "gpt2", vocab_size=VOCAB)
    write_weights_checkpoint(tmp_path / "ck", GPT2_CFG, randomized_state(GPT2_CFG), 1)
    spec = TokenizerSpec("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    res = export_to_hf(tmp_path / "ck", tmp_path / "hf", tokenizer=spec)
    assert [p.name for p in res.tokenizer_files] == ["vocab.json", "merges.txt"] and res.note is None
    ours, theirs = GPT2BPETokenizer(vocab, merges), transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in TEXTS:
        assert theirs(text).input_ids == ours.encode(text), text


def test_a_model_folders_tokenizer_travels_with_the_weights(tmp_path):
    folder = make_model_folder(tmp_path / "model")  # 600 tokens: more than the test model's vocabulary
    write_weights_checkpoint(tmp_path / "ck", LLAMA_CFG, randomized_state(LLAMA_CFG), 1)
    spec = TokenizerSpec("HuggingFaceTokenizer", tokenizer_model=str(folder))
    with pytest.raises(ConversionError,
                       match=rf"the tokenizer has 600 tokens but the model's vocabulary holds {VOCAB}"):
        export_to_hf(tmp_path / "ck", tmp_path / "hf", tokenizer=spec)
    assert not (tmp_path / "hf").exists()  # refused before any weight was written
    big = LLAMA_CFG.replace(vocab_size=600)
    write_weights_checkpoint(tmp_path / "ck600", big, randomized_state(big), 1)
    res = export_to_hf(tmp_path / "ck600", tmp_path / "hf", tokenizer=spec)
    assert [p.name for p in res.tokenizer_files] == ["tokenizer.json", "tokenizer_config.json"]
    for p in res.tokenizer_files:
        assert p.read_bytes() == (folder / p.name).read_bytes()
    ours, theirs = HuggingFaceTokenizer(folder), transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs.eos_token_id == ours.eod_id
    for text in TEXTS:
        assert theirs(text).input_ids == ours.encode(text), text


def test_files_that_are_not_the_named_tokenizer_are_refused(tmp_path):
    write_weights_checkpoint(tmp_path / "ck", GPT2_CFG, randomized_state(GPT2_CFG), 1)
    (tmp_path / "v.json").write_text("{}")
    (tmp_path / "m.txt").write_text("#version: 0.2\n")
    bad = TokenizerSpec("GPT2BPETokenizer", vocab_file=str(tmp_path / "v.json"), merge_file=str(tmp_path / "m.txt"))
    with pytest.raises(ConversionError, match=r"--vocab-file .*v\.json / --merge-file .*m\.txt: not a "
                                              r"GPT2BPETokenizer tokenizer"):
        export_to_hf(tmp_path / "ck", tmp_path / "hf", tokenizer=bad)
    half = TokenizerSpec("GPT2BPETokenizer", vocab_file=str(tmp_path / "v.json"))
    with pytest.raises(ConversionError, match=r"GPT2BPETokenizer reads --vocab-file and --merge-file; --merge-file "
                                              r"is missing"):
        export_to_hf(tmp_path / "ck", tmp_path / "hf", tokenizer=half)
    assert not (tmp_path / "hf").exists()
