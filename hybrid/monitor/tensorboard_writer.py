"""TensorBoard events of a training run, x-axis = iteration: a sink of the monitor's scalar stream.

What is written, and at which step, is decided by :class:`hybrid.monitor.scalars.ScalarStream` (its docstring
lists the tags); this module writes it as event files, the hyperparameters as a markdown table under the text
tag ``hyperparameters``.
"""

from __future__ import annotations

from typing import Any, Mapping

from hybrid.monitor.scalars import (CHECKPOINT_TAGS, HPARAMS_TAG, TEST_TAGS, TRAIN_TAGS, VALID_TAGS,  # noqa: F401
                                    ScalarStream, evaluation_tags, train_scalars)


def hparams_markdown(hparams: Mapping[str, Any]) -> str:
    rows = [f"| {k} | {_cell(v)} |" for k, v in sorted(hparams.items())]
    return "\n".join(["| hyperparameter | value |", "| --- | --- |", *rows])


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


class TensorBoardSink:
    """Writes a :class:`~hybrid.monitor.scalars.ScalarStream` to event files in ``log_dir``."""

    def __init__(self, log_dir: str, flush_secs: int = 30):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when used

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=log_dir, flush_secs=flush_secs)

    def add_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, global_step=step)

    def add_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._writer.add_text(HPARAMS_TAG, hparams_markdown(hparams), global_step=0)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class TensorBoardWriter(ScalarStream):
    """The monitor's scalars to TensorBoard alone (for tools that want event files and nothing else)."""

    def __init__(self, log_dir: str, flush_secs: int = 30):
        super().__init__([TensorBoardSink(log_dir, flush_secs)])
        self.log_dir = log_dir
