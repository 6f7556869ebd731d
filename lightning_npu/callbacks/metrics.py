"""`PrometheusMetrics`: expose training health to a Prometheus scraper.

Off unless added to the callbacks, and `prometheus_client` is imported only then, so it stays an
optional dependency. Each exporting rank serves its own registry on ``port + local_rank`` (rank 0
only by default): a scrape never waits on training, it reads the last values set at a step end.
The endpoint binds the loopback interface unless told otherwise: it is unauthenticated, and on a
shared cluster node anyone who can reach the port could read it.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback

from lightning_npu import device as dev
from lightning_npu.validate import check_bool, check_str, is_int, message

_HINT = "PrometheusMetrics needs `prometheus_client`: `pip install prometheus_client` (or lightning-npu[metrics])."


def _loss_scale(plugin: Any) -> Optional[float]:
    """The current loss scale, or None when the precision plugin does not scale the loss.

    Lightning's 16-mixed plugin holds a `torch.amp.GradScaler` (``get_scale()``); HybridPrecision holds a
    `DynamicLossScaler` whose scale is the plain attribute ``scale`` (also ``plugin.loss_scale``).
    """
    scaler = getattr(plugin, "scaler", None)
    if scaler is None:
        return None
    if callable(getattr(scaler, "get_scale", None)):
        return float(scaler.get_scale())
    for value in (getattr(scaler, "scale", None), getattr(plugin, "loss_scale", None)):
        if isinstance(value, (int, float, torch.Tensor)) and not isinstance(value, bool):
            return float(value)
    return None


class PrometheusMetrics(Callback):
    """Loss, gradient norm, loss scale, tokens/s, RSS and device memory as Prometheus gauges.

    Args:
        port: TCP port of the HTTP endpoint (rank r serves ``port + local_rank`` when ``all_ranks``).
        host: address to bind; ``"127.0.0.1"`` (this machine only) by default. Pass ``"0.0.0.0"`` to let a
            scraper on another machine reach it, on a network you trust (the endpoint has no authentication).
        all_ranks: export from every rank instead of global rank 0 only.
        loss_key / grad_norm_key / tokens_per_s_key: names in ``trainer.callback_metrics`` to read;
            the loss falls back to the training step's output, tokens/s to batch size x step rate.
        addr: former name of ``host``, still accepted.
    """

    def __init__(
        self,
        port: int,
        host: str = "127.0.0.1",
        all_ranks: bool = False,
        loss_key: str = "train_loss",
        grad_norm_key: str = "health/grad_norm",
        tokens_per_s_key: str = "tokens_per_s",
        addr: Optional[str] = None,
    ) -> None:
        o = "PrometheusMetrics"
        if not (is_int(port) and 0 < port < 65536):
            kind = ValueError if is_int(port) else TypeError
            raise kind(message("port", port, "a TCP port in 1..65535", 9400, owner=o))
        check_str("addr", addr, example="'127.0.0.1'", allow_none=True, owner=o)
        if addr is not None:
            host = addr
        check_str("host", host, example="'127.0.0.1'", owner=o)
        check_bool("all_ranks", all_ranks, owner=o)
        check_str("loss_key", loss_key, example="'train_loss'", owner=o)
        check_str("grad_norm_key", grad_norm_key, example="'health/grad_norm'", owner=o)
        check_str("tokens_per_s_key", tokens_per_s_key, example="'tokens_per_s'", owner=o)
        self.port, self.host, self.all_ranks = port, host, all_ranks
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
        self._server, _ = prom.start_http_server(self.bound_port, addr=self.host, registry=registry)

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
        self._set("loss_scale", rank, _loss_scale(trainer.precision_plugin))
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
