"""PrometheusMetrics (optional dependency) and configuring the callbacks from a LightningCLI config."""

from __future__ import annotations

import urllib.request

import lightning as L
import pytest

from lightning_npu.callbacks import GradientHealthGuard, PrometheusMetrics
from lightning_npu.launch import free_port
from tests._callbacks_helpers import StepSeeded, trainer_kwargs


def test_prometheus_exports_training_metrics(tmp_path):
    pytest.importorskip("prometheus_client")
    port = free_port()
    seen = {}

    class Scrape(L.Callback):
        def on_train_end(self, trainer, pl_module):
            seen["text"] = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()

    model = StepSeeded()
    trainer = L.Trainer(callbacks=[GradientHealthGuard(), PrometheusMetrics(port=port, addr="127.0.0.1"), Scrape()],
                        **trainer_kwargs(tmp_path, 4))
    trainer.fit(model)
    text = seen["text"]
    loss = float(next(l for l in text.splitlines() if l.startswith("lightning_npu_loss{")).split()[-1])
    assert loss == pytest.approx(model.losses[3], rel=1e-6)
    assert 'lightning_npu_global_step{rank="0"} 4.0' in text
    for name in ("lightning_npu_grad_norm{", "lightning_npu_rss_bytes{", "lightning_npu_tokens_per_second{",
                 'lightning_npu_device_memory_bytes{kind="rss_bytes"'):
        assert name in text, name


def test_prometheus_bad_port():
    with pytest.raises(ValueError, match="port=0"):
        PrometheusMetrics(port=0)


def test_callbacks_from_lightning_cli_config(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    from lightning_npu.callbacks import DynamicCheckpoint, PreemptionCheckpoint, TrainingGuard

    config = tmp_path / "config.yaml"
    config.write_text(
        """
trainer:
  accelerator: cpu
  max_steps: 2
  logger: false
  callbacks:
    - class_path: lightning_npu.callbacks.DynamicCheckpoint
      init_args: {phase_fractions: [0.5], intervals: [1, 2], keep_last_k: 1}
    - class_path: lightning_npu.callbacks.GradientHealthGuard
      init_args: {grad_norm_range: [0.0001, 100.0], nonfinite_action: rollback}
    - class_path: lightning_npu.callbacks.TrainingGuard
      init_args: {max_restarts: 5}
    - class_path: lightning_npu.callbacks.PreemptionCheckpoint
      init_args: {signals: [SIGUSR1]}
"""
    )
    cli = LightningCLI(StepSeeded, args=["--config", str(config)], run=False)
    dyn, health, guard, pre = [
        next(c for c in cli.trainer.callbacks if isinstance(c, t))
        for t in (DynamicCheckpoint, GradientHealthGuard, TrainingGuard, PreemptionCheckpoint)
    ]
    assert dyn.intervals == (1, 2) and dyn.keep_last_k == 1
    assert health.grad_norm_range == (0.0001, 100.0) and health.severity["nonfinite"] == 3
    assert guard.max_restarts == 5
    assert [s.name for s in pre.signals] == ["SIGUSR1"]


def test_prometheus_binds_loopback_and_reports_hybrid_precision_loss_scale(tmp_path):
    """Default host is 127.0.0.1 (the endpoint is unauthenticated); the loss_scale gauge reads HybridPrecision's
    scaler, which has no `get_scale()` (the gauge stayed empty before)."""
    pytest.importorskip("prometheus_client")
    import lightning_npu  # noqa: F401  (registers npu_hybrid)
    from lightning_npu import HybridPrecision

    port = free_port()
    seen = {}

    class Scrape(L.Callback):
        def on_train_end(self, trainer, pl_module):
            seen["text"] = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            seen["bound"] = metrics._server.server_address[0]

    metrics = PrometheusMetrics(port=port)
    assert metrics.host == "127.0.0.1"
    assert PrometheusMetrics(port=port, addr="0.0.0.0").host == "0.0.0.0"  # the former name still works
    trainer = L.Trainer(callbacks=[metrics, Scrape()], strategy="npu_hybrid",
                        plugins=[HybridPrecision("bf16-mixed", loss_scale=512.0)], **trainer_kwargs(tmp_path, 2))
    trainer.fit(StepSeeded())
    assert seen["bound"] == "127.0.0.1"
    assert 'lightning_npu_loss_scale{rank="0"} 512.0' in seen["text"], seen["text"]
