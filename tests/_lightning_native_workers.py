"""Lightning's own DDP checks (gradients synced in the hooks, the grad_norm recipe, unused parameters, gradient
accumulation), run under ``npu_hybrid`` in real processes; `run_group` fits several layouts in one launch."""

from __future__ import annotations

import copy
from typing import Any, Optional, Sequence

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import nn
from torch.utils.data import DataLoader

import lightning_npu
from lightning_npu import NPUHybridStrategy
from lightning_npu.parallel.checkpoint.full_state import full_tensor
from lightning_npu.parallel.optim.mixed_precision import unwrap_optimizer

GLOBAL_BATCH, ACCUMULATE, STEPS, LR = 8, 2, 2, 0.1
TOTAL = "grad_2.0_norm_total"


def full_grad(p: torch.Tensor) -> torch.Tensor:
    """The whole gradient of `p` (gathered from dp slices and tp shards): collective."""
    return full_tensor(p.grad, p).detach().float().clone()


class Net(BoringModel):
    """BoringModel with a hidden layer (a tp=2 colwise/rowwise pair) and a parameter that forward never uses."""

    def __init__(self, unused: bool = True) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 2))
        self.unused = nn.Linear(32, 4) if unused else None
        self.seen: dict[str, list[Any]] = {"after_backward": [], "before_step": [], "after_step": [], "logged": [],
                                           "lightning_total": [], "kinds": [], "views_bucket": []}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)

    def _grads(self) -> dict[str, torch.Tensor]:
        # test_ddp_gradients_synced reads p.grad in the hooks: every used parameter has one
        return {n: full_grad(p) for n, p in self.named_parameters() if p.grad is not None}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.batch_idx = batch_idx

    def on_after_backward(self) -> None:
        if (self.batch_idx + 1) % ACCUMULATE == 0:  # the stepping micro-batch (the others hold local sums)
            self.seen["after_backward"].append(self._grads())

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen["before_step"].append(self._grads())
        self.seen["kinds"].append({n: (type(p.grad).__name__, str(p.grad.dtype)) for n, p in self.named_parameters()
                                   if p.grad is not None})
        norms = lightning_npu.grad_norm(self, norm_type=2)  # Lightning's recipe, lightning_npu's grad_norm
        self.log_dict(norms, sync_dist=True)
        plain = all(not hasattr(p.grad, "full_tensor") for p in self.parameters() if p.grad is not None)
        if plain:  # Lightning's own grad_norm reads plain tensors only
            self.seen["lightning_total"].append(float(lightning_grad_norm(self, norm_type=2)[TOTAL]))
        opt = unwrap_optimizer(optimizer)
        if hasattr(opt, "buckets"):  # ZeRO-1: each `.grad` is a view of this rank's reduce-scattered slice
            storages = {b.grad.untyped_storage().data_ptr() for b in opt.buckets}
            self.seen["views_bucket"].append(all(
                p.grad.to_local().untyped_storage().data_ptr() in storages
                for p in self.parameters() if p.grad is not None and p.dtype == torch.float32))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if (batch_idx + 1) % ACCUMULATE == 0:
            self.seen["after_step"].append(self._grads())
            self.seen["logged"].append(float(self.trainer.callback_metrics[TOTAL]))


def loader() -> DataLoader:
    torch.manual_seed(1)
    return DataLoader(RandomDataset(32, GLOBAL_BATCH * ACCUMULATE * STEPS), batch_size=GLOBAL_BATCH)


