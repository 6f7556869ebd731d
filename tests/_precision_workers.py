"""Module-level workers for the precision tests (run in real processes by `lightning_npu.launch.spawn`)."""

from __future__ import annotations

import os
from typing import Any, Optional

import lightning as L
import torch

import lightning_npu
from examples.gpt.data import TextDataModule
from examples.gpt.model import GPTModule
from lightning_npu import HybridPrecision, NPUHybridStrategy

# as in tests/_gpt_workers.py: bias=False and eps=1e-5 keep fp32 parity at rtol 1e-5 (see there)
TINY_GPT = dict(
    n_layer=2, n_head=4, n_embd=32, block_size=32, learning_rate=3e-3, weight_decay=0.1, bias=False, eps=1e-5
)


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
            stepped = [p for g in trainer.optimizers[0].param_groups for p in g["params"]]
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
            row[key] = float(m[key]) if key in m else None
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
    ckpt_every: int = 3,
    ckpt_in: Optional[str] = None,
    reference_strategy: bool = False,
    seed: int = 0,
    limit_train_batches: Optional[int] = None,
) -> dict[str, Any]:
    """Train the tiny GPT. `reference_strategy=True` uses Lightning's own single-device strategy (no lightning-npu)."""
    L.seed_everything(seed, verbose=False)
    model = GPTModule(**{**TINY_GPT, **(model_kwargs or {})})
    recorder = Recorder(**(recorder_kwargs or {}))
    callbacks: list[L.Callback] = [recorder]
    if ckpt_dir is not None:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=ckpt_every,
                                                             save_top_k=-1))
    kwargs: dict[str, Any] = {}
    if reference_strategy:
        kwargs.update(strategy="auto", precision=precision)
        dp = 1
    else:
        strategy = NPUHybridStrategy(**(strategy_kwargs or {}))
        kwargs["strategy"] = strategy
        if plugin_kwargs is not None:
            kwargs["plugins"] = [HybridPrecision(precision, **plugin_kwargs)]
        else:
            kwargs["precision"] = precision
        cfg = strategy.parallel_config
        dp = devices // cfg.tensor_parallel_size // cfg.pipeline_parallel_size
    data = TextDataModule(block_size=model.hparams.block_size, batch_size=global_batch // dp, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        limit_val_batches=0,
        # resume at an epoch boundary: Lightning restarts a mid-epoch dataloader from the epoch's start
        limit_train_batches=limit_train_batches,
        logger=False,
        enable_checkpointing=ckpt_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        gradient_clip_val=gradient_clip_val,
        deterministic=True,
        num_sanity_val_steps=0,
        **kwargs,
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
    """Train the same tiny GPT from the same seed under each precision in turn (one process, dp=1)."""
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
