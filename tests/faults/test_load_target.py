"""Issue 48, defect 3 (and item 9's ``--load DIR/latest``): a ``--load`` that holds no hybrid checkpoint.

Before, ``--load`` of a Hugging Face export, an empty folder or an existing typo
with ``--finetune`` and another ``--save`` trained from random weights and
exited 0, saying only "no checkpoint there yet, starting from scratch"; and
``--load DIR/latest`` or ``DIR/iter_N/metadata.json`` was "not a directory".
Now ``--finetune`` with nothing to load is an error, a Hugging Face model folder
is refused with how to import it, a fresh start is quiet only where ``--load``
is also ``--save`` (the first launch of a job that resumes there), and a file of
a checkpoint is refused naming the folder to give.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from tests.faults.test_trainer_faults import MOCK, _main, _one_error_line, _world2

HF_LINE = "this is a Hugging Face model folder; import it with `tools/convert_checkpoint.py from-hf`"
FRESH = "no checkpoint there yet, starting from scratch"
RUN = MOCK + ["--train-iters", "1"]


def _hf_export(folder):
    """What save_pretrained writes: config.json and model.safetensors."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    save_file({"transformer.wte.weight": torch.zeros(8, 4)}, str(folder / "model.safetensors"))
    return folder


def test_an_hf_model_folder_is_refused_with_how_to_import_it(tmp_path, monkeypatch, capsys):
    hf, save = _hf_export(tmp_path / "hf_export"), tmp_path / "h7"
    # the command: two ranks, TP 2, --finetune, another --save
    line = _one_error_line(_world2(RUN + ["--tensor-model-parallel-size", "2", "--load", hf, "--finetune",
                                          "--save", save]), code=1)
    assert HF_LINE in line and f"--load {hf}" in line, line
    assert not list(save.glob("iter_*"))
    # without --finetune too: an HF folder never resumes a hybrid run
    code, out, err = _main(RUN + ["--load", hf, "--save", save], monkeypatch, capsys)
    assert code == 1 and len(err) == 1 and HF_LINE in err[0], err
    assert not any(x.startswith("iteration") for x in out.splitlines())


def test_finetune_without_a_checkpoint_is_an_error(tmp_path, monkeypatch, capsys):
    empty, save = tmp_path / "empty", tmp_path / "save"
    empty.mkdir()
    code, out, err = _main(RUN + ["--load", empty, "--finetune", "--save", save], monkeypatch, capsys)
    assert code == 1 and len(err) == 1, err
    assert err[0] == (f"hybrid-train: error: --load {empty}: {empty} holds no checkpoint for --finetune to start "
                      f"from; give a checkpoint's folder (DIR or DIR/iter_N), or leave out --finetune and --load to "
                      f"train from scratch")
    assert not save.exists() or not list(save.glob("iter_*"))
    # also where --load is --save: there is nothing to fine-tune, existing folder or not
    code, _, err = _main(RUN + ["--load", empty, "--finetune", "--save", empty], monkeypatch, capsys)
    assert code == 1 and "holds no checkpoint for --finetune" in err[0], err
    new = tmp_path / "new"
    code, _, err = _main(RUN + ["--load", new, "--finetune", "--save", new], monkeypatch, capsys)
    assert code == 1 and len(err) == 1 and "--finetune has no checkpoint to start from" in err[0], err


def test_a_fresh_start_is_quiet_only_where_load_is_save(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    code, out, err = _main(RUN + ["--load", run_dir, "--save", run_dir], monkeypatch, capsys)
    assert code == 0, err
    assert f"--load {run_dir}: {FRESH}" in out and "warning" not in out + "".join(err)
    # another folder that holds nothing: it starts (as Megatron-LM does), but says that --load looks wrong
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = _main(RUN + ["--load", empty, "--save", tmp_path / "other"], monkeypatch, capsys)
    assert code == 0, err
    (warning,) = [x for x in out.splitlines() if FRESH in x]
    assert warning.startswith(f"hybrid-train: warning: --load {empty}: {FRESH}") and "--save" in warning, warning


def test_a_file_of_a_checkpoint_suggests_its_folder(tmp_path, monkeypatch, capsys):
    save = tmp_path / "ckpt"
    code, _, err = _main(RUN + ["--save", save], monkeypatch, capsys)
    assert code == 0, err
    for given in (save / "latest", save / "iter_0000001" / "metadata.json"):
        code, _, err = _main(RUN + ["--load", given], monkeypatch, capsys)
        assert code == 1 and len(err) == 1, err
        assert err[0].startswith(f"hybrid-train: error: 'checkpoint.load' {given} is "), err[0]
        assert f"--load {save} " in err[0] and "(set by --load)" in err[0], err[0]
