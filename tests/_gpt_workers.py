"""Module-level training functions that `lightning_npu.launch.spawn` runs in real processes."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch

import lightning_npu
from examples.gpt.data import TextDataModule
from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy

# Adam divides by |g| + eps: on near-zero gradients (the key bias's is exactly zero, since softmax is
# shift-invariant) it turns 1e-7 rounding differences between layouts into lr-sized updates. bias=False
# and eps=1e-5 keep Adam but remove that amplifier, so parity can be asserted at fp32 tolerances.
SMALL_GPT = dict(
    n_layer=2, n_head=4, n_embd=32, block_size=32, learning_rate=3e-3, weight_decay=0.1, bias=False, eps=1e-5
)


class LossRecorder(L.Callback):
    """Records the logged (dp-synced) train loss and each rank's local loss every step."""

    def __init__(self) -> None:
        self.logged: list[float] = []
        self.local: list[float] = []
        self.lr: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.logged.append(float(trainer.callback_metrics["train_loss"]))
        self.local.append(float(outputs["loss"].detach()))
        self.lr.append(float(trainer.optimizers[0].param_groups[0]["lr"]))


full_state = lightning_npu.full_state_dict  # full, original-layout tensors in any layout (a collective)


def parity_trainer(
    strategy: NPUHybridStrategy,
    model: L.LightningModule,
    devices: int,
    global_batch: int,
    steps: int,
    callbacks: list[L.Callback],
    ckpt_dir: Optional[str] = None,
    limit_train_batches: Optional[int] = None,
    **trainer_kwargs: Any,
) -> tuple[L.Trainer, TextDataModule]:
    """The Trainer and data of every parity worker: the same global batch whatever the layout (per-rank batch =
    global // dp, unshuffled), fp32, checkpoints every 3 steps into `ckpt_dir` when given."""
    if ckpt_dir is not None:
        callbacks = [*callbacks, L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3,
                                                                     save_top_k=-1)]
    cfg = strategy.parallel_config
    per_rank_batch = global_batch // (devices // cfg.tensor_parallel_size // cfg.pipeline_parallel_size)
    data = TextDataModule(block_size=model.hparams.block_size, batch_size=per_rank_batch, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        limit_train_batches=limit_train_batches,
        limit_val_batches=2,
        val_check_interval=None,
        check_val_every_n_epoch=None if limit_train_batches is None else 1000,
        logger=False,
        enable_checkpointing=ckpt_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        deterministic=True,
        **{"precision": "32-true", **trainer_kwargs},
    )
    return trainer, data


def train_gpt(
    devices: int,
    global_batch: int,
    steps: int,
    strategy_kwargs: Optional[dict[str, Any]] = None,
    ckpt_dir: Optional[str] = None,
    ckpt_in: Optional[str] = None,
    precision: str = "32-true",
    model_kwargs: Optional[dict[str, Any]] = None,
    limit_train_batches: Optional[int] = None,
    seed: int = 0,
    accumulate_grad_batches: int = 1,
) -> dict[str, Any]:
    L.seed_everything(seed, verbose=False)
    strategy = NPUHybridStrategy(**(strategy_kwargs or {}))
    model = GPTModule(**{**SMALL_GPT, **(model_kwargs or {})})
    recorder = LossRecorder()
    trainer, data = parity_trainer(
        strategy, model, devices, global_batch, steps, [recorder], ckpt_dir, limit_train_batches,
        precision=precision, accumulate_grad_batches=accumulate_grad_batches,
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_in)
    val = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    return {
        "logged": recorder.logged,
        "local": recorder.local,
        "lr": recorder.lr,
        "state": full_state(model),
        "val_loss": float(val),
        "global_step": trainer.global_step,
        "optimizer": type(trainer.strategy.optimizers[0]).__name__,
        "mesh": tuple(trainer.strategy.device_mesh.mesh.shape) if trainer.strategy._device_mesh is not None else None,
    }
