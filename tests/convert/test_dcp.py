"""``to-dcp`` / ``from-dcp``: hybrid checkpoints <-> torch.distributed.checkpoint folders in torchtitan's layout.

* hybrid -> DCP -> torch's own readers (``dcp_to_torch_save``, ``dcp.load``) gives every weight, Adam moment and
  step bit for bit;
* DCP -> hybrid -> Hugging Face writes the very tensors a direct export writes (so the same logits, bit for bit);
* a DCP folder written by plain torch (a model trained with ``torch.optim.AdamW``, saved with
  ``get_optimizer_state_dict(flatten_optimizer_state_dict=True)`` as torchtitan saves) imports, and the engine
  that loads it holds torch's weights, moments and step;
* a hostile ``.metadata`` or value is refused in one line naming the global, and nothing from it runs.
"""

import json
import os
import pickle
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file

from hybrid.checkpoint import CheckpointReader
from hybrid.convert.consolidate import CheckpointSource, ConversionError
from hybrid.convert.dcp import MODEL_CONFIG_FILE, export_to_dcp, import_from_dcp
from hybrid.convert.hf import export_to_hf
from hybrid.convert.safe_pickle import UnsafePickleError
from hybrid.tensor_parallel.gather import full_state
from hybrid.topology import Topology
from tests.convert.common import GPT2_CFG, LLAMA_CFG, make_engine, randomized_state, train, \
    write_weights_checkpoint

