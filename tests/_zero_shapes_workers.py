"""Workers for tests/test_zero_shapes.py: ordinary model shapes under every ZeRO stage (run by `launch.spawn`).

- `PosGPT`: a decoder whose LightningModule holds a parameter itself (``pos``, like ViT's ``pos_embed``), or
  (``pos_in="embed"``, for pipeline stages) whose embedding module holds it next to a submodule;
- `BatchNormNet`: BatchNorm running statistics, which DDP broadcasts from rank 0 before every forward.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import lightning_npu
from examples.gpt.model import Block, GPTConfig
from lightning_npu import NPUHybridStrategy
from lightning_npu.parallel.data_parallel import sync as grad_sync
from lightning_npu.parallel.data_parallel.wrap import is_sharded_root
from tests._gpt_workers import parity_trainer

STEPS, GLOBAL_BATCH = 4, 8
GPT_KW = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32)


class Embed(nn.Module):
    """Token embedding plus a learned position table held directly (a stage module holding a parameter)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Parameter(0.02 * torch.randn(cfg.block_size, cfg.n_embd))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.pos[: idx.size(1)]


class PosGPT(L.LightningModule):
    """A GPT written the ordinary way: layers on the LightningModule, ``self.pos = nn.Parameter(...)``."""

    def __init__(self, pos_in: str = "root", block_size: int = GPT_KW["block_size"], scalar: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        if scalar:  # a 0-dim parameter the LightningModule holds (CLIP's `logit_scale`)
            self.temperature = nn.Parameter(torch.tensor(1.0))
        cfg = GPTConfig(**{**GPT_KW, "block_size": block_size}, bias=False)
        if pos_in == "root":
            self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.pos = nn.Parameter(0.02 * torch.randn(cfg.block_size, cfg.n_embd))
        else:
            self.embed = Embed(cfg)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=False)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.pos[: idx.size(1)] if self.hparams.pos_in == "root" else self.embed(idx)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits * self.temperature if self.hparams.scalar else logits

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch, batch_idx):
        loss = self.pipeline_loss(self(batch[0]), batch[1])
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.pipeline_loss(self(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-5, weight_decay=0.1)


class Losses(L.Callback):
    def __init__(self) -> None:
        self.logged: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.logged.append(float(trainer.callback_metrics["train_loss"]))


def _world() -> int:
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    os.environ["WORLD_SIZE"] = str(world)  # Lightning's environment deletes it at teardown
    return world


def fit_gpt(strategy: Any, pos_in: str = "root", steps: int = STEPS, ckpt_dir: Optional[str] = None,
            ckpt_in: Optional[str] = None, scalar: bool = False) -> dict[str, Any]:
    """`strategy`: NPUHybridStrategy's arguments, or "ddp" (Lightning's own: single-file checkpoints)."""
    L.seed_everything(0, verbose=False)
    model = PosGPT(pos_in=pos_in, scalar=scalar)
    losses = Losses()
    if strategy == "ddp":
        strategy, instance = {}, DDPStrategy()
        instance.parallel_config = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
    else:
        instance = NPUHybridStrategy(**strategy)
    trainer, data = parity_trainer(instance, model, _world(), GLOBAL_BATCH, steps, [losses], ckpt_dir=ckpt_dir)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_in)
    out: dict[str, Any] = {"logged": losses.logged, "state": lightning_npu.full_state_dict(model),
                           "root_unit": is_sharded_root(model)}
    if strategy.get("zero_stage") in (2, 3) and strategy.get("pipeline_parallel_size", 1) == 1 and pos_in == "root":
        out["pos_local_rows"] = model.pos.to_local().shape[0]  # the root unit shards `pos` over dp
        # full-state API: load (state + 1), read back, restore
        full = out["state"]
        lightning_npu.load_full_state_dict(model, {k: v + 1 for k, v in full.items()})
        back = lightning_npu.full_state_dict(model)
        out["round_trip_error"] = max((back[k] - full[k] - 1).abs().max().item() for k in full)
        lightning_npu.load_full_state_dict(model, full)
    if strategy.get("pipeline_parallel_size", 1) == 1:  # evaluation after fit runs through the root unit too
        out["val_loss"] = float(trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"])
    return out


# ---- buffers --------------------------------------------------------------------------------------------
class BatchNormNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mse", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g) * torch.linspace(0.5, 3.0, 8)  # each rank's half differs in scale
        x[1::2] += 2.0  # rank 1's samples (DistributedSampler: odd indices) are shifted: its statistics differ
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4, shuffle=False)

    def val_dataloader(self):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def fit_batchnorm(strategy: Any, accumulate: int = 1) -> dict[str, Any]:
    """Two epochs of 4 steps each, one validation batch after each epoch; returns this rank's buffers and params."""
    L.seed_everything(0, verbose=False)
    model = BatchNormNet()
    trainer = L.Trainer(
        accelerator="cpu", devices=_world(), strategy=strategy, max_epochs=2, limit_train_batches=4 * accumulate,
        limit_val_batches=1, num_sanity_val_steps=1, accumulate_grad_batches=accumulate, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, deterministic=True,
        use_distributed_sampler=True,
    )
    trainer.fit(model)
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    return {"buffers": buffers, "params": lightning_npu.full_state_dict(model)}


