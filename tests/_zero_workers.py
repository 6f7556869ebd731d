"""Module-level workers for the ZeRO and checkpoint tests (run in real processes by `launch.spawn`).

One spawned process group runs several Trainers in sequence: the process start-up and imports
(most of a tiny run's cost on CPU) are paid once per test module.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist

import lightning_npu
from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from lightning_npu.parallel.checkpoint import sharded as ckpt
from lightning_npu.parallel.data_parallel import wrap as data_parallel
from lightning_npu.parallel.optim.mixed_precision import stepped_params
from tests._gpt_workers import SMALL_GPT, parity_trainer


class OptGPT(GPTModule):
    """The example GPT with a choice of optimizer: AdamW + warmup (the example's), SGD+momentum+StepLR, fused Adam."""

    def __init__(self, optimizer: str = "adamw", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optimizer_name = optimizer
        if optimizer == "adamw_frozen":  # before DDP sees the model
            self.model.transformer.wpe.weight.requires_grad_(False)
        if optimizer == "manual_accumulate":
            self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return super().training_step(batch, batch_idx)
        # manual optimization, two backward passes per step: gradients must accumulate across both
        opt = self.optimizers()
        half = batch[0].shape[0] // 2
        losses = []
        for part in (slice(0, half), slice(half, None)):
            loss = self.loss([t[part] for t in batch])
            self.manual_backward(loss / 2)
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
        loss = torch.stack(losses).mean()
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss  # for callbacks (`outputs["loss"]`); manual optimization does not backpropagate it

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return super().configure_optimizers()
        if self.optimizer_name == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        if self.optimizer_name == "manual_accumulate":
            return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-5)
        if self.optimizer_name == "adamw_frozen":  # a frozen parameter inside the optimizer: never updated
            return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-5, weight_decay=0.1)
        if self.optimizer_name == "adam_fused":
            return torch.optim.Adam(self.parameters(), lr=3e-3, eps=1e-5, fused=True)
        raise ValueError(self.optimizer_name)


def _bytes(tensors) -> int:
    return sum(data_parallel._local_bytes(t) for t in tensors)


class Probe(L.Callback):
    """Losses, per-rank tensor bytes and FSDP reduce-scatter calls per micro-step."""

    def __init__(self) -> None:
        self.logged: list[float] = []
        self.param_bytes_rest: list[int] = []
        self.param_bytes_fwd: list[int] = []
        self.grad_bytes: list[int] = []
        self.step_grad_bytes: list[int] = []
        self.optim_bytes: list[int] = []
        self.reduce_scatters: list[int] = []
        self.lr: list[float] = []
        self._rs = 0

    @contextlib.contextmanager
    def counting(self):
        # gradient reductions: reduce-scatters, and ZeRO-1's in-place bucket all-reduces (gloo) through the one
        # bucket reduction
        from lightning_npu.parallel.data_parallel import sync

        names = [n for n in ("reduce_scatter_tensor", "reduce_scatter_single") if hasattr(dist, n)]
        originals = {n: getattr(dist, n) for n in names}
        original_bucket = sync.reduce_bucket

        def wrap(fn):
            def counted(*a, **k):
                self._rs += 1
                return fn(*a, **k)

            return counted

        for n in names:
            setattr(dist, n, wrap(originals[n]))
        sync.reduce_bucket = wrap(original_bucket)
        try:
            yield
        finally:
            for n in names:
                setattr(dist, n, originals[n])
            sync.reduce_bucket = original_bucket

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._rs = 0

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        # what forward left allocated for backward: ZeRO 2 keeps the gathered parameters, ZeRO 3 freed them
        self.param_bytes_fwd.append(_bytes(pl_module.parameters()))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grad_bytes.append(_bytes(p.grad for p in pl_module.parameters() if p.grad is not None))
        # the gradients the optimizer steps with: ZeRO 1's reduced slices, FSDP2's shards, DDP's full gradients
        stepped = [p.grad for p in stepped_params(optimizer) if p.grad is not None]
        self.step_grad_bytes.append(_bytes(stepped))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.reduce_scatters.append(self._rs)
        if "train_loss" in trainer.callback_metrics:
            self.logged.append(float(trainer.callback_metrics["train_loss"]))
        self.param_bytes_rest.append(data_parallel.parameter_bytes(pl_module))
        self.optim_bytes.append(data_parallel.sharded_optimizer_state_bytes(trainer.strategy.optimizers[0]))
        self.lr.append(float(trainer.optimizers[0].param_groups[0]["lr"]))


full_params = lightning_npu.full_state_dict  # every rank gets the full (unsharded) tensors: collective


