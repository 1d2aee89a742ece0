"""The fp16 loss scale: the loss is multiplied by it before backward so small fp16 gradients do
not flush to zero, and the optimizer divides it out again (with the clipping factor, in one
``grad_scale``). A step whose gradients are not finite (inf or NaN anywhere: the scale was too
large, or the model diverged) is skipped -- no unit is stepped, the gradients are dropped -- and
the dynamic scale comes down; after ``loss_scale_window`` steps without one it goes up again.

DeepSpeed's rules, so a ds_config behaves the same: ``loss_scale`` 0 means dynamic, starting at
2**``initial_scale_power``; an overflow halves the scale only once ``hysteresis`` overflows have
come since it last changed (with ``consecutive_hysteresis``, since the last step without one);
it never goes under ``min_loss_scale``. A static scale (``loss_scale``
> 0) never changes, but overflowing steps are still skipped. With fp32 compute (the CPU) the
scale changes no result -- multiplying by a power of two and dividing it out is exact -- but the
skipping of non-finite steps is what the config asked for.
"""
from __future__ import annotations

from infinity.config import Fp16Config
from infinity.base.log import get_logger

log = get_logger("optim")


class LossScaler:
    """The current loss scale and its updates after each optimizer step."""

    def __init__(self, config: Fp16Config) -> None:
        self.dynamic = config.loss_scale == 0
        self.scale = 2.0 ** config.initial_scale_power if self.dynamic else config.loss_scale
        self.window = config.loss_scale_window
        self.min_scale = config.min_loss_scale
        self.hysteresis = config.hysteresis
        self.consecutive_hysteresis = config.consecutive_hysteresis
        self._hysteresis_left = config.hysteresis
        self._steps = 0
        self._last_overflow = -1

    def update(self, overflow: bool) -> bool:
        """Called once per optimizer step, with whether its gradients overflowed. True when a
        dynamic scale overflowed at its minimum with no hysteresis left: it cannot come down,
        so every later step would be skipped too (the engine stops the run, as DeepSpeed's)."""
        stuck = False
        if overflow:
            stuck = self.dynamic and self._hysteresis_left <= 1 and self.scale <= self.min_scale
            attempted = self.scale
            if self.dynamic and self._hysteresis_left <= 1:
                self.scale = max(self.scale / 2, self.min_scale)
            elif self.dynamic:
                self._hysteresis_left -= 1
            self._last_overflow = self._steps
            log.warning("gradients overflowed at loss scale %g: step skipped, scale now %g",
                        attempted, self.scale)
        elif self.dynamic:
            if self.consecutive_hysteresis:
                self._hysteresis_left = self.hysteresis
            stable = self._steps - self._last_overflow - 1
            if stable > 0 and stable % self.window == 0:
                self.scale *= 2
                self._hysteresis_left = self.hysteresis
        self._steps += 1
        return stuck

    def state_dict(self) -> dict[str, float | int]:
        """What a checkpoint keeps: the scale and where its growth and hysteresis stand."""
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left,
                "steps": self._steps, "last_overflow": self._last_overflow}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """A checkpoint's scaler state; a static ``fp16.loss_scale`` stays the config's (it
        took the checkpoint's dynamic scale and held it fixed: neither what the config said nor
        what the checkpoint held)."""
        try:
            scale = float(state["scale"])
            if self.dynamic:
                self.scale = scale
            elif scale != self.scale:
                log.info("fp16.loss_scale %g (static, the config's) is kept; the checkpoint's "
                         "scale %g is not used", self.scale, scale)
            self._hysteresis_left = int(state["hysteresis_left"])
            self._steps = int(state["steps"])
            self._last_overflow = int(state["last_overflow"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"loss scaler state {state!r} is incomplete or malformed ({exc})") from None


class ReportsLossScale:
    """DeepSpeed's ``optimizer.loss_scale`` and ``optimizer.cur_scale`` (Megatron-style logging
    reads them): the fp16 loss scale now, 1 without fp16. ``scaler`` is the engine's
    ``LossScaler``, set once the engine has made it."""

    scaler: LossScaler | None = None

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def cur_scale(self) -> float:
        return self.loss_scale
