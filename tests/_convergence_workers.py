"""Workers for the gradient-compression convergence test: every arm trains a GPT at dp=2 in the same processes (one
launch), same seed and data, through the real gradient path (`reduce_bucket`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import yaml

from examples.gpt.data import TextDataModule
from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from tests._compression_workers import Losses, Wire
from tests._gpt_workers import SMALL_GPT

_CONFIG = Path(__file__).resolve().parents[1] / "examples/gpt/config.yaml"


def example_gpt() -> tuple[dict, dict]:
    """The example GPT's model and data arguments, as `examples/gpt/config.yaml` ships them."""
    config = yaml.safe_load(_CONFIG.read_text())
    return config["model"]["init_args"], config["data"]["init_args"]


def small_gpt() -> tuple[dict, dict]:
    """`SMALL_GPT` (2 layers, 32 wide), about 10x cheaper per step than the example."""
    return {**SMALL_GPT, "warmup_steps": 10}, {"block_size": SMALL_GPT["block_size"], "batch_size": 4}


def train(compression: Any, steps: int, model: dict, data: dict, zero_stage: int = 0) -> dict[str, Any]:
    """`model` (GPTModule's arguments, AdamW) for `steps` optimizer steps on 2 ranks, in fp32 at zero 0, on `data`
    (TextDataModule's, unshuffled): the logged losses and the gradient bytes."""
    L.seed_everything(0, verbose=False)
    losses, wire = Losses(), Wire()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=NPUHybridStrategy(
        zero_stage=zero_stage, gradient_compression=compression), precision="32-true", max_steps=steps,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, deterministic=True, callbacks=[losses])
    with wire.counting():
        trainer.fit(GPTModule(**model), datamodule=TextDataModule(**{**data, "shuffle": False}))
    return {"losses": losses.losses, "bytes": wire.bytes}


def train_arms(arms: list[dict]) -> list[dict]:
    out = []
    for arm in arms:
        os.environ["WORLD_SIZE"] = "2"
        out.append(train(**arm))
    return out
