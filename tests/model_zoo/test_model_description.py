"""The model description has one home, ``model_zoo/config.py`` (issue 47, item 2).

* It imports without torch, and so does ``hybrid.config``, which derives the
  trainer's ``model`` section from it.
* The recompute choices and the SwiGLU width rule are defined there and only
  there (a scan of the source text of ``hybrid/`` and ``model_zoo/``).
* Adding a field to ``GPTConfig`` takes one edit: a temporary copy of the
  packages with one more ``setting`` line gets the trainer's flag and config
  key, the checkpoint metadata, the checkpoint check and the reshard path's
  shape hint, with no other edit.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
HOME = "model_zoo/config.py"


def _sources() -> Iterator[Tuple[str, ast.AST]]:
    for package in ("hybrid", "model_zoo"):
        for path in sorted((ROOT / package).rglob("*.py")):
            yield str(path.relative_to(ROOT)), ast.parse(path.read_text(), filename=str(path))


def _where(predicate) -> Dict[str, List[int]]:
    """The modules (and lines) with an AST node for which ``predicate`` holds."""
    found: Dict[str, List[int]] = {}
    for name, tree in _sources():
        for node in ast.walk(tree):
            if predicate(node):
                found.setdefault(name, []).append(node.lineno)
    return found


def _strings(nodes) -> set:
    return {n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)}


# ---- torch-free ---------------------------------------------------------------------------------------

def test_the_model_description_and_the_configuration_import_without_torch():
    for module in ("model_zoo.config", "hybrid.config"):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], cwd=ROOT,
                              capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert proc.returncode == 0, proc.stderr[-2000:]
        torch_lines = [line for line in proc.stderr.splitlines() if "torch" in line]
        assert not torch_lines, f"importing {module} imports torch:\n" + "\n".join(torch_lines[:5])


# ---- each rule in one module ----------------------------------------------------------------------------

def test_the_recompute_choices_are_written_once_in_model_zoo_config():
    choices = {"none", "full", "selective"}

    def literal(node) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return choices <= _strings(node.elts)
        return isinstance(node, ast.Dict) and choices <= _strings(node.keys)

    found = _where(literal)
    assert list(found) == [HOME] and len(found[HOME]) == 1, found
    from hybrid.config.schema import RECOMPUTE as config_choices
    from hybrid.plan.activations import RECOMPUTE as planner_checks
    from hybrid.plan.layouts import RECOMPUTES as planner_order
    from model_zoo.config import RECOMPUTE, RECOMPUTE_LEAST_FIRST

    assert config_choices is RECOMPUTE and RECOMPUTE == ("none", "full", "selective")  # errors and --help list these
    assert planner_order is planner_checks is RECOMPUTE_LEAST_FIRST == ("none", "selective", "full")


def test_the_swiglu_width_is_defined_once_in_model_zoo_config():
    # the input projection's width: one table, keyed by the MLP kind
    assert list(_where(lambda n: isinstance(n, ast.Dict) and "swiglu" in _strings(n.keys))) == [HOME]

    # nobody picks a width (or anything else) by testing for SwiGLU in a conditional expression
    def picks_by_swiglu(node) -> bool:
        if not isinstance(node, ast.IfExp):
            return False
        return any((isinstance(n, ast.Constant) and n.value == "swiglu")
                   or (isinstance(n, ast.Attribute) and n.attr == "swiglu")
                   or (isinstance(n, ast.Name) and n.id == "swiglu") for n in ast.walk(node.test))

    assert _where(picks_by_swiglu) == {}, _where(picks_by_swiglu)

    # the Llama rule for the default width (2/3 of 4h): one function, one division by 3 of a multiple of 4
    def thirds_of_4h(node) -> bool:
        return (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant)
                and node.right.value == 3
                and any(isinstance(n, ast.Constant) and n.value == 4 for n in ast.walk(node.left)))

    assert list(_where(thirds_of_4h)) == [HOME]
    assert list(_where(lambda n: isinstance(n, ast.FunctionDef) and n.name == "swiglu_ffn_size")) == [HOME]

    from model_zoo.config import GPTConfig

    gelu = GPTConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4)
    swiglu = gelu.replace(mlp="swiglu")
    assert (gelu.mlp_input_size, swiglu.mlp_input_size, swiglu.ffn_size) == (128, 512, 256)


def test_the_trainer_model_section_is_derived_from_gptconfig():
    import dataclasses

    from hybrid.config import ModelConfig
    from hybrid.config.trainer_sections import COMPILE_MODEL_KEYS, MODEL_KEYS
    from model_zoo.config import ANY_VALUE_ON_LOAD, SHAPE_FIELDS, GPTConfig

    fields = {f.name: f for f in dataclasses.fields(GPTConfig)}
    # the preset and how the model runs (compiled or not) are the section's own; every other key is GPTConfig's
    assert [f.name for f in dataclasses.fields(ModelConfig)] == ["preset", *COMPILE_MODEL_KEYS] + [mk.key for mk in
                                                                                                    MODEL_KEYS]
    assert {mk.field for mk in MODEL_KEYS} == {n for n, f in fields.items() if f.metadata["trainer"]}
    for mk in MODEL_KEYS:
        mine = next(f for f in dataclasses.fields(ModelConfig) if f.name == mk.key)
        assert mine.metadata["help"] == fields[mk.field].metadata["help"]
    training = tuple(mk.key for mk in MODEL_KEYS if fields[mk.field].metadata["kind"] == "training")
    assert ModelConfig.TRAINING_KEYS == training + COMPILE_MODEL_KEYS
    assert {"hidden_dropout", "attention_dropout", "sequence_parallel", "moe_aux_loss_coeff",
            "moe_expert_capacity_factor"} <= set(training)
    # shapes: the checkpoint's (the expert TP size decides how a checkpoint cuts the experts)
    assert not {"num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "expert_tensor_parallel_size"} & set(training)
    assert "seq_length" in ANY_VALUE_ON_LOAD and "seq_length" not in SHAPE_FIELDS
    assert {"hidden_size", "num_heads", "max_position_embeddings", "mlp"} <= set(SHAPE_FIELDS)


# ---- one edit adds a field -------------------------------------------------------------------------------

_NEW_FIELD = '    dummy_width: int = setting(3, kind=SHAPE, ge=1, help="a dummy shape of the test")\n'
_ANCHOR = "    # ---- derived sizes"

_CHECK = r'''
import json, sys
from pathlib import Path

from hybrid.config.flags import flags_of
from hybrid.config.schema import HybridConfig
from hybrid.engine.reshard import _config_hint
from hybrid.training.cli import parse_args
from hybrid.training.model import model_config
from model_zoo.config import SHAPE_FIELDS

assert flags_of(HybridConfig, "model.dummy_width") == ("--dummy-width",)
config = parse_args(["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "128",
                     "--seq-length", "16", "--dummy-width", "5"])
assert config.model.dummy_width == 5
gpt = model_config(config, vocab_size=128)
assert gpt.dummy_width == 5 and "dummy_width" in SHAPE_FIELDS
hint = _config_hint(dict(gpt.to_dict(), dummy_width=4), gpt)
assert "dummy_width 4 in the checkpoint vs 5 now" in hint, hint
print("ok")
'''


def test_a_new_gptconfig_field_needs_one_edit(tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for package in ("hybrid", "model_zoo"):
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    config_py = copy / HOME
    text = config_py.read_text()
    assert text.count(_ANCHOR) == 1
    config_py.write_text(text.replace(_ANCHOR, _NEW_FIELD + "\n" + _ANCHOR))
    env = dict(os.environ, PYTHONPATH=str(copy), OMP_NUM_THREADS="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=copy, env=env, capture_output=True, text=True,
                              timeout=300)

    # the trainer's flag and key, the GPTConfig it builds, the reshard path's shape hint
    proc = run("-c", _CHECK)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]

    # the checkpoint metadata records it, and a checkpoint of another value is refused naming it
    train = ["-m", "hybrid.train", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
             "--vocab-size", "128", "--seq-length", "16", "--mock-data", "--micro-batch-size", "1",
             "--train-iters", "1", "--eval-interval", "0", "--lr", "1e-3", "--save", str(tmp_path / "ckpt")]
    proc = run(*train, "--dummy-width", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((tmp_path / "ckpt" / "iter_0000001" / "metadata.json").read_text())
    assert meta["model_config"]["dummy_width"] == 5, meta["model_config"]
    proc = run(*train, "--dummy-width", "6", "--load", str(tmp_path / "ckpt"), "--train-iters", "2")
    assert proc.returncode == 1 and "dummy_width: checkpoint 5, current model 6" in proc.stderr, proc.stderr[-3000:]
