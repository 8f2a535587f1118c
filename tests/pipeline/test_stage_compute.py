"""The executor's contract with the model: one StageCompute object, called in the schedule's order.

* :class:`~hybrid.engine.stage.EngineStage` and :class:`~hybrid.pipeline.AutogradStage` have
  :class:`~hybrid.pipeline.StageCompute`'s methods with its parameters, so the step's path
  (``Engine.train_batch -> PipelineExecutor.step -> EngineStage.forward/backward``) can be followed by name;
* at pp=1 the executor calls ``forward`` and ``backward`` once per micro-batch, in the schedule's order, with
  the last part's loss and ``grad=None``;
* the engine's ``train_batch`` goes through its ``pipeline_stage`` (one process).
"""

import inspect

import pytest
import torch

from hybrid.engine.stage import EngineStage
from hybrid.pipeline import AutogradStage, PipelineExecutor, StageCompute
from hybrid.pipeline import schedule as schedules
from hybrid.pipeline.actions import FORWARD
from hybrid.topology import Topology


def _parameters(cls, method):
    return list(inspect.signature(getattr(cls, method)).parameters)


@pytest.mark.parametrize("implementation", [EngineStage, AutogradStage])
def test_implementations_have_the_contracts_methods(implementation):
    for method in ("forward", "backward"):
        assert _parameters(implementation, method) == _parameters(StageCompute, method)


class RecordingStage:
    """A StageCompute that records its calls: one linear part, the loss the mean of its output."""

    def __init__(self, weight: torch.nn.Parameter):
        self.weight, self.calls = weight, []

    def forward(self, chunk, part, hidden, microbatch):
        self.calls.append(("forward", chunk, part, hidden is None, float(microbatch.sum())))
        return (microbatch @ self.weight).mean()

    def backward(self, output, grad, chunk):
        self.calls.append(("backward", chunk, grad is None))
        torch.autograd.backward(output, grad)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_executor_calls_one_stage_object_in_schedule_order(schedule):
    weight = torch.nn.Parameter(torch.ones(3, 2))
    stage = RecordingStage(weight)
    microbatches = [torch.full((4, 3), float(i + 1)) for i in range(3)]
    executor = PipelineExecutor(Topology(), ["only-chunk"], schedule, activation_shape=lambda mb: torch.Size((4, 2)),
                                activation_dtype=torch.float32)
    stats = executor.step(microbatches, stage)
    expected = []
    for action in schedules.build(schedule, 0, 1, len(microbatches), 1):
        if action.kind == FORWARD:
            expected.append(("forward", "only-chunk", 0, True, float(microbatches[action.microbatch].sum())))
        else:
            expected.append(("backward", 0, True))
    assert stage.calls == expected
    assert stats.losses == [float((mb @ torch.ones(3, 2)).mean()) for mb in microbatches]
    # plain gradient accumulation: d/dW of sum_i mean(x_i W) = sum_i column means of x_i, for each output
    assert torch.equal(weight.grad, torch.full((3, 2), (1.0 + 2.0 + 3.0) / 2))


def test_forward_only_never_calls_backward():
    stage = RecordingStage(torch.nn.Parameter(torch.ones(3, 2)))
    executor = PipelineExecutor(Topology(), [0], "1f1b", activation_shape=lambda mb: torch.Size((4, 2)),
                                activation_dtype=torch.float32)
    with torch.no_grad():
        executor.step([torch.ones(4, 3)] * 2, stage, train=False)
    assert [c[0] for c in stage.calls] == ["forward", "forward"]


def test_train_batch_runs_through_the_engines_pipeline_stage(monkeypatch):
    import hybrid
    from model_zoo import GPTConfig, GPTModel

    topo = Topology()
    cfg = GPTConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, seq_length=8,
                    max_position_embeddings=8)
    engine = hybrid.initialize(GPTModel(cfg, topo), {"micro_batch_size": 1, "gradient_accumulation_steps": 2},
                               topology=topo)
    assert isinstance(engine.pipeline_stage, EngineStage) and engine.pipeline_stage.whole_model
    seen = []
    for method in ("forward", "backward"):
        original = getattr(EngineStage, method)
        monkeypatch.setattr(EngineStage, method,
                            lambda self, *a, _m=method, _o=original: (seen.append(_m), _o(self, *a))[1])
    batch = {"input_ids": torch.zeros(1, 8, dtype=torch.long), "labels": torch.zeros(1, 8, dtype=torch.long)}
    updated, loss = engine.train_batch([batch, batch])
    assert updated and loss > 0
    assert sorted(seen) == ["backward", "backward", "forward", "forward"]
    engine.close()
