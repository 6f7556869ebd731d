"""Shared pieces of the benchmark scripts: a step timer and the example GPT run under a strategy."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L

import lightning_npu  # noqa: F401  (registers npu_hybrid)
from benchmarks import _env
from benchmarks._env import metadata
from lightning_npu import device as dev

RESULTS = Path(__file__).resolve().parent / "results"


class StepTimer(L.Callback):
    """Wall time of every optimizer step (device-synchronised), skipping `warmup` steps."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        dev.synchronize(pl_module.device)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        dev.synchronize(pl_module.device)
        if trainer.global_step > self.warmup:
            self.times.append(time.perf_counter() - self._t0)


def run_gpt(
    strategy: Any,
    devices: int,
    steps: int,
    warmup: int,
    per_rank_batch: int,
    model_kwargs: dict[str, Any],
    precision: str = "32-true",
    accelerator: str = "cpu",
    callbacks: Optional[list] = None,
    plugins: Optional[list] = None,
) -> dict[str, Any]:
    from examples.gpt.data import TextDataModule
    from examples.gpt.model import GPTModule

    L.seed_everything(0, verbose=False)
    model = GPTModule(**model_kwargs)
    data = TextDataModule(block_size=model.hparams.block_size, batch_size=per_rank_batch, shuffle=True)
    timer = StepTimer(warmup)
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        precision=None if plugins else precision,
        plugins=plugins,
        max_steps=steps + warmup,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer, *(callbacks or [])],
    )
    trainer.fit(model, datamodule=data)
    return {"step_times": timer.times, "peak_rss_bytes": dev.peak_rss_bytes(), "final_loss": float(
        trainer.callback_metrics["train_loss"])}


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def environment() -> dict[str, Any]:
    """`benchmarks._env.metadata`: date, commit, CPU model, threads, load average and versions."""
    return metadata()


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """``benchmarks/results/<name>``, stamped with `environment()` (`benchmarks._env.write_json`)."""
    return _env.write_json(RESULTS / name, payload)
