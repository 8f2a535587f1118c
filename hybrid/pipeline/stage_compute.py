"""What the pipeline executor asks of the model: :class:`StageCompute`, the forward and backward of one part.

:meth:`hybrid.pipeline.PipelineExecutor.step` owns the order of work and the
transfers between stages; for each action of its schedule it calls back into
one :class:`StageCompute` for the computation:

* ``forward(chunk, part, hidden, microbatch)`` for a forward action;
* ``backward(output, grad, chunk)`` for a backward action.

The engine passes :class:`hybrid.engine.stage.EngineStage` (its model under
autocast, backpropagated through its ZeRO optimizer); :class:`AutogradStage`
wraps a plain forward function for tests and benchmarks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol

import torch


class StageCompute(Protocol):
    """The computation of this rank's pipeline stage, one part at a time (``v`` chunks, part ``k`` of the
    whole model is chunk ``k // pp`` of rank ``k % pp``)."""

    def forward(self, chunk: Any, part: int, hidden: Optional[torch.Tensor], microbatch: Any) -> torch.Tensor:
        """Run model part ``part`` on one micro-batch.

        ``chunk``: the executor's entry for this rank's model chunk (a module, or an index into one model);
        ``hidden``: the activation received from part ``part - 1`` (for the GPT models ``[s, b, h]``, or
        ``[s/tp, b, h]`` under sequence parallelism), None on part 0, which reads ``microbatch`` itself.
        Returns the activation for the next part, of the executor's ``activation_shape``, or on the last part
        the micro-batch's scalar loss.
        """

    def backward(self, output: torch.Tensor, grad: Optional[torch.Tensor], chunk: int) -> None:
        """Backpropagate one part's ``output`` through model chunk ``chunk`` (``0 .. v-1``).

        ``grad`` is None for the last part's loss, else the gradient of ``output`` received from the next part
        (the same shape). Gradients accumulate in the parameters as in plain gradient accumulation.
        """


@dataclasses.dataclass(frozen=True)
class AutogradStage:
    """A :class:`StageCompute` from a forward function, backpropagated by plain autograd.

    ``forward_fn(chunk, part, hidden, microbatch)`` has :meth:`StageCompute.forward`'s arguments and result.
    """

    forward_fn: Callable[[Any, int, Optional[torch.Tensor], Any], torch.Tensor]

    def forward(self, chunk: Any, part: int, hidden: Optional[torch.Tensor], microbatch: Any) -> torch.Tensor:
        return self.forward_fn(chunk, part, hidden, microbatch)

    def backward(self, output: torch.Tensor, grad: Optional[torch.Tensor], chunk: int) -> None:
        torch.autograd.backward(output, grad)