dcp = pytest.importorskip("torch.distributed.checkpoint")
STATES = ("weight", "master", "exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A bf16 GPT-2-switch engine trained 2 steps (ZeRO-1: fp32 masters and Adam moments) and its DCP export."""
    root = tmp_path_factory.mktemp("dcp")
    engine = make_engine(GPT2_CFG, stage=1, precision="bf16")
    train(engine, 2)
    engine.save_checkpoint(root / "ck", 2, consumed_samples=4)
    res = export_to_dcp(root / "ck", root / "dcp")
    assert res["optimizer"] and res["note"] is None
    return root


def _plain(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(folder, folder.parent / "plain.pt")
    return torch.load(folder.parent / "plain.pt", weights_only=False)  # our own file, written just now


def test_hybrid_to_dcp_reads_back_bit_for_bit_with_plain_torch(trained):
    plain = _plain(trained / "dcp")
    with CheckpointSource(CheckpointReader(trained / "ck")) as src:
        step = src.optimizer_header()["step"]
        for name in src.tensors:
            # the weights are the fp32 masters (a torchtitan model's parameters), the moments Adam's
            assert plain[name].dtype == torch.float32 and torch.equal(plain[name], src.read(name, "master")), name
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(plain["optimizer"][f"state.{name}.{key}"], src.read(name, key)), (name, key)
            assert plain["optimizer"][f"state.{name}.step"] == step == 2
            decays = src.tensors[name].record["weight_decay"]
            assert plain["optimizer"][f"param_groups.{name}.weight_decay"] == (0.1 if decays else 0.0)
            assert plain["optimizer"][f"param_groups.{name}.betas"] == (0.9, 0.999)
    assert plain["train_state"]["step"] == 2 and plain["train_state"]["consumed_samples"] == 4
    # the same through dcp.load into a state dict of the model's own (what a torchtitan job does)
    model_sd = {name: torch.empty_like(t) for name, t in plain.items() if isinstance(t, torch.Tensor)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(model_sd, checkpoint_id=str(trained / "dcp"), no_dist=True)
    assert all(torch.equal(model_sd[n], plain[n]) for n in model_sd)


def test_dcp_to_hybrid_restores_weights_masters_moments_and_step(trained, tmp_path):
    out = import_from_dcp(trained / "dcp", tmp_path / "back", dtype="bf16")
    with CheckpointSource(CheckpointReader(trained / "ck")) as a, CheckpointSource(CheckpointReader(out)) as b:
        assert b.optimizer_header()["step"] == a.optimizer_header()["step"] == 2
        assert b.layout.precision == "bf16" and CheckpointReader(out).iteration == 2
        assert CheckpointReader(out).consumed_samples == 4
        for name in a.tensors:
            for what in STATES:
                assert torch.equal(a.read(name, what), b.read(name, what)), (name, what)


def _via_dcp_and_direct(tmp_path):
    """A TP=2 weights-only Llama checkpoint exported to HF directly and through DCP -> hybrid."""
    write_weights_checkpoint(tmp_path / "ck", LLAMA_CFG, randomized_state(LLAMA_CFG), 2)
    res = export_to_dcp(tmp_path / "ck", tmp_path / "dcp")
    assert not res["optimizer"] and "no optimizer state" in res["note"]
    out = import_from_dcp(tmp_path / "dcp", tmp_path / "back")
    assert not CheckpointReader(out).has_optimizer_state
    export_to_hf(tmp_path / "ck", tmp_path / "hf_direct")
    export_to_hf(out, tmp_path / "hf_via_dcp")
    return tmp_path / "hf_direct", tmp_path / "hf_via_dcp"


def test_dcp_to_hybrid_to_hf_writes_the_direct_exports_tensors(tmp_path):
    direct, via = (load_file(d / "model.safetensors") for d in _via_dcp_and_direct(tmp_path))
    assert direct.keys() == via.keys() and all(torch.equal(direct[k], via[k]) for k in direct)


@pytest.mark.slow
def test_dcp_to_hybrid_to_hf_gives_the_direct_exports_logits(tmp_path):
    """The same tensors through the same kernels: the same logits, bit for bit (tests/convert/test_hf.py holds the
    direct export's logits to hybrid's own)."""
    transformers = pytest.importorskip("transformers")
    tokens = torch.randint(0, LLAMA_CFG.vocab_size, (2, LLAMA_CFG.seq_length),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [transformers.AutoModelForCausalLM.from_pretrained(d).eval()(tokens).logits
                  for d in _via_dcp_and_direct(tmp_path)]
    assert torch.equal(*logits)


def _torch_run(cfg, root):
    """A TP=1 model trained 2 steps with torch.optim.AdamW, saved as torchtitan saves (model at the top level,
    the optimizer flattened); returns the model and optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, \
        get_optimizer_state_dict
    from model_zoo import GPTModel

    model = GPTModel(cfg, Topology.local(), seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
        model(ids[:, :-1], labels=ids[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        optim_sd = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
        dcp.save({**get_model_state_dict(model), "optimizer": optim_sd}, checkpoint_id=str(root), no_dist=True)
    return model, opt


def test_a_dcp_folder_written_by_plain_torch_imports_with_its_adam_state(tmp_path):
    cfg = LLAMA_CFG.replace(vocab_size=384)  # a multiple of the vocabulary padding: no padding rows
    model, opt = _torch_run(cfg, tmp_path / "dcp")
    with pytest.raises(ConversionError, match=rf"has no {MODEL_CONFIG_FILE} \(to-dcp writes one\); pass "
                                              r"--model-config FILE\.json"):
        import_from_dcp(tmp_path / "dcp", tmp_path / "back")
    (tmp_path / "model.json").write_text(json.dumps(cfg.to_dict()))
    out = import_from_dcp(tmp_path / "dcp", tmp_path / "back", model_config=tmp_path / "model.json")
    engine = make_engine(cfg, seed=9)  # other initial weights: everything must come from the checkpoint
    engine.load_checkpoint(tmp_path / "back")
    mine = full_state(engine.module, Topology.local())
    with CheckpointSource(CheckpointReader(out)) as src:
        assert src.optimizer_header()["step"] == engine.optimizer.inner.step_count == 2
        for name, p in model.named_parameters():
            assert torch.equal(mine[name], p.detach()), name
            state = opt.state[p]
            assert int(state["step"]) == 2
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(src.read(name, key), state[key]), (name, key)


def test_a_model_that_does_not_fit_is_refused_naming_the_key(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(randomized_state(LLAMA_CFG), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    (tmp_path / "model.json").write_text(json.dumps(LLAMA_CFG.replace(vocab_size=512).to_dict()))
    with pytest.raises(ConversionError, match=r"embedding\.word_embeddings\.weight has shape \[300, 64\], the model "
                                              r".*model\.json describes \[512, 64\]"):
        import_from_dcp(tmp_path / "dcp", tmp_path / "back", model_config=tmp_path / "model.json")
    assert not (tmp_path / "back").exists()


class _Hostile:
    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_hostile_metadata_file_is_refused_naming_the_global(trained, tmp_path):
    folder = tmp_path / "dcp"
    shutil.copytree(trained / "dcp", folder)
    evil = _Hostile()
    evil.marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(evil))
    with pytest.raises(UnsafePickleError) as e:
        import_from_dcp(folder, tmp_path / "back")
    message = str(e.value)
    assert "\n" not in message and f"{folder / '.metadata'}: refused to load" in message
    assert f"names the global {os.system.__module__}.system" in message
    assert not evil.marker.exists() and not (tmp_path / "back").exists()


def test_a_hostile_value_is_refused_naming_the_global(tmp_path):
    evil = _Hostile()
    evil.marker = tmp_path / "ran"
    write_weights_checkpoint(tmp_path / "ck", GPT2_CFG, randomized_state(GPT2_CFG), 1)
    export_to_dcp(tmp_path / "ck", tmp_path / "dcp")
    saved = _plain(tmp_path / "dcp")
    shutil.rmtree(tmp_path / "dcp")
    # a legitimate-looking folder whose optimizer settings hold a pickled call: the metadata is plain data, the
    # value is not (each parameter's moments present, so the importer reads the settings)
    opt = {f"state.{n}.{k}": torch.zeros_like(t) for n, t in saved.items() if isinstance(t, torch.Tensor)
           for k in ("exp_avg", "exp_avg_sq")}
    opt[f"param_groups.{next(iter(opt)).split('.', 1)[1].rsplit('.', 1)[0]}.lr"] = evil
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({**{n: t for n, t in saved.items() if isinstance(t, torch.Tensor)}, "optimizer": opt},
                 checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    (tmp_path / "dcp" / MODEL_CONFIG_FILE).write_text(json.dumps(GPT2_CFG.to_dict()))
    assert not evil.marker.exists()
    with pytest.raises(UnsafePickleError, match=rf"refused to load the value of optimizer\.param_groups\..*\.lr: it "
                                                rf"names the global {os.system.__module__}\.system"):
        import_from_dcp(tmp_path / "dcp", tmp_path / "back")
    assert not evil.marker.exists()


def test_the_tool_round_trips_and_refuses_in_one_line(trained, tmp_path, capsys):
    from tests.convert.test_cli import _tool

    tool = _tool()
    assert tool.main(["to-dcp", "--load", str(trained / "ck"), "--output", str(tmp_path / "dcp"), "--no-progress"]) == 0
    assert "wrote the weights and Adam state of 28 tensors" in capsys.readouterr().out
    assert tool.main(["from-dcp", "--input", str(tmp_path / "dcp"), "--save", str(tmp_path / "back"), "--dtype",
                      "bf16", "--no-progress"]) == 0
    assert CheckpointReader(tmp_path / "back").has_optimizer_state
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(print))  # a pickle that names builtins.print
    assert tool.main(["from-dcp", "--input", str(tmp_path / "dcp"), "--save", str(tmp_path / "again"),
                      "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("convert_checkpoint from-dcp: error: ") and \
        "names the global builtins.print" in err


@pytest.mark.slow
def test_training_continues_through_dcp_bit_for_bit(tmp_path, monkeypatch, capsys):
    """The trainer (one process) runs 2 iterations and saves; resumed for 2 more from that checkpoint and from its
    to-dcp / from-dcp round trip, it ends with the same weights, masters and moments, bit for bit (the same data:
    the consumed samples travel in train_state)."""
    from tests.training.test_evaluation import _main

    args = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--vocab-size", "512", "--mock-data", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--lr", "1e-3", "--eval-interval", "0"]
    assert _main(args + ["--train-iters", "2", "--save", str(tmp_path / "run"), "--save-interval", "2"],
                 monkeypatch, capsys)[0] == 0
    export_to_dcp(tmp_path / "run", tmp_path / "dcp")
    import_from_dcp(tmp_path / "dcp", tmp_path / "back")
    for name in ("run", "back"):
        assert _main(args + ["--train-iters", "4", "--load", str(tmp_path / name), "--save",
                             str(tmp_path / f"{name}4")], monkeypatch, capsys)[0] == 0
    with CheckpointSource(CheckpointReader(tmp_path / "run4")) as a, \
            CheckpointSource(CheckpointReader(tmp_path / "back4")) as b:
        assert CheckpointReader(tmp_path / "back4").consumed_samples == 4
        for name in a.tensors:
            for what in STATES:
                assert torch.equal(a.read(name, what), b.read(name, what)), (name, what)
