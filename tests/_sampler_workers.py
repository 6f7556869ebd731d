"""Mid-epoch resume workers: `lightning_npu.launch.spawn` runs `run_many` in fresh processes, a Trainer per config."""

from __future__ import annotations

import os
from typing import Any, Optional

import lightning as L
import torch

import lightning_npu  # noqa: F401
from examples.gpt.data import TextDataModule
from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from tests._gpt_workers import SMALL_GPT, full_state

STEP4 = "epoch=0-step=4.ckpt"  # ModelCheckpoint's name for the step-4 save: mid-epoch (the epoch has ~2000 steps)


class Recorder(L.Callback):
    """Per batch: the logged (dp-mean) loss and which samples this rank read (their input tokens)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.samples: list[list[list[int]]] = []  # [batch][sample] -> input token ids

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.samples.append(batch[0].tolist())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def train(
    batch_size: int,
    steps: int,
    strategy_kwargs: Optional[dict[str, Any]] = None,
    accumulate_grad_batches: int = 1,
    ckpt_dir: Optional[str] = None,
    ckpt_in: Optional[str] = None,
    every: int = 4,
    limit_train_batches: Optional[int] = None,
) -> dict[str, Any]:
    """Train the small GPT example, shuffled by Lightning's default (per-rank `batch_size`), fp32; checkpoint every 4
    steps (`every`) into `ckpt_dir`, or resume from `ckpt_in`."""
    L.seed_everything(0, verbose=False)
    model = GPTModule(**SMALL_GPT)
    data = TextDataModule(block_size=SMALL_GPT["block_size"], batch_size=batch_size, shuffle=True)
    recorder = Recorder()
    callbacks: list[L.Callback] = [recorder]
    if ckpt_dir is not None:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=_world(),
        strategy=NPUHybridStrategy(**(strategy_kwargs or {})),
        precision="32-true",
        max_steps=steps,
        limit_train_batches=limit_train_batches,
        accumulate_grad_batches=accumulate_grad_batches,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=ckpt_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        deterministic=True,
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_in)
    loader = trainer.fit_loop._combined_loader.flattened[0]
    return {
        "losses": recorder.losses,
        "samples": recorder.samples,
        "state": full_state(model),
        "global_step": trainer.global_step,
        "loader": type(loader).__name__,
        "loader_state": loader.state_dict() if hasattr(loader, "state_dict") else None,
        "num_training_batches": trainer.num_training_batches,
    }


def _world() -> int:
    # Lightning's environment deletes WORLD_SIZE at teardown; the next Trainer of this process needs it
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else int(os.environ["WORLD_SIZE"])
    os.environ["WORLD_SIZE"] = str(world)
    return world


def run_many(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [train(**config) for config in configs]
