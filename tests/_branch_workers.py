"""Workers for tests/test_branch_layouts.py: the stock transformers CLIPModel of the model zoo (tiny config, fp32,
dropout off, every step clipped) under `branch_layouts`, against one process reading the same samples.

One launch per world size runs every case in turn (`run_cases`); a case is a strategy layout plus what to do with
checkpoints (save after its steps, or resume from one) and how many steps and samples per batch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import BaseFinetuning
from torch.utils.data import DataLoader

import lightning_npu
from lightning_npu import NPUHybridStrategy
from tests._model_zoo_workers import CLIP, GLOBAL_BATCH, Losses, ZooData, ZooModule, _world

TEXT = "model.text_model"
VISION = "model.vision_model"


@dataclass(frozen=True)
class BranchCase:
    strategy: dict[str, Any] = field(default_factory=dict)
    steps: int = 3
    batch: int = GLOBAL_BATCH  # the global batch per step
    save: Optional[str] = None  # save a checkpoint here after the steps (a file name under the launch's directory)
    resume: Optional[str] = None  # resume from this checkpoint (same), up to `steps`
    samples: int = 3 * GLOBAL_BATCH  # the dataset: epochs of samples // batch steps
    accumulate: int = 1  # accumulate_grad_batches (batches per optimizer step)
    precision: Optional[str] = None  # the Trainer's (None: its default, fp32)
    finetune: bool = False  # Lightning's BaseFinetuning: the text tower frozen for the first epoch, then added


class FreezeTextFirstEpoch(BaseFinetuning):
    """The recipe of Lightning's docs: the text tower frozen before training, unfrozen at epoch 1 and given to the
    optimizer as a new param group (`unfreeze_and_add_param_group` -> `optimizer.add_param_group`), at lr / 10."""

    def freeze_before_training(self, pl_module: L.LightningModule) -> None:
        self.freeze(pl_module.model.text_model)

    def finetune_function(self, pl_module: L.LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.model.text_model, optimizer)


class FinetuneModule(ZooModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:  # what BaseFinetuning expects: the trainable ones
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, eps=1e-5,
                                 weight_decay=0.01)


class BranchBytes(L.Callback):
    """What the branches' bdp sums sent from this rank, read before teardown drops the gradient sync."""

    sent: Optional[int] = None

    compressed: Optional[int] = None  # what the compressor sent (a ZeRO-2/3 branch's compressed reduce-scatters too)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.sent = getattr(trainer.strategy._grad_sync, "sent_bytes", None)
        self.compressed = getattr(trainer.strategy._grad_sync.compressor, "sent_bytes", None)


def fit_case(case: BranchCase, directory: str) -> dict[str, Any]:
    world = _world()
    L.seed_everything(0, verbose=False)
    model = (FinetuneModule if case.finetune else ZooModule)("clip")
    strategy = NPUHybridStrategy(**case.strategy)
    cfg = strategy.parallel_config
    dp = world // (cfg.tensor_parallel_size * cfg.pipeline_parallel_size)
    losses, sent = Losses(), BranchBytes()
    extra = [FreezeTextFirstEpoch()] if case.finetune else []
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=case.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[losses, sent, *extra],
        num_sanity_val_steps=0, limit_val_batches=0, deterministic=True, gradient_clip_val=CLIP,
        accumulate_grad_batches=case.accumulate, **({"precision": case.precision} if case.precision else {}),
    )
    loader = DataLoader(ZooData("clip", case.samples), batch_size=case.batch // dp, shuffle=False)
    ckpt = os.path.join(directory, case.resume) if case.resume else None
    try:
        trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt)
    except Exception as err:  # noqa: BLE001 (a refusal is a result here)
        return {"error": f"{type(err).__name__}: {err}"}
    if case.save:
        trainer.save_checkpoint(os.path.join(directory, case.save))
    return {"logged": losses.logged, "state": lightning_npu.full_state_dict(model), "branch_bytes": sent.sent,
            "text_state": state_held(trainer, TEXT), "text_bytes": state_bytes(trainer, TEXT),
            "text_local": sum(getattr(p, "_local_tensor", p).numel() for p in model.get_submodule(TEXT).parameters()),
            "compressed_bytes": sent.compressed, "variance": {n: variance(trainer, n) for n in (TEXT, VISION)},
            "report": str(trainer.strategy.tp_report),
            "held": {n: held(model.get_submodule(n)) for n in (TEXT, VISION)}}


