"""ZeRO with expert parallelism: expert parameters reduce and partition over ``edp``, dense ones over ``dp``.

World 4 with ``ep = 2``: ``dp = 4``, ``edp = 2``. A small MoE language model
(:class:`ToyMoE`) routes each token to expert ``token % E``; ep rank ``k``
holds experts ``[k E/ep, (k+1) E/ep)`` (named by their global index, as
docs/moe.md names them) and computes them for every token of its ``ep``
group: the tokens travel by an all-gather over ``ep`` and the outputs come
back by an all-reduce over ``ep`` (both differentiable), which is what the
dispatch and combine all-to-alls amount to. So the expert gradient on each
rank holds its ``ep`` group's tokens, and summed over ``edp`` every ``dp``
rank's. The reference is one process holding every expert, training on the
whole global batch with ``torch.optim.AdamW`` and gradient clipping active.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybrid.param_meta import is_expert
from tests.multiproc import run_distributed
from tests.numerics import adam_trajectory_tolerance
from tests.zero.common import clone_state, no_decay, numpy_params, reference_adamw, token_batch, train_zero

WORLD, EP = 4, 2
EXPERTS = 4
STEPS = 10
LR, WD = 1e-2, 0.1
CLIP = 0.3  # below the gradient norm of every step of this run (checked): clipping scales each update
BUCKET = 300  # elements: several segments per half, parameters straddling chunk boundaries


class _GatherEP(torch.autograd.Function):
    """``[n, h]`` on each of the ``ep`` ranks -> ``[ep * n, h]`` (all-gather over ``ep``, in ep-rank order);
    backward: the sum over ``ep`` of the gathered gradient, this rank's rows."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.group, ctx.rank, ctx.n = group, rank, x.shape[0]
        out = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.cat(out)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None, None, None


