"""Tiny deterministic models and runners shared by the callback tests (and their scripts).

`StepSeeded` draws its batch from (global_step, rank), not from the data loader, so a run resumed
from any checkpoint replays exactly the batches an uninterrupted run sees: final parameters of a
recovered run can then be compared bit for bit with a reference run.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_npu.parallel.optim.mixed_precision import stepped_params


class StepSeeded(L.LightningModule):
    def __init__(
        self,
        lr: float = 0.05,
        nan_at: tuple[int, ...] = (),
        nan_from: Optional[int] = None,
        nan_ranks: tuple[int, ...] = (0,),
        raise_at: Optional[int] = None,
        raise_flag: Optional[str] = None,
        signal_at: Optional[int] = None,
        signal_rank: int = 0,
        kill_at: Optional[int] = None,
        kill_rank: int = 1,
        kill_flag: Optional[str] = None,
        lr_schedule: bool = False,
        none_at: tuple[int, ...] = (),
        blowup_at: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.lr = lr
        self.nan_at, self.nan_from, self.nan_ranks = set(nan_at), nan_from, set(nan_ranks)
        self.raise_at, self.raise_flag = raise_at, raise_flag
        self.signal_at, self.signal_rank = signal_at, signal_rank
        self.kill_at, self.kill_rank, self.kill_flag = kill_at, kill_rank, kill_flag
        self.lr_schedule = lr_schedule
        self.none_at = set(none_at)
        self.blowup_at = set(blowup_at)  # steps whose gradients are multiplied by 1e3 (a diverging step, finite)
        self.losses: dict[int, float] = {}
        self.param_log: dict[int, torch.Tensor] = {}

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
        x = torch.randn(16, 8, generator=g)
        return x, x.sum(1, keepdim=True).sin()

    def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
        step = self.global_step
        if step in self.none_at:  # Lightning's own way to skip a step: the reference for a skipped step
            return None
        if self.raise_at == step and (self.raise_flag is None or not Path(self.raise_flag).exists()):
            if self.raise_flag is not None:
                Path(self.raise_flag).touch()
            raise RuntimeError(f"injected failure at step {step}")
        if self.signal_at == step and self.global_rank == self.signal_rank:
            os.kill(os.getpid(), signal.SIGTERM)
        if self.kill_at == step and self.global_rank == self.kill_rank:
            if self.kill_flag is None or not Path(self.kill_flag).exists():
                if self.kill_flag is not None:
                    Path(self.kill_flag).touch()
                os.kill(os.getpid(), signal.SIGKILL)
        x, y = self.batch()
        loss = F.mse_loss(self.net(x), y)
        self.losses[step] = loss.item()
        return loss

    def on_after_backward(self) -> None:
        step = self.global_step
        if step in self.blowup_at:
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(1e3)
        poisoned = step in self.nan_at or (self.nan_from is not None and step >= self.nan_from)
        if poisoned and self.global_rank in self.nan_ranks:
            # the gradient the optimizer steps with: the model's (DDP), or its reduced slice (npu_hybrid ZeRO-1)
            stepped = stepped_params(self.trainer.optimizers[0])
            grads = [p.grad for p in stepped + list(self.parameters()) if p.grad is not None]
            grad = next(g.to_local() if hasattr(g, "to_local") else g for g in grads if g.numel() > 0)
            grad.view(-1)[0] = float("nan")

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        for opt in self.trainer.optimizers:  # ZeRO-1's parameter all-gather overlaps the next forward
            getattr(opt, "wait_parameters", lambda: None)()
        self.param_log[self.global_step] = flat_params(self)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        if not self.lr_schedule:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(4096, 1)), batch_size=1)


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in module.parameters()])


def trainer_kwargs(root: str | Path, max_steps: int, **extra: Any) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        num_sanity_val_steps=0,
    )
    kw.update(extra)
    return kw


class KillingCheckpointIO:
    """Checkpoint IO that dies (SIGKILL) half way through writing the checkpoint of one step."""

    def __new__(cls, kill_at_step: int):  # built lazily so that importing the helpers stays cheap
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        class _Killing(TorchCheckpointIO):
            def save_checkpoint(self, checkpoint, path, storage_options=None):
                if checkpoint.get("global_step") != kill_at_step:
                    return super().save_checkpoint(checkpoint, path, storage_options)
                import io

                buf = io.BytesIO()
                torch.save(checkpoint, buf)
                with open(path, "wb") as f:
                    f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                    f.flush()
                    os.fsync(f.fileno())
                os.kill(os.getpid(), signal.SIGKILL)

        return _Killing()


def clean_env() -> dict[str, str]:
    """This process's environment less the launcher variables an in-process Trainer of an earlier test left in it
    (MASTER_PORT, LOCAL_RANK, ...): a child that inherits them joins or binds that rendezvous instead of its own."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in list(env):
        if k.startswith(("TORCHELASTIC", "LOCAL_RANK", "MASTER_", "WORLD_SIZE", "GROUP_RANK")) or k in ("RANK", "NODE_RANK"):
            env.pop(k)
    return env


def script_env() -> dict[str, str]:
    """The environment of a test's own launcher script: `clean_env`, with this checkout importable first."""
    return dict(clean_env(), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
