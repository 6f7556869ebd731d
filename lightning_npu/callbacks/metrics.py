"""`PrometheusMetrics`: expose training health to a Prometheus scraper.

Off unless added to the callbacks, and `prometheus_client` is imported only then, so it stays an
optional dependency. Each exporting rank serves its own registry on ``port + local_rank`` (rank 0
only by default): a scrape never waits on training, it reads the last values set at a step end.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback

from lightning_npu import device as dev

_HINT = "PrometheusMetrics needs `prometheus_client`: `pip install prometheus_client` (or lightning-npu[metrics])."


class PrometheusMetrics(Callback):
    """Loss, gradient norm, loss scale, tokens/s, RSS and device memory as Prometheus gauges.

    Args:
        port: TCP port of the HTTP endpoint (rank r serves ``port + local_rank`` when ``all_ranks``).
        addr: address to bind.
        all_ranks: export from every rank instead of global rank 0 only.
        loss_key / grad_norm_key / tokens_per_s_key: names in ``trainer.callback_metrics`` to read;
            the loss falls back to the training step's output, tokens/s to batch size x step rate.
    """

    def __init__(
        self,
        port: int,
        addr: str = "0.0.0.0",
        all_ranks: bool = False,
        loss_key: str = "train_loss",
        grad_norm_key: str = "health/grad_norm",
        tokens_per_s_key: str = "tokens_per_s",
    ) -> None:
        if not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"PrometheusMetrics(port={port!r}): give a TCP port in 1..65535, e.g. 9400.")
        self.port, self.addr, self.all_ranks = port, addr, all_ranks
        self.loss_key, self.grad_norm_key, self.tokens_per_s_key = loss_key, grad_norm_key, tokens_per_s_key
        self.bound_port: Optional[int] = None
        self._server: Any = None
        self._gauges: dict[str, Any] = {}
        self._last_time: Optional[float] = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._server is not None or not (self.all_ranks or trainer.is_global_zero):
            return
        try:
            import prometheus_client as prom
        except ImportError as err:
            raise ImportError(_HINT) from err
        registry = prom.CollectorRegistry()
        names = {
            "loss": "training loss",
            "grad_norm": "global gradient L2 norm",
            "loss_scale": "mixed-precision loss scale",
            "tokens_per_second": "training throughput",
            "rss_bytes": "host resident memory of this process",
            "global_step": "optimizer steps done",
        }
        labels = ["rank"]
        self._gauges = {k: prom.Gauge(f"lightning_npu_{k}", doc, labels, registry=registry) for k, doc in names.items()}
        self._gauges["device_memory_bytes"] = prom.Gauge(
            "lightning_npu_device_memory_bytes", "device allocator numbers", ["rank", "kind"], registry=registry
        )
        self.bound_port = self.port + (trainer.local_rank if self.all_ranks else 0)
        self._server, _ = prom.start_http_server(self.bound_port, addr=self.addr, registry=registry)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        elapsed = None if self._last_time is None else now - self._last_time
        self._last_time = now
        if not self._gauges:
            return
        rank = str(trainer.global_rank)
        metrics = trainer.callback_metrics
        loss = metrics.get(self.loss_key)
        if loss is None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self._set("loss", rank, loss)
        self._set("grad_norm", rank, metrics.get(self.grad_norm_key))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and hasattr(scaler, "get_scale"):
            self._set("loss_scale", rank, scaler.get_scale())
        tps = metrics.get(self.tokens_per_s_key)
        if tps is None and elapsed:
            first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
            if isinstance(first, torch.Tensor):
                tps = first.numel() * trainer.world_size / elapsed
        self._set("tokens_per_second", rank, tps)
        self._set("global_step", rank, trainer.global_step)
        self._set("rss_bytes", rank, dev.current_rss_bytes())
        for kind, value in dev.memory_stats(trainer.strategy.root_device).items():
            self._gauges["device_memory_bytes"].labels(rank=rank, kind=kind).set(value)

    def _set(self, name: str, rank: str, value: Any) -> None:
        if value is None:
            return
        if isinstance(value, torch.Tensor):
            value = value.detach().float().item()
        self._gauges[name].labels(rank=rank).set(float(value))

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
            self._gauges = {}
