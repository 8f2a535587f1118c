"""Weights & Biases: a sink of the monitor's scalar stream (``--wandb-project``, Megatron-LM's flags).

It logs exactly what TensorBoard logs (:class:`hybrid.monitor.scalars.ScalarStream` decides the tags and
steps for both): each event is one ``run.log`` of its tags plus :data:`STEP_KEY`, the iteration, which every
tag is plotted against (``define_metric``), so W&B's x-axis is TensorBoard's step. A checkpoint's tags arrive
at the iteration that was saved, which a background save reports a few iterations later: W&B's own step
counter would drop such a point, a step metric of our own takes it. The settings become the run's config.

The mode (:func:`wandb_mode`): ``WANDB_MODE`` when set (``online``, ``offline``, ``disabled``: wandb's own
variable); otherwise online when an API key is at hand (``WANDB_API_KEY``, or a ``wandb login`` entry in
``~/.netrc`` for the W&B host), else offline, so that a run without credentials or network never waits for
either. An offline run is uploaded later with ``wandb sync DIR/wandb/offline-run-*``.

``wandb`` is an optional dependency (``pip install 'hybrid[wandb]'``); :func:`wandb_problem` refuses the flags
without it, at start-up.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
import urllib.parse
from typing import Any, Mapping, Optional, Tuple

STEP_KEY = "iteration"  # the x-axis of every tag: TensorBoard's step
INSTALL = "pip install 'hybrid[wandb]' (or pip install wandb)"
DEFAULT_HOST = "https://api.wandb.ai"


def wandb_problem(project: Optional[str]) -> Optional[str]:
    """Why ``--wandb-project`` cannot be honoured here (the package is missing), or None."""
    if project and importlib.util.find_spec("wandb") is None:
        return f"--wandb-project logs to Weights & Biases, whose package is not installed: {INSTALL}"
    return None


def _has_stored_key(environ: Mapping[str, str]) -> bool:
    """Whether ``wandb login`` stored a key for the W&B host in the netrc file (``NETRC`` or ``~/.netrc``)."""
    host = urllib.parse.urlparse(environ.get("WANDB_BASE_URL", DEFAULT_HOST)).hostname
    path = environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return bool(host) and netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(environ: Mapping[str, str] = os.environ) -> Tuple[str, str]:
    """``(mode, why)``: ``WANDB_MODE`` if set, else ``online`` with an API key at hand, else ``offline``."""
    if environ.get("WANDB_MODE"):
        return environ["WANDB_MODE"], "WANDB_MODE"
    if environ.get("WANDB_API_KEY"):
        return "online", "WANDB_API_KEY is set"
    if _has_stored_key(environ):
        return "online", "a key from wandb login"
    return "offline", "no API key (WANDB_API_KEY, wandb login); upload later with wandb sync"


def wandb_dir(save_dir: Optional[str], checkpoint_save: Optional[str]) -> str:
    """The folder whose ``wandb/`` holds the run folder: ``--wandb-save-dir``, else ``<--save>/wandb``
    (Megatron-LM's default), else the working directory (wandb's own default, ``./wandb/``)."""
    if save_dir:
        return save_dir
    return os.path.join(checkpoint_save, "wandb") if checkpoint_save else "."


class WandbSink:
    """One W&B run in ``save_dir`` (its ``wandb/`` subfolder holds the run folder). Create it on the logging rank
    only: a second process would make a second run."""

    def __init__(self, project: str, name: Optional[str], save_dir: str, print_fn=None):
        import wandb

        from hybrid.config.errors import ConfigError

        mode, why = wandb_mode()
        os.makedirs(save_dir, exist_ok=True)
        try:
            self._run = wandb.init(project=project, name=name or None, dir=save_dir, mode=mode)
        except wandb.errors.Error as e:  # a key refused, no network: the user's to fix, in one line
            cause = " ".join(str(e).split())[:300]
            raise ConfigError(f"--wandb-project {project}: W&B could not start the run in {mode} mode ({why}): "
                              f"{cause}; WANDB_MODE=offline logs locally, to upload later with wandb sync",
                              keys=("logging.wandb_project",)) from e
        self._run.define_metric(STEP_KEY)
        self._run.define_metric("*", step_metric=STEP_KEY)
        self.mode, self.run_dir = mode, self._run.dir and os.path.dirname(self._run.dir)
        if print_fn is not None:
            print_fn(f"W&B: {mode} ({why}), project {project}, run {self._run.name or self._run.id}, in "
                     f"{self.run_dir}")

    def add_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log({STEP_KEY: step, **scalars})

    def add_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._run.config.update(dict(hparams), allow_val_change=True)

    def flush(self) -> None:
        """Nothing to do: wandb's service writes the run file as it goes."""

    def close(self) -> None:
        self._run.finish()
