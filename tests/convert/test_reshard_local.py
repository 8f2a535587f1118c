"""Resharding in one process: offline reshard, loading any layout, to-fp32, bf16 -> fp32, and the errors.

A one-process engine (TP=1, DP=1) saves a real checkpoint; the offline
resharder rewrites it for other TP/DP/ZeRO layouts (uneven DP partitions
included), and loading those back must restore every weight, master weight
and Adam moment bit for bit: resharding only moves data.
"""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from hybrid.checkpoint import ChecksumMismatchError, CheckpointReader, MissingShardError
from hybrid.convert.consolidate import ConversionError
from hybrid.convert.fp32 import export_fp32
from hybrid.convert.reshard import reshard_checkpoint
from hybrid.engine.reshard import load_resharded
from hybrid.tensor_parallel.gather import full_state
from hybrid.topology import Topology
from tests.convert.common import GPT2_CFG, LLAMA_CFG, make_engine, optimizer_tensors, train, \
    write_weights_checkpoint

K = 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A GPT-2-switch engine trained K steps (ZeRO-1, fp32) and its checkpoint."""
    root = tmp_path_factory.mktemp("reshard")
    engine = make_engine(GPT2_CFG, stage=1)
    train(engine, K)
    engine.save_checkpoint(root / "orig", K, consumed_samples=2 * K)
    return engine, root


def _params(engine):
    return full_state(engine.module, Topology.local())


def _assert_same_state(loaded, original):
    a, b = optimizer_tensors(loaded), optimizer_tensors(original)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    pa, pb = _params(loaded), _params(original)
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    assert loaded.optimizer.inner.step_count == original.optimizer.inner.step_count == K
    assert loaded.optimizer.global_steps == original.optimizer.global_steps
    assert loaded.global_step == K and loaded.lr == original.lr


@pytest.mark.parametrize("tp,dp,stage", [(2, 2, 2), (4, 1, 0), (2, 3, 1)])
def test_offline_reshard_then_load_restores_everything(saved, tmp_path, tp, dp, stage):
    engine, root = saved
    out = reshard_checkpoint(root / "orig", tmp_path / "out", target_tp=tp, target_dp=dp, target_zero_stage=stage)
    reader = CheckpointReader(out)
    assert (reader.layout.tp, reader.layout.dp, reader.layout.zero_stage) == (tp, dp, stage)
    assert reader.iteration == K and reader.consumed_samples == 2 * K
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("optim")) == \
        sorted(f"optim_tp{t:02d}_dp{d:02d}.pt" for t in range(tp) for d in range(dp))
    fresh = make_engine(GPT2_CFG, stage=1, seed=7)  # other weights: everything must come from the checkpoint
    state = fresh.load_checkpoint(tmp_path / "out")  # a different layout: resharded on load
    assert state["iteration"] == K
    _assert_same_state(fresh, engine)


def test_reshard_there_and_back_gives_the_original_partitions(saved, tmp_path):
    _, root = saved
    reshard_checkpoint(root / "orig", tmp_path / "tp2", target_tp=2, target_dp=3, target_zero_stage=2)
    back = reshard_checkpoint(tmp_path / "tp2", tmp_path / "back", target_tp=1, target_dp=1, target_zero_stage=1)
    orig = CheckpointReader(root / "orig")
    a = torch.load(orig.path / "optim_tp00_dp00.pt", weights_only=True)
    b = torch.load(back / "optim_tp00_dp00.pt", weights_only=True)
    assert a.keys() == b.keys()
    for ga, gb in zip(a["groups"], b["groups"]):
        for key, value in ga.items():
            assert torch.equal(value, gb[key]) if isinstance(value, torch.Tensor) else value == gb[key], key
    assert orig.param_index == CheckpointReader(back).param_index
    wa, wb = load_file(orig.path / "model_tp00.safetensors"), load_file(back / "model_tp00.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_training_continues_identically_after_a_resharded_load(tmp_path):
    straight = make_engine(GPT2_CFG, stage=1)
    first = train(straight, K, seed=0)
    straight.save_checkpoint(tmp_path / "ck", K)
    rest = train(straight, K, seed=5)
    reshard_checkpoint(tmp_path / "ck", tmp_path / "tp2", target_tp=2, target_dp=2, target_zero_stage=2)
    resumed = make_engine(GPT2_CFG, stage=1, seed=9)
    resumed.load_checkpoint(tmp_path / "tp2")
    assert len(first) == K and train(resumed, K, seed=5) == rest  # bit-identical


def test_to_fp32_equals_the_gathered_model(saved, tmp_path):
    engine, root = saved
    reshard_checkpoint(root / "orig", tmp_path / "tp2", target_tp=2, target_dp=2, target_zero_stage=2)
    expected = _params(engine)
    for source in (root / "orig", tmp_path / "tp2"):
        got = load_file(export_fp32(source, tmp_path / "full.safetensors"))
        assert got.keys() == expected.keys()
        for k in got:
            assert got[k].dtype == torch.float32 and torch.equal(got[k], expected[k]), k


def _masters(engine):
    """Each parameter's fp32 master weight in a one-process engine (one partition holds everything)."""
    out = {}
    for group, part in zip(engine.optimizer.groups, engine.optimizer.partitions):
        for rec in group.records:
            out[rec.name] = part.master[rec.offset: rec.offset + rec.numel].view(rec.shape).clone()
    return out