class _SumEP(torch.autograd.Function):
    """The sum over ``ep`` (all-reduce); backward: the sum over ``ep`` of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class Expert(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.in_proj = nn.Linear(hidden, ffn)
        self.out_proj = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.out_proj(F.gelu(self.in_proj(x)))


class ToyMoE(nn.Module):
    """embedding -> layer norm -> one routed expert per token (residual) -> head; cross-entropy loss.

    ``topology``: None builds every expert (the single-process reference); otherwise this rank's ``ep`` share,
    with the ``ep`` collectives above. Dense weights come from seed 0, expert ``e`` from seed ``100 + e``: the
    same values in every layout.
    """

    def __init__(self, topology=None, vocab: int = 32, hidden: int = 16, ffn: int = 24):
        super().__init__()
        from hybrid.param_meta import set_expert

        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)
        self.ep = 1 if topology is None else topology.ep_size
        self.ep_rank = 0 if topology is None else topology.ep_rank
        self.group = None if topology is None else topology.group("ep")
        local = EXPERTS // self.ep
        self.local = range(self.ep_rank * local, (self.ep_rank + 1) * local)
        experts = {}
        for e in self.local:
            torch.manual_seed(100 + e)
            experts[str(e)] = Expert(hidden, ffn)
            for p in experts[str(e)].parameters():
                set_expert(p)
        self.experts = nn.ModuleDict(experts)

    def forward(self, x, y):
        h = self.embed(x)
        t = self.norm(h).flatten(0, 1)
        route = x.flatten() % EXPERTS
        if self.ep > 1:
            t = _GatherEP.apply(t, self.group, self.ep_rank, self.ep)
            routes = [torch.empty_like(route) for _ in range(self.ep)]
            dist.all_gather(routes, route, group=self.group)
            route = torch.cat(routes)
        out = torch.zeros_like(t)
        for e in self.local:
            idx = (route == e).nonzero().flatten()
            out = out.index_add(0, idx, self.experts[str(e)](t[idx]))
        if self.ep > 1:
            n = h.shape[0] * h.shape[1]
            out = _SumEP.apply(out, self.group)[self.ep_rank * n:(self.ep_rank + 1) * n]
        h = h + out.view_as(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _build(stage, **kwargs):
    from hybrid import Topology
    from tests.zero.common import make_zero

    topo = Topology(ep=EP)
    model = ToyMoE(topo)
    opt = make_zero(model, topo, stage=stage, lr=LR, weight_decay=WD, no_weight_decay=no_decay, clip_grad=CLIP,
                    bucket_size=BUCKET, **kwargs)
    return model, topo, opt


def _params(model, opt):
    with opt.gathered_parameters():
        return numpy_params(model)


def _run(stage, **kwargs):
    """10 steps; what the checks below read."""
    import torch.utils.checkpoint as checkpoint

    model, topo, opt = _build(stage, **kwargs)
    early_stop = getattr(checkpoint, "_enable_checkpoint_early_stop", None)
    opt.count_grad_zeros = True
    zeros = []

    def first_zeros(step, loss):  # before step 1's backward: step 0's count
        if step == 1:
            zeros.append(opt.get_num_zeros_in_grad())
        return loss

    out = train_zero(model, opt, topo, STEPS, micro=2, gas=1, loss_hook=first_zeros)
    # stage 3: both halves' forwards enter and leave torch's switch; it ends as it began
    assert getattr(checkpoint, "_enable_checkpoint_early_stop", None) == early_stop
    report = opt.comm_report()
    half = opt.expert
    view = half.topology
    with opt.gathered_parameters():  # stage 3: released parameters are empty between uses
        expert_numel = sum(p.numel() for n, p in model.named_parameters() if n.startswith("experts."))
    return {"params": _params(model, opt), "norms": out["norms"], "losses": out["losses"],
            "class": type(opt).__name__, "edp_bytes": sum(v["wire_bytes"] for k, v in report.items() if k.endswith("/edp")),
            "dp_bytes": sum(v["wire_bytes"] for k, v in report.items() if k.endswith("/dp")),
            "expert_names": sorted(r.name for r in half.param_index),
            "dense_names": sorted(r.name for r in opt.dense.param_index),
            "ep_rank": topo.ep_rank, "edp": (view.dp_size, view.dp_rank), "partitions": (opt.dense.partition_count,
                                                                                        half.partition_count),
            "expert_numel": expert_numel, "expert_memory": half.memory_report(), "memory": opt.memory_report(),
            "dense_memory": opt.dense.memory_report(), "num_parameters": opt.num_parameters(),
            "params_norm": opt.params_norm(), "first_zeros": zeros[0]}


def _resume(stage):
    """5 steps, save, 5 more; a fresh optimizer loads the saved state and runs the same 5: bit-identical."""
    model, topo, opt = _build(stage)
    train_zero(model, opt, topo, 5, micro=2, gas=1)
    saved = clone_state(opt.state_dict())
    tail = [token_batch(s, 2 * WORLD) for s in range(5, 10)]

    def more(model, opt):
        for x, y in tail:
            r = topo.dp_rank
            opt.backward(model(x[2 * r: 2 * r + 2], y[2 * r: 2 * r + 2]))
            opt.step()
            opt.zero_grad()
        return _params(model, opt)

    a = more(model, opt)
    model2, _, opt2 = _build(stage)
    opt2.load_state_dict(saved)
    b = more(model2, opt2)
    header = {k: saved[k] for k in ("format", "ep_size", "ep_rank", "edp_size", "edp_rank")}
    # the model file's state: every ep rank's experts on DP rank 0; each rank loads its own back from it
    topo.comm.reset_stats()
    whole = opt.model_state_for_save()
    sent = topo.comm.report().get("send/ep", {}).get("wire_bytes", 0)
    own_keys = sorted(whole)
    own_expert_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if is_expert(p))
    whole = topo.comm.all_gather_object(whole, "world")[0]  # what DP rank 0 wrote, read by every rank
    model3, _, opt3 = _build(stage)
    opt3.load_model_state(whole)
    return {"a": a, "b": b, "header": header, "expert_index": [r["name"] for r in saved["expert"]["param_index"]],
            "has_dense_index": "param_index" not in saved["dense"] and bool(saved["param_index"]),
            "whole_keys": sorted(whole), "reloaded": _params(model3, opt3), "own_keys": own_keys, "sent": sent,
            "own_expert_bytes": own_expert_bytes}


def _refusals():
    from hybrid.zero import ZeroConfigError

    out = {}
    for key, kwargs in (("two_level_reduce", {"two_level_reduce": True}), ("hpz", {"hpz_partition_size": 2}),
                        ("onebit", {"optimizer": "onebit_adam"})):
        try:
            _build(3 if key == "hpz" else 1, **kwargs)
            out[key] = None
        except ZeroConfigError as e:
            out[key] = str(e)
    # stage 3 gathers a module's own parameters together: a module with both kinds is refused, naming it
    from hybrid import Topology
    from hybrid.param_meta import set_expert
    from tests.zero.common import make_zero

    topo = Topology(ep=EP)
    model = ToyMoE(topo)
    set_expert(model.norm.weight)
    try:
        make_zero(model, topo, stage=3, lr=LR)
        out["mixed"] = None
    except ZeroConfigError as e:
        out["mixed"] = str(e)
    return out


def _bf16_memory():
    """ZeRO-1 on a bf16 model: the fp32 masters of each rank's experts are 1/edp of them (one training step)."""
    from hybrid import Topology
    from tests.zero.common import make_zero

    topo = Topology(ep=EP)
    model = ToyMoE(topo).to(torch.bfloat16)
    opt = make_zero(model, topo, stage=1, lr=LR, weight_decay=WD, no_weight_decay=no_decay, bucket_size=BUCKET)
    train_zero(model, opt, topo, 1, micro=2, gas=1)
    mem = opt.expert.memory_report()
    padded = sum(g.numel for g in opt.expert.groups)
    return {"master": mem["master"], "states": mem["optimizer_states"], "padded": padded,
            "used": sum(s.used for g in opt.expert.groups for s in g.segments),
            "numel": sum(p.numel() for n, p in model.named_parameters() if n.startswith("experts."))}


