"""Bad arguments fail at construction with an error that names the argument and the value (no process group,
no Trainer): each of these was accepted silently before, or failed later with a bare TypeError."""

from __future__ import annotations

import re
import signal

import pytest

from lightning_npu import NPUHybridStrategy
from lightning_npu.callbacks import (
    DynamicCheckpoint,
    GradientHealthGuard,
    PreemptionCheckpoint,
    PrometheusMetrics,
    TrainingGuard,
)

NAN, INF = float("nan"), float("inf")

CASES = [
    # strategy
    (NPUHybridStrategy, {"zero_stage": 1.0}, "zero_stage"),
    (NPUHybridStrategy, {"zero_stage": True}, "zero_stage"),
    (NPUHybridStrategy, {"bucket_size_mb": NAN}, "bucket_size_mb"),
    (NPUHybridStrategy, {"bucket_size_mb": INF}, "bucket_size_mb"),
    (NPUHybridStrategy, {"process_group_backend": "bogus"}, "process_group_backend"),
    (NPUHybridStrategy, {"start_method": "thread"}, "start_method"),
    (NPUHybridStrategy, {"async_save": "yes"}, "async_save"),
    (NPUHybridStrategy, {"fuse_ops": 1}, "fuse_ops"),
    (NPUHybridStrategy, {"find_unused_parameters": "false"}, "find_unused_parameters"),
    (NPUHybridStrategy, {"static_graph": None}, "static_graph"),
    # callbacks: True is an int to Python, never a count here
    (DynamicCheckpoint, {"keep_last_k": True}, "keep_last_k"),
    (TrainingGuard, {"max_restarts": True}, "max_restarts"),
    (TrainingGuard, {"nonfinite_patience": True}, "nonfinite_patience"),
    (GradientHealthGuard, {"escalate_after": True}, "escalate_after"),
    (PrometheusMetrics, {"port": True}, "port"),
    (GradientHealthGuard, {"max_warnings": -1}, "max_warnings"),
    (GradientHealthGuard, {"max_warnings": "20"}, "max_warnings"),
    (PreemptionCheckpoint, {"signals": ("SIGKILL",)}, "SIGKILL"),
    (PreemptionCheckpoint, {"signals": (9,)}, "9"),
    (PreemptionCheckpoint, {"signals": [signal.SIGSEGV]}, "SIGSEGV"),
    (PreemptionCheckpoint, {"signals": "SIGTERMX"}, "SIGTERMX"),  # one (misspelt) name, not 8 letters
    (DynamicCheckpoint, {"phase_fractions": "ab"}, "phase_fractions"),
    (DynamicCheckpoint, {"intervals": 5}, "intervals"),
    (TrainingGuard, {"memory_warn_fraction": "0.5"}, "memory_warn_fraction"),
    (DynamicCheckpoint, {"dirpath": 123}, "dirpath"),
    (PreemptionCheckpoint, {"dirpath": 123}, "dirpath"),
    (TrainingGuard, {"checkpoint_dir": 123}, "checkpoint_dir"),
    (TrainingGuard, {"allow_fresh_start": "no"}, "allow_fresh_start"),
    (TrainingGuard, {"restart_backoff": NAN}, "restart_backoff"),
]


def _id(case) -> str:
    cls, kwargs, _ = case
    return f"{cls.__name__}-" + "-".join(f"{k}={v!r}" for k, v in kwargs.items())


@pytest.mark.parametrize("cls, kwargs, names", CASES, ids=[_id(c) for c in CASES])
def test_bad_argument_is_refused_at_construction(cls, kwargs, names):
    if cls is PrometheusMetrics:
        kwargs = {"port": 9400, **kwargs}
    with pytest.raises((ValueError, TypeError)) as info:
        cls(**kwargs)
    message = str(info.value)
    assert names in message, message
    value = next(iter(kwargs.values())) if cls is not PrometheusMetrics else kwargs["port"]
    if not isinstance(value, (tuple, list)):
        assert repr(value) in message or str(value) in message, message
    assert re.search(r"must|use|give|choose|pass|refused|not a|cannot|e\.g\.", message), message


def test_one_signal_as_a_string_is_one_signal():
    assert PreemptionCheckpoint(signals="SIGTERM").signals == [signal.SIGTERM]
    assert PreemptionCheckpoint(signals=signal.SIGUSR1).signals == [signal.SIGUSR1]
    assert PreemptionCheckpoint(signals=("SIGTERM", 10)).signals == [signal.SIGTERM, signal.SIGUSR1]