def held(module: torch.nn.Module) -> dict[str, float]:
    """How a tower is stored on this rank: the share of its parameters that are FSDP2 shards over the branch's
    ``fdp`` ranks, and the elements this rank holds of them over their full count."""
    from torch.distributed.tensor import DTensor

    params = list(module.parameters())
    over_fdp = [p for p in params if isinstance(p, DTensor) and "fdp" in (p.device_mesh.mesh_dim_names or ())]
    return {"fdp": len(over_fdp) / len(params),
            "local": sum(p.to_local().numel() for p in over_fdp) / max(1, sum(p.numel() for p in over_fdp))}


def state_held(trainer: L.Trainer, prefix: str) -> Optional[float]:
    """Under ZeRO-1 (a `DistributedOptimizer`): the elements of the optimizer's ``exp_avg`` under `prefix` this rank
    holds over their full count (None in other layouts)."""
    from torch.distributed.tensor import DTensor

    from lightning_npu.parallel.optim.mixed_precision import unwrap_optimizer

    opt = unwrap_optimizer(trainer.strategy.optimizers[0]) if trainer.strategy.optimizers else None
    if not hasattr(opt, "sharded_state_dict"):
        return None
    held = [v for k, v in opt.sharded_state_dict().items()
            if k.startswith(f"state.{prefix}.") and k.endswith(".exp_avg") and isinstance(v, DTensor)]
    return sum(v.to_local().numel() for v in held) / max(1, sum(v.numel() for v in held))


def variance(trainer: L.Trainer, prefix: str) -> Optional[float]:
    """The sum of this rank's Adam ``exp_avg_sq`` over the parameters under `prefix` (a fingerprint: 1-bit Adam
    freezes a compressed branch's after its warm-up); None where the optimizer keeps other keys (ZeRO-1)."""
    from lightning_npu.parallel.optim.grad_norm import local_tensor
    from lightning_npu.parallel.optim.mixed_precision import unwrap_optimizer

    if not trainer.strategy.optimizers:
        return None
    opt = unwrap_optimizer(trainer.strategy.optimizers[0])
    inner = getattr(opt, "optimizer", opt)
    names = {id(p): n for n, p in trainer.lightning_module.named_parameters()}
    held = [s["exp_avg_sq"] for p, s in inner.state.items()
            if names.get(id(p), "").startswith(prefix + ".") and "exp_avg_sq" in s]
    return float(sum(float(local_tensor(v).double().sum()) for v in held)) if held else None


def run_cases(cases: dict[str, BranchCase], directory: str) -> dict[str, Any]:
    """One process group, every case in turn."""
    return {name: fit_case(case, directory) for name, case in cases.items()}


def compare(reference: dict[str, Any], got: dict[str, Any], steps: Optional[slice] = None) -> dict[str, float]:
    """The largest relative difference of the logged losses and absolute difference of the final full state."""
    assert "error" not in got, got["error"]
    ref_losses, losses = reference["logged"], got["logged"]
    if steps is not None:
        ref_losses = ref_losses[steps]
    loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) if losses else 0.0
    state = max((got["state"][k] - v).abs().max().item() for k, v in reference["state"].items()
                if isinstance(v, torch.Tensor) and v.is_floating_point())
    return {"loss": loss, "state": state}


def state_bytes(trainer: L.Trainer, prefix: str) -> Optional[tuple[int, int]]:
    """Under a `DistributedOptimizer`: (bytes this rank holds, bytes of the whole tensors) of the fp32 masters and
    optimizer state under `prefix` (None in other layouts)."""
    from torch.distributed.tensor import DTensor

    from lightning_npu.parallel.optim.mixed_precision import unwrap_optimizer

    opt = unwrap_optimizer(trainer.strategy.optimizers[0]) if trainer.strategy.optimizers else None
    if not hasattr(opt, "master_state_dict"):
        return None
    tensors = [v for k, v in opt.sharded_state_dict().items() if k.startswith(f"state.{prefix}.")]
    tensors += [v for k, v in opt.master_state_dict().items() if k.startswith(f"{prefix}.")]
    tensors = [v for v in tensors if isinstance(v, DTensor)]
    return (sum(v.to_local().numel() * v.element_size() for v in tensors),
            sum(v.numel() * v.element_size() for v in tensors))
