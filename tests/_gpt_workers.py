"""The parity workers' model size and their one Trainer builder (tests/_layouts.py runs the layouts through it)."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L

import lightning_npu
from examples.gpt.data import TextDataModule
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
    """The one Trainer (and data) of the multi-process workers: the same global batch whatever the layout (per-rank
    batch = global // dp, unshuffled), fp32 unless told, checkpoints every 3 steps into `ckpt_dir` when given."""
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
