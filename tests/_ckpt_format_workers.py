"""Workers for tests/test_checkpoint_formats.py: Lightning's BoringModel flow under npu_hybrid, run by `spawn`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import lightning_npu
from lightning_npu import NPUHybridStrategy

INPUT = torch.arange(4 * 32, dtype=torch.float32).reshape(4, 32) / 100.0  # what "the trained model" predicts on


class Boring(BoringModel):
    """Lightning's BoringModel with a stateful optimizer (AdamW: its moments must survive a resume), logged
    validation/test losses and unshuffled loaders, so that a 1-process run sees the same numbers."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.step(batch)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        loss = self.step(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(random_data(64, seed=1), batch_size=4)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(random_data(32, seed=2), batch_size=4)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(random_data(32, seed=3), batch_size=4)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(INPUT, batch_size=2)


def random_data(length: int, seed: int) -> torch.Tensor:
    """RandomDataset's data, from its own generator: the same in every process whatever ran before."""
    return torch.randn(length, 32, generator=torch.Generator().manual_seed(seed))


def _data_seed() -> None:
    L.seed_everything(7, verbose=False)  # the initial weights


def _trainer(strategy: Any, devices: int, steps: int, ckpt_dir: Optional[str], **kw: Any) -> L.Trainer:
    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)] \
        if ckpt_dir else []
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                     enable_checkpointing=bool(ckpt_dir), enable_progress_bar=False, enable_model_summary=False,
                     callbacks=callbacks, deterministic=True, limit_val_batches=2, num_sanity_val_steps=0,
                     limit_train_batches=3, **kw)  # step 3 ends epoch 0: "ddp" restarts epochs, npu_hybrid need not


def _outputs(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.is_floating_point():
        x = x.to(next(model.parameters()).dtype)
    with torch.no_grad():
        out = model(x)
    out = getattr(out, "logits", out)
    return (out.full_tensor() if isinstance(out, DTensor) else out).detach().cpu().clone()


def boring_run(root: str, name: str, steps: int = 3, ckpt_in: Optional[str] = None, strategy: Any = None,
               precision: str = "32-true", **strategy_kwargs: Any) -> dict[str, Any]:
    """fit (checkpoint every 3 steps into root/name), then the trained model's numbers: full state, outputs on
    INPUT, validate/test losses and the checkpoint paths written."""
    _data_seed()
    model = Boring()
    strategy = strategy if strategy is not None else NPUHybridStrategy(**strategy_kwargs)
    ckpt_dir = str(Path(root) / name)
    trainer = _trainer(strategy, 2, steps, ckpt_dir, precision=precision)
    trainer.fit(model, ckpt_path=ckpt_in)
    out: dict[str, Any] = {"global_step": trainer.global_step, "outputs": _outputs(model, INPUT),
                           "ckpts": sorted(p.name for p in Path(ckpt_dir).iterdir()) if Path(ckpt_dir).is_dir() else []}
    if isinstance(trainer.strategy, NPUHybridStrategy):
        out["state"] = lightning_npu.full_state_dict(model)
    else:
        out["state"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    out["val_loss"] = float(trainer.validate(model, verbose=False)[0]["val_loss"])
    out["test_loss"] = float(trainer.test(model, verbose=False)[0]["test_loss"])
    return out


def llama_run(root: str, name: str, **strategy_kwargs: Any) -> dict[str, Any]:
    """The example's transformers Llama under tp=2 (default: a sharded directory), 2 steps."""
    from examples.gpt.data import TextDataModule
    from examples.llama.model import LlamaModule

    L.seed_everything(3, verbose=False)
    model = LlamaModule(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=16)
    data = TextDataModule(block_size=16, batch_size=2, shuffle=False)
    ckpt_dir = str(Path(root) / name)
    strategy = NPUHybridStrategy(tensor_parallel_size=2, **strategy_kwargs)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy,
                        max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, deterministic=True,
                        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2)])
    trainer.fit(model, datamodule=data)
    idx = torch.arange(12).reshape(2, 6) % 256
    return {"logits": _outputs(model, idx), "idx": idx, "ckpts": sorted(p.name for p in Path(ckpt_dir).iterdir())}


def run_all(root: str, configs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Every run of the test module in one launch (process start-up dominates these tiny runs)."""
    out = {}
    for name, kwargs in configs:
        kwargs = dict(kwargs)
        if name.startswith("llama"):
            out[name] = llama_run(root, name, **kwargs)
            continue
        if kwargs.pop("ddp", False):
            from lightning.pytorch.strategies import DDPStrategy

            kwargs["strategy"] = DDPStrategy()
        if "ckpt_in" in kwargs:
            kwargs["ckpt_in"] = str(Path(root) / kwargs["ckpt_in"])
        out[name] = boring_run(root, name, **kwargs)
    return out
