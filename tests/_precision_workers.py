"""Module-level workers for the precision tests (run in real processes by `lightning_npu.launch.spawn`)."""

from __future__ import annotations

import os
from typing import Any, Optional

import lightning as L
import torch

import lightning_npu
from examples.gpt.model import GPTModule
from lightning_npu import HybridPrecision, NPUHybridStrategy
from lightning_npu.parallel.optim.mixed_precision import stepped_params
from tests._gpt_workers import SMALL_GPT, parity_trainer


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """fp32 copies of the full tensors (DTensor and tensor-parallel shards gathered: a collective, call on every
    rank)."""
    return {k: v.float() for k, v in lightning_npu.full_state_dict(module).items()}


def master_weights(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """The optimizer wrappers' fp32 master copies (*-true), keyed by their parameter's name (this rank's tensors)."""
    names = {id(p): n for n, p in trainer.lightning_module.named_parameters()}
    zero1 = trainer.strategy._distributed_optimizers()
    if zero1:  # ZeRO-1 keeps them itself: this rank's fp32 slices
        return {n: m.to_local().detach().clone() for opt in zero1 for n, m in opt.master_state_dict().items()}
    local = {names[id(p)]: m for opt in trainer.strategy.optimizers for p, m in opt.master_pairs}
    return {n: (m.to_local() if hasattr(m, "to_local") else m).detach().clone() for n, m in local.items()}


class Recorder(L.Callback):
    """Per optimizer step: logged metrics, LR, scheduler counter, and (optionally) a parameter snapshot."""

    def __init__(self, snapshot_params: bool = False, inject_inf_at: tuple[int, ...] = (), inject_rank: int = 1,
                 snapshot_masters: bool = False) -> None:
        self.snapshot_params = snapshot_params
        self.snapshot_masters = snapshot_masters
        self.start_masters: Optional[dict[str, torch.Tensor]] = None
        self.inject_inf_at = set(inject_inf_at)
        self.inject_rank = inject_rank
        self.rows: list[dict[str, Any]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        if self.snapshot_masters:  # after a resume: what the checkpoint restored
            self.start_masters = master_weights(trainer)

    def on_after_backward(self, trainer, pl_module) -> None:
        # after the gradient reduction (DDP's all-reduce, ZeRO-1's reduce-scatter): only this rank's gradient holds
        # the inf; ZeRO-1 steps its reduced slices (the optimizer's parameters), DDP the model's gradients
        if trainer.global_step in self.inject_inf_at and trainer.global_rank == self.inject_rank:
            stepped = stepped_params(trainer.optimizers[0])
            grads = [p.grad for p in stepped + list(pl_module.parameters()) if p.grad is not None]
            grad = next(g.to_local() if hasattr(g, "to_local") else g for g in grads if g.numel() > 0)
            grad.view(-1)[0] = float("inf")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = trainer.callback_metrics
        row: dict[str, Any] = {
            "loss": float(outputs["loss"].detach()),
            "train_loss": float(m["train_loss"]) if "train_loss" in m else None,
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
        }
        for key in ("loss_scale", "skipped_steps", "grad_norm"):
            row[key] = float(m[f"npu/{key}"]) if f"npu/{key}" in m else None
        if trainer.lr_scheduler_configs:
            row["sched_last_epoch"] = trainer.lr_scheduler_configs[0].scheduler.last_epoch
        if self.snapshot_params:
            row["params"] = full_state(pl_module)
        if self.snapshot_masters:
            row["masters"] = master_weights(trainer)
        self.rows.append(row)


def train(
    devices: int,
    steps: int,
    precision: Any = "32-true",
    global_batch: int = 8,
    strategy_kwargs: Optional[dict[str, Any]] = None,
    model_kwargs: Optional[dict[str, Any]] = None,
    plugin_kwargs: Optional[dict[str, Any]] = None,
    gradient_clip_val: Optional[float] = None,
    recorder_kwargs: Optional[dict[str, Any]] = None,
    ckpt_dir: Optional[str] = None,
    ckpt_in: Optional[str] = None,
    seed: int = 0,
    limit_train_batches: Optional[int] = None,
) -> dict[str, Any]:
    """Train the small GPT (`plugin_kwargs`: through an explicit HybridPrecision plugin); checkpoints every 3 steps.
    Resume at an epoch boundary (`limit_train_batches`): Lightning restarts a mid-epoch dataloader from the epoch's
    start."""
    L.seed_everything(seed, verbose=False)
    model = GPTModule(**{**SMALL_GPT, **(model_kwargs or {})})
    recorder = Recorder(**(recorder_kwargs or {}))
    if plugin_kwargs is not None:
        precision_kwargs = {"plugins": [HybridPrecision(precision, **plugin_kwargs)], "precision": None}
    else:
        precision_kwargs = {"precision": precision}
    trainer, data = parity_trainer(
        NPUHybridStrategy(**(strategy_kwargs or {})), model, devices, global_batch, steps, [recorder], ckpt_dir,
        limit_train_batches, gradient_clip_val=gradient_clip_val, num_sanity_val_steps=0, **precision_kwargs,
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_in)
    plugin = trainer.precision_plugin
    return {
        "rows": recorder.rows,
        "start_masters": recorder.start_masters,
        "state": full_state(model),
        "plugin": type(plugin).__name__,
        "scaler": plugin.scaler.state_dict() if getattr(plugin, "scaler", None) is not None else None,
        "global_step": trainer.global_step,
        "rank": trainer.global_rank,
        "pid": os.getpid(),
    }


def loss_curves(precisions: list[str], steps: int) -> dict[str, list[float]]:
    """Train the same small GPT from the same seed under each precision in turn (one process, dp=1)."""
    out = {}
    for precision in precisions:
        result = train(1, steps, precision, global_batch=8, model_kwargs={"n_embd": 64, "block_size": 64})
        out[precision] = [row["loss"] for row in result["rows"]]
    return out


def train_many(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several `train` runs in sequence in one process group (start-up and imports paid once)."""
    out = []
    for config in configs:
        # Lightning's environment deletes WORLD_SIZE at teardown; the next Trainer of this process needs it
        os.environ["WORLD_SIZE"] = str(config["devices"])
        out.append(train(**config))
    return out