def full_optimizer_state(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    """`state.<fqn>.<name>` -> full tensor, gathered from every rank's shard/partition: collective."""
    osd = ckpt.optimizer_state_dict(trainer.lightning_module, trainer.strategy.optimizers[0])
    local = {}
    for k, v in osd.items():
        if k.startswith("state.") and isinstance(v, torch.Tensor):
            local[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone().cpu()
    if not dist.is_initialized():
        return local
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        merged.update(part)
    return merged


def run(
    devices: int,
    zero_stage: int,
    steps: int,
    optimizer: str = "adamw",
    accumulate: int = 1,
    global_batch: int = 8,
    ckpt_dir: Optional[str] = None,
    ckpt_in: Optional[str] = None,
    model_kwargs: Optional[dict] = None,
    async_save: bool = False,
    with_optimizer_state: bool = False,
    limit_train_batches: int = 200,
    save_distributed_checkpoint: Any = True,  # these scenarios are about sharded directories
    refit_steps: int = 0,
) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    strategy = NPUHybridStrategy(zero_stage=zero_stage, async_save=async_save,
                                 save_distributed_checkpoint=save_distributed_checkpoint)
    model = OptGPT(optimizer=optimizer, **{**SMALL_GPT, "warmup_steps": 3, **(model_kwargs or {})})
    probe = Probe()
    restored: dict[str, Any] = {}

    class Restored(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            if ckpt_in is not None:
                restored["params"] = full_params(pl_module)
                restored["optim"] = full_optimizer_state(trainer)
                restored["step"] = trainer.global_step

    trainer, data = parity_trainer(strategy, model, devices, global_batch, steps, [probe, Restored()], ckpt_dir,
                                   limit_train_batches, num_sanity_val_steps=0, accumulate_grad_batches=accumulate)
    with probe.counting():
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_in)
    out = {
        "logged": probe.logged,
        "param_bytes_rest": probe.param_bytes_rest,
        "param_bytes_fwd": probe.param_bytes_fwd,
        "grad_bytes": probe.grad_bytes,
        "step_grad_bytes": probe.step_grad_bytes,
        "optim_bytes": probe.optim_bytes,
        "reduce_scatters": probe.reduce_scatters,
        "lr": probe.lr,
        "optimizer": type(trainer.strategy.optimizers[0]).__name__,
        "global_step": trainer.global_step,
        "params": full_params(model),
        "restored": restored,
    }
    if with_optimizer_state:
        out["optim"] = full_optimizer_state(trainer)
    if refit_steps:  # the same model fit again by a new Trainer: the first fit's gradient hooks must be gone
        again, hooks = Probe(), []

        class Hooks(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, *args) -> None:
                hooks.append(max(len(p._post_accumulate_grad_hooks or {}) for p in pl_module.parameters()))

        trainer, data = parity_trainer(NPUHybridStrategy(zero_stage=zero_stage), model, _world(), global_batch,
                                       refit_steps, [again, Hooks()], None, limit_train_batches,
                                       num_sanity_val_steps=0)
        with again.counting():
            trainer.fit(model, datamodule=data)
        out["refit_reductions"] = again.reduce_scatters
        out["grad_hooks"] = hooks
    return out


def _world() -> int:
    # Lightning's environment deletes WORLD_SIZE at teardown; the next Trainer of this process needs it
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    os.environ["WORLD_SIZE"] = str(world)
    return world


def run_many(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [run(_world(), **c) for c in configs]


# ---- checkpoint scenarios ------------------------------------------------------------------------
class FailingWrite(Exception):
    pass


def _fail_writes():
    """Make DCP's file writer raise after its first shard file started: a crash half-way through a save."""
    from torch.distributed.checkpoint import filesystem

    original = filesystem._write_files_from_queue

    def broken(*args, **kwargs):
        raise FailingWrite("injected failure inside the checkpoint writer")

    filesystem._write_files_from_queue = broken
    return lambda: setattr(filesystem, "_write_files_from_queue", original)


def crash_and_mismatch(tmp: str) -> dict[str, Any]:
    """Save P, change the weights, crash while overwriting P; P must still hold the first weights.

    Then load P into models of another shape: the errors must name the keys.
    """
    world = _world()
    tmp_path = Path(tmp)
    L.seed_everything(0, verbose=False)
    model = OptGPT(**SMALL_GPT)
    trainer, data = parity_trainer(NPUHybridStrategy(zero_stage=3), model, world, 4, 2, [], num_sanity_val_steps=0)
    trainer.fit(model, datamodule=data)
    good = tmp_path / "last.ckpt"
    trainer.save_checkpoint(good)
    saved = full_params(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    restore = _fail_writes()
    error = None
    try:
        trainer.save_checkpoint(good)
    except Exception as err:  # DCP re-raises the failing rank's error on every rank
        error = f"{type(err).__name__}: {err}"
    finally:
        restore()
    leftovers = sorted(p.name for p in tmp_path.iterdir())

    # the previous checkpoint loads, under another layout (zero 1), with the weights it was saved with
    _world()
    L.seed_everything(1, verbose=False)
    fresh = OptGPT(**SMALL_GPT)
    t2, _ = parity_trainer(NPUHybridStrategy(zero_stage=1), fresh, world, 4, 2, [], num_sanity_val_steps=0)
    t2.fit(fresh, datamodule=data, ckpt_path=str(good))  # max_steps already reached: restore only
    loaded = full_params(fresh)

    errors = {}
    for name, kwargs in {"fewer_layers": {"n_layer": 1}, "more_layers": {"n_layer": 3}, "wider": {"n_embd": 48}}.items():
        _world()
        other = OptGPT(**{**SMALL_GPT, **kwargs})
        t3, _ = parity_trainer(NPUHybridStrategy(zero_stage=0), other, world, 4, 3, [], num_sanity_val_steps=0)
        try:
            t3.fit(other, datamodule=data, ckpt_path=str(good))
            errors[name] = None
        except Exception as err:
            errors[name] = f"{type(err).__name__}: {err}"
    return {"error": error, "leftovers": leftovers, "saved": saved, "loaded": loaded, "errors": errors}