def _suite(cases):
    res = {}
    for case in cases:
        if case == "bf16":
            res[case] = _bf16_memory()
        elif case == "resume":
            res[case] = _resume(2)
        elif case == "refusals":
            res[case] = _refusals()
        else:
            stage, kwargs = case
            res[case] = _run(stage, **dict(kwargs))
    return res


FAST = [(2, ())]
SLOW = [(0, ()), (1, ()), (3, (("persistence_threshold", 0),)), (1, (("offload_optimizer", "cpu"),)), (2, (("offload_optimizer", "cpu"),)),
        (2, (("overlap_param_gather", True),)), (3, (("persistence_threshold", 30),)),
        (3, (("persistence_threshold", 0), ("offload_optimizer", "cpu")))]


@pytest.fixture(scope="module")
def reference():
    return reference_adamw(ToyMoE(), STEPS, 2 * WORLD, lr=LR, weight_decay=WD, clip=CLIP)


@pytest.fixture(scope="module")
def fast():
    return run_distributed(_suite, WORLD, FAST + ["resume", "refusals"], timeout=300)


@pytest.fixture(scope="module")
def slow():
    return run_distributed(_suite, WORLD, SLOW + ["bf16"], timeout=600)


def _reference_first_zeros() -> int:
    """Exactly-zero elements of the first step's whole gradient in one process (embedding rows of tokens the
    batch lacks, and so on)."""
    model = ToyMoE()
    x, y = token_batch(0, 2 * WORLD)
    model(x, y).backward()
    return sum(int((p.grad == 0).sum()) for p in model.parameters())


