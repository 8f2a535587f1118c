"""``from-deepspeed`` (issue 52): a real DeepSpeed ZeRO-2 / ZeRO-3 checkpoint continues in hybrid like in DeepSpeed.

The fixtures (tests/fixtures/deepspeed_zero{2,3}/, written by
tests/fixtures/make_deepspeed_checkpoint.py with deepspeed 0.19.8 on 2 CPU
ranks) hold a tiny Hugging Face GPT-2 trained 20 AdamW steps on hybrid's mock
data and saved, and the losses of DeepSpeed's own next 10 steps. Converted,
hybrid continues from iteration 20 on the same samples (the trainer's
``--mock-data`` at the same seed: global batch ``i`` is samples ``[4i, 4i+4)``)
with the same AdamW settings. Each of its 10 losses must lie within

    2 * fwd * |loss_ds| + gamma(4) * |loss_ds| + grad_l1_i * adam_trajectory_tolerance(i, lr)

of DeepSpeed's: ``fwd`` (tests/numerics.transformer_bound) bounds how far each
framework's fp32 forward lies from the exact loss (twice: two computations),
``gamma(4)`` the averaging of at most 4 per-rank / per-micro-batch losses, and
the last term the first-order effect on the loss (``grad_l1_i``: the L1 norm of
DeepSpeed's full gradient at that step, recorded by the fixture) of the weights'
drift under different summation orders after ``i`` steps. Step 21 runs at the
converted weights exactly, so there only rounding counts. A wrong Adam step
count (bias correction), a moment left at zero or a transposed moment moves the
losses by 1e-3 and more. And its weights after the 10 steps must lie within
Adam's drift bound (tests/numerics.adam_trajectory_tolerance: 1e-2 of 10 steps
of lr) of DeepSpeed's final masters (final.safetensors), element by element.

The fast case converts ZeRO-2 for one process and continues there; the 4-process
TP=2 x DP=2 ZeRO-1 continuations from both fixtures are slow.
"""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybrid.checkpoint import CheckpointReader
from hybrid.convert import safe_pickle
from hybrid.convert.consolidate import MASTER, WEIGHT, CheckpointSource, ConversionError
from hybrid.convert.from_deepspeed import (_merge_stage3, _merge_stage12, convert_from_deepspeed, hybrid_tensors,
                                           model_map, read_deepspeed)
from hybrid.convert.hf import gpt_param_layout
from hybrid.dtypes import DTYPES
from tests.convert.test_cli import _tool  # the command line as a module
from tests.multiproc import run_distributed
from tests.numerics import adam_trajectory_tolerance, gamma, max_ratio, record, transformer_bound

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _fixture(stage, model=""):
    root = FIXTURES / f"deepspeed_{model}zero{stage}"
    return root, json.loads((root / "run.json").read_text())


def _hf_config(root):
    """The fixture's HF config.json; None for Megatron-DeepSpeed's GPT (from-deepspeed reads its saved args)."""
    return root / "config.json" if (root / "config.json").exists() else None


def _model_of(root):
    """The fixture's name map and model config, as from-deepspeed picks them."""
    arch, cfg, _ = model_map(read_deepspeed(root / "checkpoint"), hf_config=_hf_config(root))
    return arch, cfg


def _as_hybrid(tensors, root):
    """Whole tensors under the fixture's names (DeepSpeed's) under hybrid's names and in its layout."""
    arch, cfg = _model_of(root)
    return hybrid_tensors(tensors, {}, arch, cfg, arch.links(cfg), gpt_param_layout(cfg))


def _trainer_args(run, load, tp, dp, stage):
    """The DeepSpeed run's model and optimizer as trainer flags (the model's shape is checked on load)."""
    return ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
            "--vocab-size", "64", "--mock-data", "--seed", str(run["seed"]),
            "--global-batch-size", str(run["world"] * run["micro_batch_size"]),
            "--micro-batch-size", str(run["world"] * run["micro_batch_size"] // dp),
            "--lr", str(run["lr"]), "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
            "--adam-beta1", str(run["betas"][0]), "--adam-beta2", str(run["betas"][1]), "--adam-eps", str(run["eps"]),
            "--weight-decay", str(run["weight_decay"]), "--clip-grad", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--train-iters", str(run["steps"][-1]), "--eval-interval", "0", "--log-interval", "100",
            "--peak-tflops", "1", "--tensor-model-parallel-size", str(tp), "--zero-stage", str(stage),
            "--load", str(load), "--no-load-rng"]


