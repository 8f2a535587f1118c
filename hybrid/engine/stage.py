"""The engine's side of a pipeline step: :class:`EngineStage`, the forward and backward of one model part.

Every :meth:`hybrid.engine.Engine.train_batch` (at pp=1 too) runs::

    Engine.train_batch -> PipelineExecutor.step(microbatches, EngineStage)
        -> for each action of the schedule: EngineStage.forward / EngineStage.backward
    -> Engine's optimizer step at the end of the global batch

:class:`EngineStage` is the :class:`~hybrid.pipeline.stage_compute.StageCompute`
the executor calls: the model under the engine's autocast forward, and the
ZeRO optimizer's backward (which applies the loss scale and the accumulation
average, and reduces the gradients).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover
    from hybrid.zero import ZeroOptimizer


def autocast(device_type: str, dtype: Optional[torch.dtype]):
    """``torch.autocast`` to ``dtype`` on ``device_type``; a context that does nothing when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def scale_side_losses(module: torch.nn.Module, optimizer: "ZeroOptimizer") -> None:
    """Give the losses a model adds to the backward pass at their own layers (an MoE layer's balancing losses:
    ``module.moe_aux_scale``, see ``model_zoo.moe``) the factor the language-model loss gets from the optimizer:
    the loss scale over the accumulation steps. Called before every backward pass."""
    scale = getattr(module, "moe_aux_scale", None)
    if scale is not None:
        scale.value = optimizer.loss_scale / optimizer.gradient_accumulation_steps


def loss_tokens(microbatch: Mapping[str, Any]) -> torch.Tensor:
    """The denominator of the model's mean loss on ``microbatch``: the sum of its ``loss_mask`` ``[b, s]``, or
    the count of its ``labels`` ``[b, s]`` without one (float64 scalar, on the labels' device)."""
    mask = microbatch.get("loss_mask")
    if mask is not None:
        return mask.sum(dtype=torch.float64)
    labels = microbatch["labels"]
    return torch.tensor(float(labels.numel()), dtype=torch.float64, device=labels.device)


@dataclasses.dataclass(frozen=True)
class EngineStage:
    """This rank's pipeline stage as the executor computes it (a :class:`~hybrid.pipeline.StageCompute`).

    ``module``: a pipeline-aware model (``forward_part(part, hidden, **microbatch)``, such as
    :class:`model_zoo.GPTModel`); ``whole_model``: the stage is the whole model (one part: pp=1 and one
    chunk), run through ``module(**microbatch)``; ``autocast_device`` / ``autocast_dtype``: the engine's
    autocast (no dtype: none). ``token_scale`` (``calculate_per_token_loss``; None: off): the last part
    multiplies each micro-batch's mean loss by its token count (:func:`loss_tokens`) times this,
    ``accumulation * dp / N`` for the global batch's ``N`` tokens, so that after the optimizer's
    ``1 / accumulation`` and its ``"dp"`` average the gradient is that of the summed token losses over ``N``.
    """

    module: torch.nn.Module
    optimizer: "ZeroOptimizer"
    whole_model: bool
    autocast_device: str
    autocast_dtype: Optional[torch.dtype]
    token_scale: Optional[float] = None

    def forward(self, chunk: int, part: int, hidden: Optional[torch.Tensor],
                microbatch: Mapping[str, Any]) -> torch.Tensor:
        """Part ``part`` on ``microbatch`` (``input_ids`` ``[b, s]``, ``labels``, ...): the activation for the next
        part (``[s, b, h]``), or the last part's scalar loss."""
        with autocast(self.autocast_device, self.autocast_dtype):
            if self.whole_model:
                # The whole model: through its __call__, so that hooks on the model itself run. ZeRO-3's do (the
                # root's pre-hook installs its saved-tensor hooks and watches reads of a tied head's weight).
                out = self.module(**microbatch)
            else:
                out = self.module.forward_part(part, hidden, **microbatch)
        last = self.whole_model or part == self.module.split.num_parts - 1
        if self.token_scale is None or not last or microbatch.get("labels") is None:
            return out
        return out * (loss_tokens(microbatch) * self.token_scale).to(out.dtype)

    def backward(self, output: torch.Tensor, grad: Optional[torch.Tensor], chunk: int) -> None:
        """Backpropagate through the optimizer: the loss (``grad`` None, scaled there) or a part's output with the
        gradient received for it; ``chunk`` tells the optimizer which chunk's gradients are complete."""
        scale_side_losses(self.module, self.optimizer)
        if grad is None:
            self.optimizer.backward(output, chunk=chunk)
        else:
            self.optimizer.backward_from(output, grad, chunk=chunk)
