"""Workers for the gradient-compression convergence test: every arm trains the example GPT at dp=2 in the same
processes (one launch), same seed and data, through the real gradient path (`reduce_bucket`)."""

from __future__ import annotations

import os
from typing import Any

import lightning as L

from examples.gpt.data import TextDataModule
from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from tests._compression_workers import Losses, Wire
from tests._gpt_workers import SMALL_GPT


def train(compression: Any, steps: int, zero_stage: int = 0, per_rank_batch: int = 4,
          warmup_steps: int = 10) -> dict[str, Any]:
    """The example GPT (`SMALL_GPT`, AdamW) for `steps` optimizer steps on 2 ranks: logged losses, gradient bytes."""
    L.seed_everything(0, verbose=False)
    model = GPTModule(**{**SMALL_GPT, "warmup_steps": warmup_steps})
    losses, wire = Losses(), Wire()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=NPUHybridStrategy(
        zero_stage=zero_stage, gradient_compression=compression), precision="32-true", max_steps=steps,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True, callbacks=[losses])
    data = TextDataModule(block_size=SMALL_GPT["block_size"], batch_size=per_rank_batch, shuffle=False)
    with wire.counting():
        trainer.fit(model, datamodule=data)
    return {"losses": losses.losses, "bytes": wire.bytes}


def train_arms(arms: list[dict]) -> list[dict]:
    out = []
    for arm in arms:
        os.environ["WORLD_SIZE"] = "2"
        out.append(train(**arm))
    return out
