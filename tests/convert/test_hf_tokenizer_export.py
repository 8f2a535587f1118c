"""``to-hf`` writes the run's tokenizer beside the weights, in the files ``transformers`` reads: the exported
folder's ``AutoTokenizer`` encodes as the run's tokenizer did (SentencePiece, GPT-2's BPE, a model folder's
``tokenizer.json``), and ``config.json`` / ``generation_config.json`` name its BOS, EOS and pad ids, so that
``generate`` stops at the end of a document."""

import json

import pytest
import torch

from hybrid.convert.consolidate import ConversionError
from hybrid.convert.hf import export_to_hf
from hybrid.data.gpt2_bpe import EOD_TOKEN, GPT2BPETokenizer, train_gpt2_bpe
from hybrid.data.hf_tokenizer import HuggingFaceTokenizer
from hybrid.data.tokenizer import SentencePieceTokenizer, train_sentencepiece
from hybrid.tokenizer_files import TokenizerSpec
from tests.convert.common import GPT2_CFG, LLAMA_CFG, VOCAB, model_from_state, randomized_state, \
    write_weights_checkpoint
from tests.data.test_hf_tokenizer import make_model_folder
from tests.data.testkit import synthetic_documents

transformers = pytest.importorskip("transformers")
# The sentence; whitespace the SentencePiece normalizer rewrites (tabs, runs of spaces, leading and trailing
# ones); characters NFKC maps (a ligature, a full-width letter); characters no vocabulary here has; special tokens'
# text, which the run's tokenizers read as text
TEXTS = ["Return the list of arguments.", "Hello world! It's 2026.", "  spaces\tand\nlines ", "a  b   c", " lead",
         "naïve café 😀😀", "ﬁle Ａbc ①", "", "<s> </s> <unk>",
         f"one{EOD_TOKEN}two"] + synthetic_documents(10, seed=6)


def _exported_ids(folder):
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    ids = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    assert generation == ids
    return ids


def _same_ids(ours, folder, texts=TEXTS):
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    for text in texts:
        assert theirs(text).input_ids == ours.encode(text), text
    return theirs


# the demo's tokenizer is a bpe one (launch_scripts/pretrain_gpt_tiny.sh); bpe with byte fallback as Llama 2's (its
# 256 byte pieces need the larger vocabulary); unigram, whose lattice in the tokenizers library holds the control
# pieces, so "<s>" in a text is read as <s> there (docs/convert.md): the one text it leaves out
@pytest.mark.parametrize("model_type,byte_fallback,vocab", [("bpe", False, VOCAB), ("bpe", True, 600),
                                                           ("unigram", False, VOCAB)])
def test_a_sentencepiece_run_reads_the_same_in_transformers(tmp_path, model_type, byte_fallback, vocab):
    spm = train_sentencepiece(synthetic_documents(400, seed=1), tmp_path / "spm", vocab, model_type=model_type,
                              byte_fallback=byte_fallback)
    cfg = GPT2_CFG.replace(vocab_size=vocab)
    write_weights_checkpoint(tmp_path / "ck", cfg, randomized_state(cfg), 1)
    res = export_to_hf(tmp_path / "ck", tmp_path / "hf", tokenizer=TokenizerSpec(tokenizer_model=spm))
    assert [p.name for p in res.tokenizer_files] == ["tokenizer.model", "tokenizer.json", "tokenizer_config.json"]
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == open(spm, "rb").read()
    ours = SentencePieceTokenizer(spm)
    # config.json says gpt2: with tokenizer.model alone, transformers built GPT-2's tokenizer from it (the issue)
    theirs = _same_ids(ours, tmp_path / "hf", [t for t in TEXTS if model_type == "bpe" or "<s>" not in t])
    assert "GPT2" not in type(theirs).__name__
    for text in synthetic_documents(10, seed=6):  # decoding too, of text with no unknown piece (SentencePiece
        assert theirs.decode(ours.encode(text)) == ours.decode(ours.encode(text))  # writes those as " ⁇ ")
    ids = _exported_ids(tmp_path / "hf")
    assert ids == {"bos_token_id": ours.bos_id, "eos_token_id": ours.eod_id, "pad_token_id": ours.eod_id}
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id, theirs.unk_token_id) == \
        (ours.bos_id, ours.eod_id, ours.eod_id, ours.unk_id)


