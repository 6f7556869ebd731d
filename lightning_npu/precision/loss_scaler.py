"""Dynamic loss scaling for fp16: the scale grows while steps are finite and halves on an overflow, which
every rank decides together."""

from __future__ import annotations

import math
from typing import Any


# ---------------------------------------------------------------------------------------------
# loss scaler
# ---------------------------------------------------------------------------------------------
class DynamicLossScaler:
    """Megatron/DeepSpeed-style dynamic loss scale.

    * after ``growth_interval`` consecutive overflow-free steps: ``scale *= growth_factor`` and the
      hysteresis budget is refilled;
    * on an overflow: the step is skipped, the growth counter restarts and the hysteresis budget
      drops by one; once it is exhausted (the ``hysteresis``-th overflow since the last growth, and
      every overflow after it) ``scale = max(scale * backoff_factor, min_scale)``.

    ``dynamic=False`` keeps the scale constant (overflowing steps are still skipped).
    """

    def __init__(
        self,
        init_scale: float = 2.0**10,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        dynamic: bool = True,
    ) -> None:
        checks = [
            ("init_scale", init_scale, init_scale > 0 and math.isfinite(init_scale), "a finite number > 0"),
            ("growth_factor", growth_factor, growth_factor >= 1, "a number >= 1, e.g. 2.0"),
            ("backoff_factor", backoff_factor, 0 < backoff_factor <= 1, "a number in (0, 1], e.g. 0.5"),
            ("growth_interval", growth_interval, isinstance(growth_interval, int) and growth_interval >= 1,
             "an int >= 1, e.g. 1000"),
            ("hysteresis", hysteresis, isinstance(hysteresis, int) and hysteresis >= 1, "an int >= 1, e.g. 2"),
            ("min_scale", min_scale, 0 < min_scale <= init_scale, f"a number in (0, init_scale={init_scale}]"),
        ]
        for name, value, ok, fix in checks:
            if not ok:
                raise ValueError(f"HybridPrecision/DynamicLossScaler: `{name}={value!r}` is invalid; pass {fix}.")
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.dynamic = dynamic
        self.scale = float(init_scale)
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])