def _check_parity(results, reference, case):
    _, ref_norms, ref_params = reference
    assert min(ref_norms) > CLIP  # clipping acts on every step: the global norm decides every update
    tol = adam_trajectory_tolerance(STEPS, LR)
    zeros = _reference_first_zeros()
    assert zeros > 0
    for r in results:
        assert r[case]["first_zeros"] == zeros  # each element counted once, dense over dp and experts over edp
        got = r[case]
        assert got["class"] == "ExpertSplitOptimizer"
        # one global norm, the same on every rank, equal to the single process's (fp32 sums in another order)
        assert max(abs(a - b) / b for a, b in zip(got["norms"], ref_norms)) < 1e-5
        mine = {n: v for n, v in got["params"].items() if not n.startswith("experts.") or
                int(n.split(".")[1]) in range(got["ep_rank"] * 2, got["ep_rank"] * 2 + 2)}
        assert set(mine) == set(got["params"])  # this rank's model holds its own experts only
        for name, value in mine.items():
            assert abs(value - ref_params[name]).max() < tol, (name, case)


def _check_layout(results, case):
    for rank, r in enumerate(results):
        got = r[case]
        ep_rank = rank % EP  # dp index d = ep_rank + ep * edp_rank (hybrid.grid)
        assert got["ep_rank"] == ep_rank and got["edp"] == (WORLD // EP, rank // EP)
        assert got["expert_names"] == sorted(f"experts.{e}.{m}.{k}" for e in (2 * ep_rank, 2 * ep_rank + 1)
                                             for m in ("in_proj", "out_proj") for k in ("weight", "bias"))
        assert not any(n.startswith("experts.") for n in got["dense_names"])
        assert got["edp_bytes"] > 0 and got["dp_bytes"] > 0  # expert traffic is counted under edp
        assert got["num_parameters"] == got["expert_numel"] + sum(
            v.size for n, v in got["params"].items() if not n.startswith("experts."))


def test_stage2_matches_single_process_adamw(fast, reference):
    _check_parity(fast, reference, FAST[0])
    _check_layout(fast, FAST[0])
    for r in fast:
        got = r[FAST[0]]
        assert got["partitions"] == (WORLD, WORLD // EP)
        # Adam moments of this rank's experts only, cut in edp = 2 partitions (padding to 128-byte chunks aside)
        states = got["expert_memory"]["optimizer_states"]
        assert 2 * 4 * got["expert_numel"] / 2 <= states < 2 * 4 * (got["expert_numel"] / 2 + 4 * 32 * 2)
        assert got["memory"]["optimizer_states"] == states + got["dense_memory"]["optimizer_states"]
    # the parameter norm counts every dense element once and every expert once over the world
    _, _, ref_params = reference
    ref_norm = sum(float((v.astype("float64") ** 2).sum()) for v in ref_params.values()) ** 0.5
    for r in fast:
        assert abs(r[FAST[0]]["params_norm"] - ref_norm) / ref_norm < 1e-4


def test_resume_is_bit_identical(fast):
    for rank, r in enumerate(fast):
        got = r["resume"]
        assert got["header"] == {"format": "hybrid.zero.experts/1", "ep_size": EP, "ep_rank": rank % EP,
                                 "edp_size": WORLD // EP, "edp_rank": rank // EP}
        assert got["has_dense_index"]
        assert {n.split(".")[1] for n in got["expert_index"]} == {str(2 * (rank % EP)), str(2 * (rank % EP) + 1)}
        for name, value in got["a"].items():
            assert (value == got["b"][name]).all(), name
            assert (value == got["reloaded"][name]).all(), name  # weights-only load of the model file
        assert got["whole_keys"] == sorted(ToyMoE().state_dict())  # every expert, as one process holds them
        # only the writer holds the other ranks' experts: DP rank 1 (ep rank 1 of DP rank 0's ep group) sends its
        # own, tensor by tensor, and keeps its own shard; the ranks of the other ep group send nothing
        if rank == 0:
            assert got["own_keys"] == got["whole_keys"] and got["sent"] == 0
        else:
            assert got["own_keys"] != got["whole_keys"]
            assert got["sent"] == (got["own_expert_bytes"] if rank < EP else 0)


def test_refusals_name_the_key(fast):
    got = fast[0]["refusals"]
    assert "zero.two_level_reduce" in got["two_level_reduce"]
    assert "zero.hpz_partition_size" in got["hpz"]
    assert "optimizer.type = 'onebit_adam'" in got["onebit"]
    assert "zero.stage = 3" in got["mixed"] and "norm hold both" in got["mixed"]


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=lambda c: f"stage{c[0]}" + "".join(f"-{k}" for k, _ in c[1]))
def test_other_stages_match_single_process_adamw(slow, reference, case):
    _check_parity(slow, reference, case)
    _check_layout(slow, case)
    for r in slow:
        got = r[case]
        partitions = (1, 1) if case[0] == 0 else (WORLD, WORLD // EP)
        assert got["partitions"] == partitions
        if dict(case[1]).get("offload_optimizer") == "cpu":
            assert got["expert_memory"]["host_bytes"] > 0
        if case[0] == 3:  # the expert modules are partitioned over edp and gathered for use
            assert got["expert_memory"]["peak_live_parameters"] > 0


@pytest.mark.slow
def test_bf16_expert_masters_are_one_edp_share(slow):
    for r in slow:
        got = r["bf16"]
        assert got["used"] == got["numel"]  # the expert half holds this rank's experts and nothing else
        # fp32 masters and two fp32 moments of 1/edp of the (padded) expert buffers
        assert got["master"] == 4 * got["padded"] // (WORLD // EP)
        assert got["states"] == 2 * got["master"]


# ---- the engine's checkpoints with model_zoo's MoE layer ---------------------------------------------------------
GPT_MOE = dict(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, seq_length=8, bias=False, position="rope",
               norm="rmsnorm", mlp="swiglu", tie_embeddings=False, num_experts=4, moe_router_topk=2,
               moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.01)
GPT_CFG = {"optimizer": {"type": "adamw", "lr": LR, "weight_decay": WD}, "steps_per_print": 0,
           "micro_batch_size": 2, "global_batch_size": 2 * WORLD, "clip_grad": 0.5}


def _engine_resume(path, stage):
    """GPTModel (MoE, ep 2) under the engine: 3 steps, save, 3 more; a fresh engine loads the checkpoint and runs
    the same 3. Returns the names of the weights that differ (none: bit-identical)."""
    import hybrid
    from hybrid.config.parse import config_from_dict
    from model_zoo import GPTConfig, GPTModel

    topo = hybrid.Topology(ep=EP, timeout_s=120)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, GPT_MOE["vocab_size"], (6 * 2 * WORLD, GPT_MOE["seq_length"]), generator=g)

    def build():
        config = config_from_dict({**GPT_CFG, "zero": {"stage": stage, "persistence_threshold": 0}})
        model = GPTModel(GPTConfig(**GPT_MOE), topo, seed=1)
        return model, hybrid.initialize(model, config, topology=topo)

    def train(engine, steps):
        for step in steps:
            first = (step * WORLD + topo.dp_rank) * 2
            x = ids[first:first + 2]
            engine.train_batch([{"input_ids": x, "labels": x.roll(1, 1)}], dp_mean=True)

    def weights(model, engine):
        with engine.gathered_parameters():
            return {n: t.detach().clone() for n, t in model.state_dict().items()}

    model, engine = build()
    assert type(engine.optimizer).__name__ == "ExpertSplitOptimizer"
    train(engine, range(3))
    engine.save_checkpoint(path, 3)
    train(engine, range(3, 6))
    a = weights(model, engine)
    engine.close()
    model2, engine2 = build()
    engine2.load_checkpoint(path)
    train(engine2, range(3, 6))
    b = weights(model2, engine2)
    engine2.close()
    topo.close()
    return sorted(n for n in a if not torch.equal(a[n], b[n]))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_engine_checkpoint_resumes_bit_identically(tmp_path, stage):
    for differs in run_distributed(_engine_resume, WORLD, str(tmp_path / "ckpt"), stage, timeout=300):
        assert differs == []