def _continue(argv):
    from hybrid.training import Trainer, parse_args, validate

    args = parse_args(argv)
    validate(args, world_size=int(os.environ["WORLD_SIZE"]))
    trainer = Trainer(args)
    trainer.train()
    from hybrid.tensor_parallel.gather import full_state

    with trainer.engine.gathered_parameters():
        weights = full_state(trainer.model, trainer.topology)  # collective over "tp"
    return {"iterations": [it for it, _ in trainer.history], "losses": [loss for _, loss in trainer.history],
            # numpy: tensors would travel back as shared-memory handles of a process that has exited
            "weights": {n: t.float().numpy() for n, t in weights.items()} if trainer.topology.rank == 0 else None}


def _assert_continues_like_deepspeed(got, root, run):
    _, cfg = _model_of(root)
    tokens = run["world"] * run["micro_batch_size"] * cfg.seq_length
    fwd = transformer_bound(cfg, tokens, part="loss")
    assert got["iterations"] == run["steps"]
    for i, (a, b) in enumerate(zip(got["losses"], run["losses"])):
        bound = (2 * fwd + gamma(4)) * abs(b) + run["grad_l1"][i] * adam_trajectory_tolerance(i, run["lr"])
        ratio = record(abs(a - b) / bound)
        assert ratio <= 1, f"step {run['steps'][i]}: hybrid {a} vs DeepSpeed {b}: {ratio:.2f} x the bound {bound:.3g}"
    # The weights after the continued steps: within Adam's drift bound of DeepSpeed's final masters, element by
    # element (a wrong step count or moment moves them by a good fraction of lr per step).
    for name, want in _as_hybrid(load_file(root / "final.safetensors"), root).items():
        mine = torch.from_numpy(got["weights"][name][: want.shape[0]])  # less the padded vocabulary rows
        ratio = max_ratio(mine, want, adam_trajectory_tolerance(len(run["steps"]), run["lr"]))
        assert ratio <= 1, f"{name}: {ratio:.2f} x the bound"


def test_zero2_checkpoint_continues_in_one_process_like_deepspeed(tmp_path):
    root, run = _fixture(2)
    out = tmp_path / "converted"
    convert_from_deepspeed(root / "checkpoint", out, hf_config=root / "config.json", tp=1, dp=1, target_zero_stage=0)
    got = run_distributed(_continue, 1, _trainer_args(run, out, 1, 1, 0), timeout=120)[0]
    _assert_continues_like_deepspeed(got, root, run)


def test_megatron_deepspeed_gpt_continues_in_one_process_like_deepspeed(tmp_path):
    """Megatron-DeepSpeed's GPT names (its fused per-head query_key_value regrouped to [q; k; v]), the model's
    shape read from the args it saved as DeepSpeed client state: no --hf-config."""
    root, run = _fixture(2, "megatron_")
    out = tmp_path / "converted"
    convert_from_deepspeed(root / "checkpoint", out, tp=1, dp=1, target_zero_stage=0)
    assert CheckpointReader(out).trainer_state["imported_from"]["architecture"] == "Megatron-DeepSpeed GPTModel"
    got = run_distributed(_continue, 1, _trainer_args(run, out, 1, 1, 0), timeout=120)[0]
    _assert_continues_like_deepspeed(got, root, run)


def _without_saved_args(root, folder):
    """A copy of ``root``'s checkpoint whose model states hold no Megatron-DeepSpeed args."""
    folder.mkdir(parents=True)
    (folder.parent / "latest").write_text(folder.name)
    for f in (root / "checkpoint" / "global_step20").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    states = folder / "mp_rank_00_model_states.pt"
    sd = torch.load(states, weights_only=False)  # the fixture's own file: trusted
    del sd["args"]
    torch.save(sd, states)