def test_bf16_checkpoint_continues_from_fp32_masters(tmp_path):
    bf16 = make_engine(LLAMA_CFG, precision="bf16", stage=2, lr=1e-2)
    train(bf16, K)
    bf16.save_checkpoint(tmp_path / "bf16", K)
    masters = _masters(bf16)
    fp32 = make_engine(LLAMA_CFG, precision="fp32", stage=1, seed=3, lr=1e-2)
    fp32.load_checkpoint(tmp_path / "bf16")  # the precision differs: resharded on load
    params = dict(fp32.module.named_parameters())
    rounded = dict(bf16.module.named_parameters())
    assert any(not torch.equal(masters[n], rounded[n].float()) for n in masters)  # the masters carry more bits
    for name, master in masters.items():
        assert torch.equal(params[name].detach(), master), name
    exported = load_file(export_fp32(tmp_path / "bf16", tmp_path / "full.safetensors"))
    loaded = _params(fp32)  # the masters, merged and without the vocabulary padding
    assert exported.keys() == loaded.keys() and all(torch.equal(exported[n], loaded[n]) for n in loaded)
    # Moments carried over too: the next step equals the bf16 run's own fp32 arithmetic on the same masters.
    assert fp32.optimizer.inner.step_count == K


def test_vocabulary_is_repadded_for_another_pad_multiple(saved, tmp_path):
    engine, root = saved
    cfg = GPT2_CFG.replace(vocab_pad_multiple=64)  # 300 rows padded to 320 instead of 384
    other = make_engine(cfg, stage=2, seed=4)  # stage 2: a different layout, so the resharding path loads it
    other.load_checkpoint(root / "orig")
    assert other.module.embedding.word_embeddings.weight.shape[0] == 320
    got, want = _params(other), _params(engine)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(optimizer_tensors(other)["0/exp_avg"][:10], optimizer_tensors(engine)["0/exp_avg"][:10])


def test_weights_only_load_refreshes_the_master_weights(tmp_path):
    state = {k: v.float() for k, v in _params(make_engine(LLAMA_CFG, seed=11)).items()}
    write_weights_checkpoint(tmp_path / "w", LLAMA_CFG, state, tp=2)
    engine = make_engine(LLAMA_CFG, precision="bf16", stage=1, seed=2)
    with pytest.raises(ConversionError, match="no optimizer state.*--finetune"):
        load_resharded(engine.checkpoints.parts, CheckpointReader(tmp_path / "w"), load_optimizer=True)
    load_resharded(engine.checkpoints.parts, CheckpointReader(tmp_path / "w"), load_optimizer=False)
    params, gathered, masters = dict(engine.module.named_parameters()), _params(engine), _masters(engine)
    for name, full in state.items():
        assert torch.equal(gathered[name], full.to(torch.bfloat16)), name
        assert torch.equal(masters[name], params[name].detach().float()), name


def test_incompatible_model_names_both_values(saved):
    _, root = saved
    reader = CheckpointReader(root / "orig")
    wider = make_engine(GPT2_CFG.replace(hidden_size=128), stage=2)
    with pytest.raises(ConversionError, match=r"full shape \[300, 64\].*\[300, 128\].*hidden_size 64 .* vs 128"):
        load_resharded(wider.checkpoints.parts, reader)
    smaller_vocab = make_engine(GPT2_CFG.replace(vocab_size=256), stage=2)
    with pytest.raises(ConversionError, match=r"\[300, 64\].*\[256, 64\].*vocab_size 300 .* vs 256"):
        load_resharded(smaller_vocab.checkpoints.parts, reader)
    deeper = make_engine(GPT2_CFG.replace(num_layers=3), stage=2)
    with pytest.raises(ConversionError, match=r"missing from the checkpoint: layers\.2\..*num_layers 2 .* vs 3"):
        load_resharded(deeper.checkpoints.parts, reader)


