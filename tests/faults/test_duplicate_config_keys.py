"""Issue 48, defect 9: a config file that gives one key twice is refused, naming the key (and where it is).

JSON and YAML parsers keep the last value silently, so a pasted-in second
``"stage"`` changed the ZeRO stage without a word. Every file a user hands in
is checked: native and DeepSpeed configs (``load_config``, the trainer's
``--config``), YAML, and a Hugging Face ``config.json`` for ``from-hf``. On
the issue's main these tests failed: each file loaded with the last value.
"""

from __future__ import annotations

import pytest

from hybrid.config import ConfigError, load_config
from hybrid.config.cli import tree_from_file

DEEPSPEED = '{\n  "train_batch_size": 8,\n  "zero_optimization": {\n    "stage": 2,\n    "stage": 3\n  }\n}\n'
NATIVE = '{"zero": {"stage": 1}, "zero": {"stage": 2}}'
YAML = "zero:\n  stage: 1\n  bucket_size: 100\n  stage: 3\n"


@pytest.mark.parametrize("name,text,key,where", [("ds.json", DEEPSPEED, "stage", "lines 4, 5"),
                                                 ("native.json", NATIVE, "zero", "config file"),
                                                 ("native.yaml", YAML, "stage", "lines 2 and 4")],
                         ids=["deepspeed-json", "native-json", "yaml"])
def test_a_duplicate_key_is_refused_naming_it(tmp_path, name, text, key, where):
    path = tmp_path / name
    path.write_text(text)
    for load in (load_config, tree_from_file):
        with pytest.raises(ConfigError) as info:
            load(str(path))
        message = str(info.value)
        assert "\n" not in message and str(path) in message, message
        assert f"key {key!r} is given twice" in message and where in message, message


def test_a_hugging_face_config_with_a_duplicate_key_is_refused(tmp_path):
    from hybrid.convert.consolidate import ConversionError
    from hybrid.convert.hf import import_from_hf

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_embd": 128}')
    with pytest.raises(ConversionError, match=r"config\.json: key 'n_embd' is given twice"):
        import_from_hf(hf, tmp_path / "out")


def test_the_same_key_in_two_objects_is_fine(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, '
                    '"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}')
    assert load_config(str(path)).optimizer.lr == 0.001
