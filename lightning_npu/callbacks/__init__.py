"""Stability callbacks that work with any strategy and any LightningModule.

``Trainer(callbacks=[DynamicCheckpoint(), GradientHealthGuard(), TrainingGuard(), PreemptionCheckpoint()])``
or the same list under ``trainer.callbacks`` in a LightningCLI config. Recovery restarts need
``TrainingGuard.fit(trainer, model, ...)`` (or torchrun ``--max-restarts``); see `recovery`.
"""

from lightning_npu.callbacks._store import CheckpointCorruptedError
from lightning_npu.callbacks.dynamic_checkpoint import DynamicCheckpoint
from lightning_npu.callbacks.health import GradientHealthGuard
from lightning_npu.callbacks.memory import MemoryMonitor
from lightning_npu.callbacks.metrics import PrometheusMetrics
from lightning_npu.callbacks.preemption import PreemptionCheckpoint
from lightning_npu.callbacks.recovery import TrainingFailure, TrainingGuard
from lightning_npu.parallel.expert_parallel.router_monitor import RouterMonitor

__all__ = [
    "CheckpointCorruptedError",
    "DynamicCheckpoint",
    "GradientHealthGuard",
    "MemoryMonitor",
    "PreemptionCheckpoint",
    "PrometheusMetrics",
    "RouterMonitor",
    "TrainingFailure",
    "TrainingGuard",
]
