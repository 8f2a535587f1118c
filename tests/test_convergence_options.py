"""benchmarks/convergence.py without a cluster: its option table is valid trainer flags at TP2 x DP2, and it reads
a run's loss curves back from TensorBoard event files the way the trainer's monitor writes them."""

import importlib.util
import sys
from pathlib import Path

import pytest

from hybrid.config import validate_for_training
from hybrid.training.cli import parse_args

REPO = Path(__file__).resolve().parents[1]
WORLD = 4


def _load():
    spec = importlib.util.spec_from_file_location("convergence_bench", REPO / "benchmarks" / "convergence.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


conv = _load()


def _args():
    return conv.parse(["--iters", "300"])


@pytest.mark.parametrize("name", list(conv.OPTIONS))
def test_option_is_valid_trainer_flags(name, tmp_path):
    args = _args()
    argv = conv.option_flags(name, args.iters, tmp_path / "corpus_text_document", tmp_path / "tok.model", args,
                             tmp_path / "tb")
    config = parse_args(argv)
    validate_for_training(config, WORLD)  # the config's own rules at world 4
    assert config.tensor_parallel_size == conv.TP
    assert config.logging.tensorboard_dir == str(tmp_path / "tb")
    assert config.zero.stage in (0, 2, 3)


def test_options_differ_from_the_baseline_as_named(tmp_path):
    args = _args()

    def zero(name):
        return parse_args(conv.option_flags(name, 10, tmp_path / "d", tmp_path / "t", args, tmp_path / "tb")).zero

    base = zero("z2")
    assert (base.stage, base.reduce_once, base.quantized_gradients, base.quantized_weights) == (2, True, "off", "off")
    assert zero("qg8").quantized_gradients == "int8" and zero("qg4").quantized_gradients == "int4"
    assert zero("qw8").quantized_weights == "int8"
    assert (zero("q").quantized_gradients, zero("q").quantized_weights) == ("int4", "int8")
    assert zero("z3").stage == 3 and zero("z3-q").stage == 3


def test_skipped_options_are_refused_with_the_reason(capsys):
    for name in conv.SKIPPED:
        with pytest.raises(SystemExit):
            conv.parse(["--only", name])
        assert "not run at TP2 x DP2" in capsys.readouterr().err


def test_curves_from_event_files_and_the_table(tmp_path):
    from hybrid.monitor.tensorboard_writer import TensorBoardWriter

    options = {}
    for name, final in (("z2", 6.0), ("qg8", 6.05), ("q", 6.2)):
        tb = TensorBoardWriter(str(tmp_path / name))
        for it in (10, 20):
            tb._scalar(conv.TRAIN_TAG, 8.0 - it / 10, it)
        tb.write_evaluation("valid", 10, 7.0)
        tb.write_evaluation("valid", 20, final)
        tb.close()
        curves = conv.read_curves(tmp_path / name)
        assert curves[conv.TRAIN_TAG] == [(10, 7.0), (20, 6.0)]
        assert [s for s, _ in curves[conv.VALID_TAG]] == [10, 20]
        options[name] = {"flags": list(conv.OPTIONS[name]), "ok": True, "reason": None,
                         "final_valid_loss": curves[conv.VALID_TAG][-1][1],
                         "train_curve": curves[conv.TRAIN_TAG], "valid_curve": curves[conv.VALID_TAG]}
    options["onebit"] = {"flags": list(conv.OPTIONS["onebit"]), "ok": False, "reason": "node 0 exit 1: boom"}
    conv.add_ratios(options, 0.02)
    assert options["qg8"]["within_tolerance"] is True and options["q"]["within_tolerance"] is False
    assert options["qg8"]["ratio_to_z2"] == pytest.approx(6.05 / 6.0)
    table = conv.markdown_table(options, 0.02)
    assert "| qg8 |" in table and "| 1.0083 | yes |" in table and "| no |" in table and "FAILED: node 0 exit 1" in table
    pytest.importorskip("matplotlib")
    conv.plot(options, tmp_path / "c.png", "t", 0.02)
    assert (tmp_path / "c.png").stat().st_size > 0