@contextlib.contextmanager
def counting_bucket_reductions():
    """Every call of `grad_sync.reduce_bucket` (DDP's comm hook, ZeRO-1's buckets, FSDP2's reduce-scatter)."""
    calls: list[int] = []
    original = grad_sync.reduce_bucket

    def counted(flat, *args, **kwargs):
        calls.append(flat.numel())
        return original(flat, *args, **kwargs)

    grad_sync.reduce_bucket = counted
    try:
        yield calls
    finally:
        grad_sync.reduce_bucket = original


# ---- one process group, every run --------------------------------------------------------------------
def run_all(tmp: str) -> dict[str, Any]:
    world = _world()
    out: dict[str, Any] = {}
    for z in (0, 1, 2, 3):
        with counting_bucket_reductions() as calls:
            out[f"dp-zero{z}"] = fit_gpt({"zero_stage": z})
        out[f"dp-zero{z}"]["bucket_reductions"] = len(calls)
    out["tp2-zero3"] = fit_gpt({"zero_stage": 3, "tensor_parallel_size": world})
    out["pp2-zero3-embed"] = fit_gpt({"zero_stage": 3, "pipeline_parallel_size": world}, pos_in="embed")
    # a DCP checkpoint under zero 3 at step 3, resumed to step 6 under zero 3 and zero 1; Lightning "ddp"'s
    # single-file checkpoint of the same model resumed under zero 1 (zero 2/3 refuse single-file resumes)
    out["zero3-6"] = fit_gpt({"zero_stage": 3}, steps=6, ckpt_dir=f"{tmp}/zero3")
    first = f"{tmp}/zero3/epoch=0-step=3.ckpt"
    out["zero3-resumed"] = fit_gpt({"zero_stage": 3}, steps=6, ckpt_in=first)
    out["zero1-from-dir"] = fit_gpt({"zero_stage": 1}, steps=6, ckpt_in=first)
    # (Lightning's own resume of its file restarts the epoch's data: the reference is "ddp" resuming it)
    fit_gpt("ddp", steps=3, ckpt_dir=f"{tmp}/ddp")
    single = f"{tmp}/ddp/epoch=0-step=3.ckpt"
    out["single_file"] = Path(single).is_file()
    out["ddp-from-file"] = fit_gpt("ddp", steps=6, ckpt_in=single)
    out["zero1-from-file"] = fit_gpt({"zero_stage": 1}, steps=6, ckpt_in=single)
    # a 0-dim parameter (whole on every rank, gradient all-reduced) under zero 1 and 3, each saved as a DCP
    # directory at step 3 and resumed under the other stage
    for z in (1, 3):
        out[f"scalar-zero{z}-6"] = fit_gpt({"zero_stage": z, "save_distributed_checkpoint": True}, steps=6,
                                           ckpt_dir=f"{tmp}/scalar{z}", scalar=True)
    for z, saved in ((3, 1), (1, 3)):
        out[f"scalar-zero{z}-from-zero{saved}"] = fit_gpt(
            {"zero_stage": z}, steps=6, ckpt_in=f"{tmp}/scalar{saved}/epoch=0-step=3.ckpt", scalar=True)
    # BatchNorm buffers against Lightning's own DDP
    out["bn-ddp"] = fit_batchnorm("ddp")
    for z in (0, 1, 2, 3):
        out[f"bn-zero{z}"] = fit_batchnorm(NPUHybridStrategy(zero_stage=z))
    out["bn-ddp-accumulate"] = fit_batchnorm("ddp", accumulate=2)
    out["bn-zero3-accumulate"] = fit_batchnorm(NPUHybridStrategy(zero_stage=3), accumulate=2)
    return out


def run_reference() -> dict[str, Any]:
    out = {pos_in: fit_gpt({"zero_stage": 0}, pos_in=pos_in) for pos_in in ("root", "embed")}
    out["scalar-6"] = fit_gpt({"zero_stage": 0}, steps=6, scalar=True)
    return out