def reference(model: Net) -> dict[str, Any]:
    """One process, plain torch: the gradients (mean loss over the global batch, accumulated) and SGD steps."""
    model = copy.deepcopy(model)
    # the global batches the dp ranks read together: DistributedSampler's shuffled order (seed 0, epoch 0)
    order = torch.randperm(len(loader().dataset), generator=torch.Generator().manual_seed(0))
    batches = list(DataLoader(torch.utils.data.Subset(loader().dataset, order.tolist()), batch_size=GLOBAL_BATCH))
    grads, norms = [], []
    for step in range(STEPS):
        model.zero_grad()
        for micro in range(ACCUMULATE):
            (model.step(batches[step * ACCUMULATE + micro]) / ACCUMULATE).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        norms.append(float(torch.stack([g.norm() for g in grads[-1].values()]).norm()))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
    return {"grads": grads, "norms": norms, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def fit(strategy: dict[str, Any], precision: str = "32-true", unused: bool = True) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    model = Net(unused)
    ref = reference(model) if precision == "32-true" else None
    cfg = NPUHybridStrategy(**strategy).parallel_config
    dp = 2 // cfg.tensor_parallel_size
    data = DataLoader(loader().dataset, batch_size=GLOBAL_BATCH // dp)  # sequential: Lightning adds the dp sampler
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=NPUHybridStrategy(**strategy), precision=precision,
                        max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, deterministic=True)
    trainer.fit(model, train_dataloaders=data)
    return {"seen": model.seen, "ref": ref, "state": lightning_npu.full_state_dict(model)}


def unused_without_flag() -> str:
    """zero 0 is DDP: a parameter forward never uses needs find_unused_parameters=True, as under "ddp"."""
    try:
        fit({"zero_stage": 0})
    except Exception as err:  # noqa: BLE001 (the message is the result)
        return str(err)
    return ""


class Scheduled(BoringModel):
    """BoringModel with AdamW over two param groups and a step-interval StepLR (issue 14's LearningRateMonitor)."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW([{"params": [self.layer.weight]}, {"params": [self.layer.bias], "lr": 0.05}], lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit_lr_monitor(strategy: Any, precision: str = "32-true", devices: int = 2, steps: int = 4,
                   root: Optional[str] = None) -> dict[str, Any]:
    """Fit `Scheduled` with Lightning's LearningRateMonitor and a CSVLogger (under `root`); what a user sees."""
    import tempfile
    import warnings

    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    L.seed_everything(0, verbose=False)
    model, monitor = Scheduled(), LearningRateMonitor(logging_interval="step")
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision=precision, max_steps=steps,
                        limit_val_batches=0,
                        callbacks=[monitor], logger=CSVLogger(root or tempfile.mkdtemp()), log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    config = trainer.lr_scheduler_configs[0]
    shown = unwrap_optimizer(trainer.optimizers[0])
    user = getattr(shown, "optimizer", shown)  # the user's AdamW behind npu_hybrid's wrapper
    return {
        "lrs": {k: [float(v) for v in vals] for k, vals in monitor.lrs.items()},
        "state": {k: v.detach().clone() for k, v in lightning_npu.full_state_dict(model).items()}
        if isinstance(strategy, NPUHybridStrategy) else {k: v.detach().clone() for k, v in model.state_dict().items()},
        "scheduler_on_user_optimizer": config.scheduler.optimizer is user and type(user) is torch.optim.AdamW,
        # the Trainer's optimizer's groups are the user's group dicts (ZeRO-1 shows them through `ModelParamGroup`,
        # with the model's parameters in place of the fp32 slices it steps): one lr, written and read by both
        "groups_shared": len(shown.param_groups) == len(user.param_groups) and all(
            getattr(s, "group", s) is u for s, u in zip(shown.param_groups, user.param_groups)),
        "shows_model_params": {id(p) for g in shown.param_groups for p in g["params"]}
        == {id(p) for p in model.parameters()},
        "wrapper": type(shown).__name__,
        "order_warnings": [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)],
        "log_dir": trainer.logger.log_dir,
    }


def run_group(layouts: list[tuple[str, dict[str, Any], str, bool]], unused_check: bool,
              lr_layouts: Sequence[tuple[str, Any, str]] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {name: fit(strategy, precision, unused) for name, strategy, precision, unused in layouts}
    if unused_check:
        out["unused_without_flag"] = unused_without_flag()
    for name, strategy, precision in lr_layouts:
        strategy = NPUHybridStrategy(**strategy) if isinstance(strategy, dict) else strategy
        out[f"lr-{name}"] = fit_lr_monitor(strategy, precision)
    return out
