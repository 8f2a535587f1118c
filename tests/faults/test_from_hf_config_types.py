"""Issue 48, defect 8: a ``config.json`` value of the wrong type is refused naming the file, the key and the type.

On the issue's main, ``layer_norm_epsilon: "tiny"`` failed with "could not
convert string to float: 'tiny'" (no key, no file) and ``n_embd: 128.0`` was
blamed on ``--tp``; these tests failed there.
"""

from __future__ import annotations

import json
import re

import pytest

from hybrid.convert.consolidate import ConversionError
from hybrid.convert.hf import export_to_hf, import_from_hf
from tests.convert.common import GPT2_CFG, LLAMA_GQA_CFG, randomized_state, write_weights_checkpoint


def _hf_folder(tmp_path, cfg):
    write_weights_checkpoint(tmp_path / "ck", cfg, randomized_state(cfg), 1)
    export_to_hf(tmp_path / "ck", tmp_path / "hf")
    return tmp_path / "hf"


def _edited(hf, edit) -> dict:
    path = hf / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    return config


GPT2_CASES = [("layer_norm_epsilon", "tiny", "a number"), ("n_embd", 128.0, "an integer"),
              ("n_head", "4", "an integer"), ("n_layer", True, "an integer"),
              ("tie_word_embeddings", "yes", "true or false"), ("initializer_range", [0.02], "a number")]
LLAMA_CASES = [("rms_norm_eps", "1e-6", "a number"), ("num_key_value_heads", 2.0, "an integer"),
               ("intermediate_size", "96", "an integer"), ("rope_theta", "500", "a number")]


@pytest.mark.parametrize("key,value,expected", GPT2_CASES, ids=[c[0] for c in GPT2_CASES])
def test_gpt2_config_type_errors_name_the_file_the_key_and_the_type(tmp_path, key, value, expected):
    hf = _hf_folder(tmp_path, GPT2_CFG)
    _edited(hf, lambda c: c.__setitem__(key, value))
    _check(hf, tmp_path, key, value, expected)


@pytest.mark.parametrize("key,value,expected", LLAMA_CASES, ids=[c[0] for c in LLAMA_CASES])
def test_llama_config_type_errors_name_the_file_the_key_and_the_type(tmp_path, key, value, expected):
    hf = _hf_folder(tmp_path, LLAMA_GQA_CFG)

    def edit(config):
        config[key] = value
        config.pop("rope_parameters", None)  # one spelling of the rotation: the edited top-level one
    _edited(hf, edit)
    _check(hf, tmp_path, key, value, expected)


def test_a_rope_scaling_parameter_of_the_wrong_type_names_its_object(tmp_path):
    hf = _hf_folder(tmp_path, LLAMA_GQA_CFG)

    def edit(config):
        config.pop("rope_parameters", None)
        config["rope_scaling"]["factor"] = "8"
    _edited(hf, edit)
    _check(hf, tmp_path, "factor", "8", "a number", also="rope_scaling")


def _check(hf, tmp_path, key, value, expected, also=""):
    with pytest.raises(ConversionError) as info:
        import_from_hf(hf, tmp_path / "out", tp=2)
    text = str(info.value)
    assert "\n" not in text
    assert str(hf / "config.json") in text and also in text, text
    assert re.search(rf"\b{key} is {re.escape(repr(value))}", text) and f"expected {expected}" in text, text
    assert "--tp" not in text, text
    assert not (tmp_path / "out").exists()  # refused before anything is written
