"""`HybridPrecision`: mixed precision that autocasts on the strategy's real device type.

Lightning's connector builds ``MixedPrecision(device="cuda")`` for any non-CPU accelerator,
which would autocast the wrong device on Ascend NPUs; the strategy swaps in this plugin.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from lightning.pytorch.plugins.precision import MixedPrecision

_SUPPORTED = ("bf16-mixed", "16-mixed")


class HybridPrecision(MixedPrecision):
    def __init__(
        self,
        precision: Literal["bf16-mixed", "16-mixed"] = "bf16-mixed",
        device: str = "cpu",
        scaler: Optional[torch.amp.GradScaler] = None,
    ) -> None:
        if precision not in _SUPPORTED:
            raise ValueError(f"HybridPrecision(precision={precision!r}) is not supported; use one of {_SUPPORTED}.")
        super().__init__(precision, device=device, scaler=scaler)
