"""Stability callbacks that work with any strategy and any LightningModule.

``Trainer(callbacks=[DynamicCheckpoint(), GradientHealthGuard(), TrainingGuard(), PreemptionCheckpoint()])``
or the same list under ``trainer.callbacks`` in a LightningCLI config.
"""

from lightning_npu.callbacks._store import CheckpointCorruptedError
from lightning_npu.callbacks.dynamic_checkpoint import DynamicCheckpoint
from lightning_npu.callbacks.health import GradientHealthGuard

__all__ = [
    "CheckpointCorruptedError",
    "DynamicCheckpoint",
    "GradientHealthGuard",
]