def test_megatron_deepspeed_without_saved_args_takes_model_config(tmp_path, capsys):
    root, _ = _fixture(2, "megatron_")
    _without_saved_args(root, tmp_path / "ds" / "global_step20")
    tool = _tool()
    args = ["from-deepspeed", "--input", str(tmp_path / "ds"), "--no-progress"]
    assert tool.main(args + ["--save", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "no saved args: pass --model-config" in err
    assert tool.main(args + ["--save", str(tmp_path / "b"), "--model-config", str(root / "model_config.json")]) == 0
    with_args = convert_from_deepspeed(root / "checkpoint", tmp_path / "c")
    a, b = CheckpointReader(tmp_path / "b"), CheckpointReader(with_args)
    assert a.model_config == b.model_config
    with CheckpointSource(a) as sa, CheckpointSource(b) as sb:
        for name in sb.tensors:
            assert torch.equal(sa.read(name, MASTER), sb.read(name, MASTER)), name


@pytest.mark.parametrize("args, refusal", [
    ({"num_experts": [4]}, "--num-experts"), ({"openai_gelu": False}, "--openai-gelu"),
    ({"apply_residual_connection_post_layernorm": True}, "--apply-residual-connection-post-layernorm"),
    ({"swiglu": True}, "'mlp': 'swiglu'"), ({"num_key_value_heads": 1}, "--num-key-value-heads 1"),
    # several at once: every one named in the one line
    ({"use_rotary_position_embeddings": True, "num_key_value_heads": 1, "openai_gelu": False},
     "--use-rotary-position-embeddings.*--num-key-value-heads 1.*--openai-gelu")])
def test_megatron_deepspeed_args_hybrid_does_not_compute_alike_are_refused(args, refusal):
    from hybrid.convert.megatron_deepspeed_names import config_from_saved_args

    saved = json.loads((FIXTURES / "deepspeed_megatron_zero2" / "model_config.json").read_text())
    assert config_from_saved_args({**saved, "num_experts": [1]}, "args").num_layers == 2  # its dense default
    with pytest.raises(ConversionError, match=refusal) as err:
        config_from_saved_args({**saved, **args}, "args")
    assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("stage, model", [(2, ""), (3, ""), (2, "megatron_")])
def test_zero_checkpoint_continues_at_tp2_dp2_zero1_like_deepspeed(tmp_path, stage, model):
    root, run = _fixture(stage, model)
    out = tmp_path / "converted"
    convert_from_deepspeed(root / "checkpoint", out, hf_config=_hf_config(root), tp=2, dp=2, target_zero_stage=1)
    assert CheckpointReader(out).layout.to_json() == {"tp": 2, "dp": 2, "pp": 1, "zero_stage": 1, "precision": "fp32"}
    got = run_distributed(_continue, 4, _trainer_args(run, out, 2, 2, 1), timeout=240)[0]
    _assert_continues_like_deepspeed(got, root, run)


@pytest.mark.parametrize("folder", ["deepspeed_zero2", "deepspeed_zero3", "deepspeed_llama_zero1_bf16",
                                    "deepspeed_megatron_zero2"])
def test_conversion_carries_deepspeeds_own_view_of_the_state(tmp_path, folder):
    """Every master and moment equals, bit for bit, what DeepSpeed's own accessors returned at the save
    (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``: reference.safetensors), renamed and
    rearranged as the name map says (GPT-2's Conv1D transposed, Llama's q/k/v and gate/up stacked,
    Megatron-DeepSpeed's per-head q/k/v regrouped)."""
    root = FIXTURES / folder
    run = json.loads((root / "run.json").read_text())
    reference = load_file(root / "reference.safetensors")
    ds = read_deepspeed(root / "checkpoint")
    assert (ds.stage, ds.world, ds.step, ds.global_steps, ds.global_samples) == (run["stage"], 2, 20, 20, 80)
    assert ds.precision == ("bf16" if run["bf16"] else "fp32")
    for key, want in reference.items():
        what, name = key.split("/", 1)
        assert torch.equal(ds.state[what][name], want), key
    out = convert_from_deepspeed(root / "checkpoint", tmp_path / "c", hf_config=_hf_config(root), tp=2, dp=2,
                                 target_zero_stage=1)
    reader = CheckpointReader(out)
    assert (reader.iteration, reader.consumed_samples, reader.layout.precision) == (20, 80, ds.precision)
    assert reader.trainer_state["engine"]["lr_schedule"]["settings"]["max_lr"] == run["lr"]
    assert reader.load_optimizer_shard(1, 1)["step"] == 20
    want = {key: _as_hybrid({k.split("/", 1)[1]: t for k, t in reference.items() if k.startswith(key + "/")}, root)
            for key in (MASTER, "exp_avg", "exp_avg_sq")}
    with CheckpointSource(reader) as src:
        for name in want[MASTER]:
            for key in want:
                assert torch.equal(src.read(name, key), want[key][name]), (name, key)
            # the model files hold the masters rounded to the run's precision
            weight = src.read(name, WEIGHT)
            assert weight.dtype == DTYPES[ds.precision] and torch.equal(weight, want[MASTER][name].to(weight.dtype))


def test_flat_partitions_reassemble_as_deepspeed_lays_them_out():
    a, b = torch.arange(6.0).view(2, 3), torch.arange(100.0, 105.0)  # 6 and 5 elements
    # stage 3: every parameter split on its own, ceil(numel / world) per rank, the last rank padded
    rank0 = torch.cat([a.view(-1)[:3], b[:3]])
    rank1 = torch.cat([a.view(-1)[3:], b[3:], torch.zeros(1)])
    got = _merge_stage3([[rank0], [rank1]], [{"a": (2, 3), "b": (5,)}], Path("x"), "masters")
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
    # stages 1-2: a group is one flat vector cut evenly over the ranks (alignment padding at its end, or after
    # each parameter where recorded)
    flat = torch.cat([a.view(-1), torch.zeros(2), b, torch.zeros(3)])  # 16 = 2 ranks x 8
    got = _merge_stage12([[flat[:8]], [flat[8:]]], [{"a": (2, 3), "b": (5,)}], [[2, 0]], Path("x"), "masters")
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
    with pytest.raises(ConversionError, match="fewer than its parameters need"):
        _merge_stage12([[flat[:4]], [flat[4:8]]], [{"a": (2, 3), "b": (5,)}], [[2, 0]], Path("x"), "masters")


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_hostile_deepspeed_file_is_refused_and_nothing_runs(tmp_path):
    root, _ = _fixture(2)
    folder = tmp_path / "ds" / "global_step20"
    folder.mkdir(parents=True)
    (tmp_path / "ds" / "latest").write_text("global_step20")
    for f in (root / "checkpoint" / "global_step20").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    marker = tmp_path / "ran"
    torch.save({"optimizer_state_dict": _RunsCode(marker)}, folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(safe_pickle.UnsafePickleError) as err:
        convert_from_deepspeed(tmp_path / "ds", tmp_path / "out", hf_config=root / "config.json")
    assert "\n" not in str(err.value) and f"the global {os.system.__module__}.system" in str(err.value)
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in str(err.value)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_command_line_converts_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    root, _ = _fixture(2)
    tool = _tool()
    args = ["from-deepspeed", "--hf-config", str(root / "config.json"), "--no-progress"]
    assert tool.main(args + ["--input", str(root / "checkpoint"), "--save", str(tmp_path / "c"), "--tp", "2"]) == 0
    assert "--no-load-rng" in capsys.readouterr().out
    assert CheckpointReader(tmp_path / "c").layout.tp == 2
    assert tool.main(args + ["--input", str(tmp_path), "--save", str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "error: --input" in err and "holds neither a 'latest' file nor *_model_states.pt files" in err
    assert tool.main(args + ["--input", str(root / "checkpoint"), "--save", str(tmp_path / "e"), "--tp", "3"]) == 1
    assert "--tp 3" in capsys.readouterr().err
    partial = tmp_path / "partial" / "global_step20"  # one rank's optimizer file lost
    partial.mkdir(parents=True)
    for f in (root / "checkpoint" / "global_step20").iterdir():
        if "rank_1" not in f.name:
            (partial / f.name).write_bytes(f.read_bytes())
    assert tool.main(args + ["--input", str(partial), "--save", str(tmp_path / "f")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "holds 1 *_optim_states.pt files but was saved by 2 data-parallel ranks" in err
