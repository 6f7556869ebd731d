"""What a user sees in the first runs, on 2 processes: the model summary's counts at tp=2, pp=2 and ZeRO-3, and a
resumed run's progress bar (tests/test_first_hour.py)."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelSummary

from examples.gpt.data import TextDataModule
from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from tests._gpt_workers import SMALL_GPT

LAYOUTS = {"tp2": dict(tensor_parallel_size=2), "pp2": dict(pipeline_parallel_size=2, micro_batches=2),
           "zero3": dict(zero_stage=3)}


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.extend(record.getMessage().splitlines())


def summaries(root: str) -> dict[str, Any]:
    """Each layout's summary lines (rank 0), after one step."""
    out: dict[str, Any] = {}
    for name, layout in LAYOUTS.items():
        capture = _Capture()
        loggers = [logging.getLogger(n) for n in ("lightning.pytorch.callbacks.model_summary", "lightning.pytorch")]
        for lg in loggers:
            lg.addHandler(capture)
        try:
            trainer = L.Trainer(accelerator="cpu", devices=2, strategy=NPUHybridStrategy(**layout), max_steps=1,
                                limit_val_batches=0, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, default_root_dir=f"{root}/{name}",
                                callbacks=[ModelSummary(max_depth=2)])  # a user's own (the default may be rich)
            trainer.fit(GPTModule(**SMALL_GPT), datamodule=TextDataModule(block_size=32, batch_size=4))
        finally:
            for lg in loggers:
                lg.removeHandler(capture)
        out[name] = capture.lines
        out[f"{name}-callbacks"] = [type(c).__name__ for c in trainer.callbacks]
    return out