def test_llama_tokenizer_is_not_the_class_for_a_normalizing_sentencepiece_model(tmp_path):
    """Why the export names PreTrainedTokenizerFast: transformers' LlamaTokenizer rebuilds its own pipeline with no
    normalizer, so the model SentencePiece trains by default (nmt_nfkc, whitespace clean-up) encodes otherwise."""
    spm = train_sentencepiece(synthetic_documents(400, seed=1), tmp_path / "spm", VOCAB)
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "tokenizer.model").write_bytes(open(spm, "rb").read())
    (tmp_path / "llama" / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": False}))
    llama, ours = transformers.AutoTokenizer.from_pretrained(tmp_path / "llama"), SentencePieceTokenizer(spm)
    assert type(llama).__name__ == "LlamaTokenizer"
    assert llama(TEXTS[0]).input_ids == ours.encode(TEXTS[0])  # plain words come out right
    assert llama("a  b   c").input_ids != ours.encode("a  b   c")  # a run of spaces does not


def test_gpt2_vocab_and_merges_travel_with_the_weights(tmp_path):
    vocab, merges = train_gpt2_bpe(synthetic_documents(200, seed=5), tmp_path / "tok" / "gpt2", vocab_size=VOCAB)
    write_weights_checkpoint(tmp_path / "ck", LLAMA_CFG, randomized_state(LLAMA_CFG), 1)  # not GPT-2's class
    spec = TokenizerSpec("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    res = export_to_hf(tmp_path / "ck", tmp_path / "hf", tokenizer=spec)
    assert [p.name for p in res.tokenizer_files] == ["vocab.json", "merges.txt", "tokenizer.json",
                                                     "tokenizer_config.json"] and res.note is None
    ours = GPT2BPETokenizer(vocab, merges)
    theirs = _same_ids(ours, tmp_path / "hf")
    eod = ours.eod_id
    assert _exported_ids(tmp_path / "hf") == dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id"), eod)
    assert theirs.eos_token_id == eod


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
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    source = json.loads((folder / "tokenizer_config.json").read_text())
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text()) == {**source, "model_max_length":
                                                                                   big.seq_length}
    ours = HuggingFaceTokenizer(folder)
    theirs = _same_ids(ours, tmp_path / "hf")
    assert theirs.eos_token_id == ours.eod_id
    ids = _exported_ids(tmp_path / "hf")
    assert ids == {"bos_token_id": theirs.bos_token_id, "eos_token_id": ours.eod_id, "pad_token_id": ours.eod_id}
    assert ids["bos_token_id"] is not None and ids["bos_token_id"] != ids["eos_token_id"]


def test_generate_stops_at_the_end_of_a_document(tmp_path):
    """A model whose greedy continuation reaches the end-of-document token: ``transformers``' generate stops there,
    with the tokens hybrid's own model picks on the way. The head's EOD row is made a copy, slightly longer, of the
    row of a token the random model picks, so that EOD wins where that token would have (and no earlier token
    decides it: the steps before are checked against hybrid's model)."""
    spm = train_sentencepiece(synthetic_documents(400, seed=1), tmp_path / "spm", VOCAB)
    eod, steps = SentencePieceTokenizer(spm).eod_id, 8
    state = randomized_state(LLAMA_CFG)
    prompt = SentencePieceTokenizer(spm).encode("Return the list of arguments.")

    def greedy(state):  # hybrid's own model, one token at a time, to `steps` tokens or EOD
        model, ids = model_from_state(LLAMA_CFG, state), list(prompt)
        with torch.no_grad():
            while len(ids) < len(prompt) + steps and (len(ids) == len(prompt) or ids[-1] != eod):
                ids.append(int(model.gather_logits(model(torch.tensor([ids])))[0, -1].argmax()))
        return ids[len(prompt):]

    free = greedy(state)
    assert eod not in free
    state["lm_head.weight"][eod] = 1.05 * state["lm_head.weight"][free[3]]
    reference = greedy(state)
    assert reference[-1] == eod and len(reference) < steps  # stops before the limit
    write_weights_checkpoint(tmp_path / "ck", LLAMA_CFG, state, 1)
    export_to_hf(tmp_path / "ck", tmp_path / "hf", tokenizer=TokenizerSpec(tokenizer_model=spm))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False)
    assert out[0, len(prompt):].tolist() == reference  # and nothing after EOD


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
