"""Megatron-LM's --decoupled-lr / --decoupled-min-lr (optimizer.decoupled_lr, decoupled_min_lr): the input
embedding and output layer weights step at their own peak and floor on the same schedule. SGD on a loss whose
gradient is known exactly (``sum(p * c)``), so each step's change is the rate times ``c``, checked against the
schedule computed by hand (tests/hand_lr.py) for each parameter, at every ZeRO stage."""

import pytest
import torch

import hybrid
from hybrid.config import ConfigError, config_from_command_line, config_from_dict
from tests.hand_lr import warmup_cosine
from tests.numerics import U32

LR, MIN_LR, DEC_LR, DEC_MIN_LR, WARMUP, DECAY, STEPS = 1e-2, 1e-4, 5e-2, 1e-3, 2, 6, 8


class Exact(torch.nn.Module):
    """A model_zoo-shaped set of parameters (an embedding, a layer, an output layer) whose loss ``sum(p * c)`` has
    the gradient ``c`` exactly."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Module()
        self.embedding.word_embeddings = torch.nn.Embedding(10, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.output_layer = torch.nn.Linear(4, 10, bias=False)

    def forward(self, coeffs):
        return sum((p * coeffs[n]).sum() for n, p in self.named_parameters())


def coefficients(step):
    g = torch.Generator().manual_seed(step)
    return {n: torch.randn(p.shape, generator=g) for n, p in Exact().named_parameters()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_embedding_and_output_weights_follow_their_own_schedule(stage):
    torch.manual_seed(0)
    model = Exact()
    engine = hybrid.initialize(model, {
        "optimizer": {"type": "sgd", "lr": LR, "decoupled_lr": DEC_LR, "decoupled_min_lr": DEC_MIN_LR},
        "scheduler": {"type": "cosine", "warmup_iters": WARMUP, "decay_iters": DECAY, "min_lr": MIN_LR},
        "zero": {"stage": stage}, "steps_per_print": 0})
    own = {"embedding.word_embeddings.weight", "output_layer.weight"}
    for t in range(STEPS):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        c = coefficients(t)
        engine.backward(engine(c))
        engine.step()
        for n, p in model.named_parameters():
            rate = warmup_cosine(t, DEC_LR, DEC_MIN_LR, WARMUP, DECAY) if n in own else \
                warmup_cosine(t, LR, MIN_LR, WARMUP, DECAY)
            want = before[n].double() - rate * c[n].double()
            bound = 2 * U32 * (before[n].double().abs() + rate * c[n].double().abs()) + 1e-30
            assert ((p.detach().double() - want).abs() <= bound).all(), (t, n)


def test_the_schedule_records_the_decoupled_rate_and_the_flags_set_it():
    cfg = config_from_command_line(["--decoupled-lr", "5e-4", "--decoupled-min-lr", "4.5e-5", "--lr", "3e-4"])
    assert (cfg.optimizer.decoupled_lr, cfg.optimizer.decoupled_min_lr) == (5e-4, 4.5e-5)
    from hybrid.optim.lr_schedule import LRSchedule

    s = LRSchedule(3e-4, decay_style="linear", warmup_iters=2, decay_iters=10, min_lr=3e-5, decoupled_lr=5e-4)
    assert s.decoupled == (5e-4, 3e-5)  # the floor defaults to min_lr, as Megatron's
    assert s.settings()["decoupled_lr"] == 5e-4 and "decoupled_lr" not in LRSchedule(3e-4).settings()


@pytest.mark.parametrize("config,match", [
    ({"optimizer": {"decoupled_min_lr": 1e-4}}, "'optimizer.decoupled_lr' is unset, but optimizer.decoupled_min_lr "
                                                "needs it"),
    ({"optimizer": {"decoupled_lr": 1e-3, "type": "onebit_adam"}}, "is not supported with onebit_adam: it steps "
                                                                   "every parameter at one rate"),
])
def test_what_it_cannot_do_is_named(config, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict(config)
