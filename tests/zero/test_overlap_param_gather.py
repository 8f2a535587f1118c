"""``zero.overlap_param_gather``: stages 1-2 leave the updated weights' all-gather in flight until forward needs it.

One spawn of 4 gloo ranks (TP 2 x DP 2) trains the model zoo's GPT with and without the overlap. The
gathers copy the same bytes whenever they land, and every kernel runs in the same order, so the two
runs must agree bit for bit (fp32, bf16, int8 weights, bf16 with the optimizer offloaded); the
overlapped run must also match one process's AdamW. Every torch function forward calls is watched
for a parameter whose gather was not waited for, and the first module must start while every
segment's gather is still in flight. One process checks the same reads for each model family, with
a segment per few parameters.
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.multiproc import run_distributed
from tests.zero.common import dp_mean, max_rel_diff, reference_adamw, rel_diff_list, train_zero

WORLD = 4
STEPS = 6
LR, WD = 1e-3, 0.1
GLOBAL = 8
BUCKET = 30_000  # several segments per group, so forward reaches them one after another


def gpt_config():
    from model_zoo import get_preset

    # as tests/zero/test_gpt_parity.py: well conditioned, so 1e-5 measures the arithmetic; tied embeddings,
    # so the LM head reads a weight of the first segment
    return get_preset("tiny").replace(num_layers=2, hidden_size=64, num_heads=4, seq_length=16,
                                      vocab_size=500, bias=False, init_std=0.1)


class _StaleReads(TorchFunctionMode):
    """Records every parameter passed to a torch function before its gather was waited for. Reads of
    metadata (``dtype``, ``shape``, ...) are not reads of the values."""

    METADATA = {"__get__", "size", "dim", "numel", "stride", "is_contiguous", "is_floating_point"}

    def __init__(self, deferred, names):
        super().__init__()
        self.deferred, self.names, self.stale = deferred, names, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") not in self.METADATA:
            for a in (*args, *kwargs.values()):
                for t in (a if isinstance(a, (list, tuple)) else (a,)):
                    if isinstance(t, torch.nn.Parameter) and id(t) in self.names and not self.deferred.has_landed(t):
                        self.stale.append(self.names[id(t)])
        return func(*args, **kwargs)


class _Watch:
    """Around every forward of ``model``: the gathers still in flight when it starts, and the parameters a
    torch function received before their gather was waited for (:class:`_StaleReads`)."""

    def __init__(self, model, deferred):
        self.in_flight_at_start = []
        self._deferred = deferred
        self.mode = _StaleReads(deferred, {id(p): n for n, p in model.named_parameters()})
        model.register_forward_pre_hook(self._start)
        model.register_forward_hook(self._end)

    @property
    def stale(self):
        return self.mode.stale

    def _start(self, module, args):
        self.in_flight_at_start.append(self._deferred.in_flight)
        self.mode.__enter__()

    def _end(self, module, args, output):
        self.mode.__exit__(None, None, None)


def _train(topo, stage, overlap, dtype=torch.float32, **zero):
    from hybrid.tensor_parallel.gather import full_state
    from model_zoo import GPTModel
    from tests.zero.common import make_zero

    cfg = gpt_config()
    model = GPTModel(cfg, topo, dtype=dtype)
    opt = make_zero(model, topo, stage=stage, lr=LR, weight_decay=WD, no_weight_decay=lambda n, p: p.ndim < 2,
                    bucket_size=BUCKET, overlap_param_gather=overlap, **zero)
    watch = _Watch(model, opt._deferred) if overlap else None
    out = train_zero(model, opt, topo, STEPS, micro=2 * topo.tp_size, gas=1, vocab=cfg.vocab_size,
                     seq=cfg.seq_length, copy=dtype != torch.float32)
    in_flight_after_step = opt._deferred.in_flight if overlap else 0
    with opt.gathered_parameters():  # waits for the gathers in flight, as every reader outside forward must
        state = {n: t.float().numpy() for n, t in full_state(model, topo).items()}
    res = {"losses": out["losses"], "norms": out["norms"], "params": state, "tp_rank": topo.tp_rank,
           "segments": len(opt.reducer.order), "in_flight_after_step": in_flight_after_step}
    if watch is not None:
        res.update(stale=watch.stale, in_flight_at_start=watch.in_flight_at_start)
    opt.remove_hooks()
    return res


# name: (stage, dtype, other zero keys)
RUNS = {"fp32-z1": (1, torch.float32, {}), "fp32-z2": (2, torch.float32, {}),
        "bf16-z2": (2, torch.bfloat16, {}), "qw8-z1": (1, torch.float32, {"quantized_weights": "int8"}),
        "bf16-z2-offload": (2, torch.bfloat16, {"offload_optimizer": "cpu"})}


def _suite():
    from hybrid import Topology

    topo = Topology(tp=2)
    return {(name, overlap): _train(topo, stage, overlap, dtype, **zero)
            for name, (stage, dtype, zero) in RUNS.items() for overlap in (False, True)}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_suite, WORLD, timeout=300)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_overlapped_gathers_train_bit_for_bit_as_waited_ones(results, name):
    for r in results:
        plain, overlapped = r[(name, False)], r[(name, True)]
        assert overlapped["losses"] == plain["losses"]
        assert overlapped["norms"] == plain["norms"]
        for key, value in plain["params"].items():
            assert (overlapped["params"][key] == value).all(), key


@pytest.mark.parametrize("name", sorted(RUNS))
def test_forward_waits_for_each_segment_before_its_modules_and_not_sooner(results, name):
    for r in results:
        run = r[(name, True)]
        assert run["segments"] > 2
        assert run["stale"] == [], run["stale"]
        # the step returns with every segment's gather in flight; the first module of the next forward
        # starts before any is waited for (a step-0 forward has nothing in flight)
        assert run["in_flight_after_step"] == run["segments"]
        assert run["in_flight_at_start"] == [0] + [run["segments"]] * (STEPS - 1)


def test_overlapped_stage_1_matches_one_process_adamw(results):
    from hybrid import Topology
    from hybrid.tensor_parallel.gather import full_state
    from model_zoo import GPTModel

    cfg, local = gpt_config(), Topology.local()
    ref_losses, ref_norms, ref_params = reference_adamw(
        GPTModel(cfg, local), STEPS, GLOBAL, lr=LR, weight_decay=WD, vocab=cfg.vocab_size, seq=cfg.seq_length,
        export=lambda m: full_state(m, local))
    key = ("fp32-z1", True)
    # the bound test_gpt_parity.py holds the same runs without the overlap to
    assert rel_diff_list(dp_mean([r[key]["losses"] for r in results if r[key]["tp_rank"] == 0]), ref_losses) < 1e-5
    assert max_rel_diff(results[0][key]["params"], ref_params) < 1e-5
    for r in results:
        assert rel_diff_list(r[key]["norms"], ref_norms) < 1e-5


@pytest.mark.parametrize("stage", [0, 3])
def test_stages_without_a_gather_after_the_step_refuse_it(stage):
    from hybrid import Topology
    from hybrid.zero.flat_buffer import ZeroConfigError
    from tests.zero.common import make_zero

    model = torch.nn.Linear(4, 4)
    why = "prefetches the next" if stage == 3 else "no weights are gathered after the step"
    with pytest.raises(ZeroConfigError, match=rf"zero.overlap_param_gather needs ZeRO stage 1 or 2: .*{why}"):
        make_zero(model, Topology.local(), stage=stage, overlap_param_gather=True)


@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa", "qwen3-tiny"])
def test_every_parameter_is_read_after_its_gather_was_waited_for(preset):
    """Every read of a parameter in forward, whichever module makes it, comes after its segment's wait: one
    process (the gathers have nothing to move, the bookkeeping is the same), a segment per few parameters,
    and every torch function watched for a parameter argument whose gather is still pending."""
    from hybrid import Topology
    from model_zoo import GPTModel, get_preset
    from tests.zero.common import make_zero, token_batch

    if preset == "qwen3-tiny":  # query/key norms, a head dim of its own, an untied head
        cfg = get_preset("tiny-gqa").replace(qk_norm=True, kv_channels=24, tie_embeddings=False)
    else:
        cfg = get_preset(preset)
    cfg = cfg.replace(num_layers=2, seq_length=16, vocab_size=256)
    model = GPTModel(cfg, Topology.local())
    opt = make_zero(model, Topology.local(), stage=1, bucket_size=2_000, overlap_param_gather=True)
    names = {id(p): n for n, p in model.named_parameters()}
    x, y = token_batch(0, 2, cfg.vocab_size, cfg.seq_length, False)
    opt.backward(model(x, y))
    opt.step()
    assert opt._deferred.in_flight == len(opt._deferred.order) > 2 * cfg.num_layers
    with _StaleReads(opt._deferred, names) as watch:
        model(x, y)
    assert watch.stale == []
    opt.remove_hooks()