def test_missing_shard_and_checksum_mismatch_name_the_file(saved, tmp_path):
    _, root = saved
    src = reshard_checkpoint(root / "orig", tmp_path / "tp2", target_tp=2, target_dp=2, target_zero_stage=1)
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    (broken / "model_tp01.safetensors").unlink()
    with pytest.raises(MissingShardError, match="model_tp01.safetensors is missing"):
        export_fp32(broken, tmp_path / "x.safetensors")
    with pytest.raises(MissingShardError, match="model_tp01.safetensors"):
        reshard_checkpoint(broken, tmp_path / "y", target_tp=1)
    shutil.rmtree(broken)
    shutil.copytree(src, broken)
    path = broken / "optim_tp01_dp01.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match="checksum mismatch .*optim_tp01_dp01.pt"):
        make_engine(GPT2_CFG, stage=1).load_checkpoint(broken)
    assert not (tmp_path / "x.safetensors").exists()


def test_reshard_refuses_bad_targets(saved, tmp_path):
    _, root = saved
    with pytest.raises(ConversionError, match="--target-tp 3 does not divide the model's num_heads=4"):
        reshard_checkpoint(root / "orig", tmp_path / "a", target_tp=3)
    with pytest.raises(ConversionError, match="own directory"):
        reshard_checkpoint(root / "orig", root / "orig", target_tp=2)
    with pytest.raises(ConversionError, match="--target-zero-stage 3: .* reshards on load"):
        reshard_checkpoint(root / "orig", tmp_path / "b", target_tp=1, target_zero_stage=3)


def test_tiny_map_budget_reads_the_same_tensors(saved, tmp_path):
    """Memory maps closed after every few KB, runs cut into a few rows: same values, weights and state."""
    _, root = saved
    src_dir = reshard_checkpoint(root / "orig", tmp_path / "tp2", target_tp=2, target_dp=3, target_zero_stage=2)
    from hybrid.convert.consolidate import CheckpointSource, Target

    with CheckpointSource(CheckpointReader(src_dir)) as roomy, \
            CheckpointSource(CheckpointReader(src_dir), map_budget_bytes=4096) as tight:
        assert roomy.state_keys() == tight.state_keys() == ["master", "exp_avg", "exp_avg_sq"]
        for name, t in roomy.tensors.items():
            for what in ["weight"] + (roomy.state_keys() if roomy.has_state(name) else []):
                assert torch.equal(roomy.read(name, what), tight.read(name, what)), (name, what)
                target = Target(t.meta, 4, 3)
                assert torch.equal(roomy.read(name, what, target=target), tight.read(name, what, target=target))


def test_loads_into_an_offloaded_optimizer_and_into_stage_3(saved, tmp_path):
    import hybrid
    from hybrid.convert.consolidate import CheckpointSource
    from model_zoo import GPTModel

    engine, root = saved
    reshard_checkpoint(root / "orig", tmp_path / "tp2", target_tp=2, target_dp=2, target_zero_stage=2)
    topo = Topology.local()

    def build(zero):
        return hybrid.initialize(GPTModel(GPT2_CFG, topo, seed=5), {
            "precision": "fp32", "zero": zero, "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.1},
            "clip_grad": 1.0, "micro_batch_size": 2, "global_batch_size": 2, "steps_per_print": 0}, topology=topo)

    offloaded = build({"stage": 1, "offload_optimizer": "cpu"})
    offloaded.load_checkpoint(tmp_path / "tp2")
    _assert_same_state(offloaded, engine)
    # Stage 3 (some parameters persistent): what it saves again is bit for bit what it loaded.
    stage3 = build({"stage": 3, "persistence_threshold": 1000})
    stage3.load_checkpoint(tmp_path / "tp2")
    assert stage3.global_step == K and stage3.optimizer.inner.step_count == K
    stage3.save_checkpoint(tmp_path / "s3", K)
    with CheckpointSource(CheckpointReader(root / "orig")) as a, CheckpointSource(CheckpointReader(tmp_path / "s3")) as b:
        assert a.tensors.keys() == b.tensors.keys() and a.state_keys() == b.state_keys()
        for name in a.tensors:
            assert torch.equal(a.read(name), b.read(name)), name
            for key in a.state_keys() if a.has_state(name) else []:
                assert torch.equal(a.read(name, key), b.read(name, key)), (name, key)