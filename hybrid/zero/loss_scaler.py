"""Loss scaling for fp16 training.

fp16 has a narrow exponent range: small gradients underflow to zero. The loss
is multiplied by ``scale`` before backward and the gradients are divided by it
before the update. :class:`LossScaler` keeps that scale:

* **dynamic** (``dynamic=True``): start at ``2**initial_scale_power``. An
  overflow (non-finite gradients anywhere in the world) makes the optimizer
  skip the step; the scale is halved (never below ``min_scale``) once
  ``hysteresis`` overflows have been seen since the scale last grew (the first
  ``hysteresis - 1`` overflows only skip). After ``window`` consecutive finite
  steps the scale doubles and the hysteresis allowance is restored.
* **static** (``dynamic=False``): the scale stays at ``static_scale`` forever.
  With ``static_scale=1`` this is the "disabled" scaler used for bf16 and
  fp32; the optimizer still detects non-finite gradients and skips those steps.

The scaler only holds state; the optimizer decides overflow (reduced over the
whole world) and calls :meth:`update` once per global step.
"""

from __future__ import annotations


class LossScaler:
    def __init__(self, *, dynamic: bool, initial_scale_power: int = 16, static_scale: float = 1.0,
                 window: int = 1000, hysteresis: int = 2, min_scale: float = 1.0):
        if window < 1:
            raise ValueError(f"loss scale window must be >= 1 step, got {window} "
                             f"(config key fp16.loss_scale_window)")
        if hysteresis < 1:
            raise ValueError(f"loss scale hysteresis must be >= 1, got {hysteresis} "
                             f"(config key fp16.hysteresis)")
        if min_scale <= 0:
            raise ValueError(f"minimum loss scale must be > 0, got {min_scale} (config key fp16.min_loss_scale)")
        if not dynamic and static_scale <= 0:
            raise ValueError(f"a static loss scale must be > 0, got {static_scale} (config key fp16.loss_scale)")
        self.dynamic = dynamic
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.scale = float(2 ** initial_scale_power) if dynamic else float(static_scale)
        if dynamic and self.scale < self.min_scale:
            raise ValueError(f"initial loss scale 2**{initial_scale_power} is below min_scale {min_scale}")
        self._good_steps = 0  # consecutive finite steps since the last overflow or growth
        self._hysteresis_left = hysteresis

    @property
    def enabled(self) -> bool:
        """False for the scale-1 static scaler (bf16/fp32): the loss is not multiplied."""
        return self.dynamic or self.scale != 1.0

    def update(self, overflow: bool) -> None:
        """Advance the state machine by one global step."""
        if not self.dynamic:
            return
        if overflow:
            self._good_steps = 0
            if self._hysteresis_left > 1:
                self._hysteresis_left -= 1
            else:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self._good_steps += 1
        if self._good_steps == self.window:
            self.scale *= 2.0
            self._good_steps = 0
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"dynamic": self.dynamic, "scale": self.scale, "window": self.window,
                "hysteresis": self.hysteresis, "min_scale": self.min_scale,
                "good_steps": self._good_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, sd: dict) -> None:
        if bool(sd["dynamic"]) != self.dynamic:
            kind = "dynamic" if sd["dynamic"] else "static"
            raise ValueError(f"checkpoint holds a {kind} loss scaler but this run's is "
                             f"{'dynamic' if self.dynamic else 'static'}; match fp16.loss_scale to the "
                             f"saved run (0 = dynamic)")
        self.scale = float(sd["scale"])
        self._good_steps = int(sd["good_steps"])
        self._hysteresis_left = int(sd["hysteresis_left"])

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self.scale:g})"
