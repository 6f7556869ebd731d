"""Module-level workers for ZeRO 2/3 under pipeline parallelism and for resharding checkpoints across pp sizes
(run in real processes by `lightning_npu.launch.spawn`; several Trainers per spawn, as tests/_zero_workers.py)."""

from __future__ import annotations

import os
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist

import lightning_npu  # noqa: F401
from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from lightning_npu.parallel.data_parallel import wrap as data_parallel
from tests._gpt_workers import LossRecorder, parity_trainer
from tests._pp_workers import PP_GPT, GradNormRecorder


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank holding (a shard of) it: `full_tensor()` is a collective over its mesh."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone().cpu()


def full_local_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's (stage's) parameters and buffers, unsharded over dp. Collective within each dp group."""
    return {k: _full(v) for k, v in module.state_dict().items()}


class ReduceScatterCounter(L.Callback):
    """Gradient reduce-scatter calls per micro-step (FSDP2's gradient reduction on gloo goes through these)."""

    NAMES = ("reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter")

    def __init__(self) -> None:
        self.counts: list[int] = []
        self._n = 0
        self._originals: dict[str, Any] = {}

    def install(self) -> None:
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._originals[name] = fn

            def counted(*a: Any, _fn: Any = fn, **k: Any) -> Any:
                self._n += 1
                return _fn(*a, **k)

            setattr(dist, name, counted)

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._n = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.counts.append(self._n)


def run(
    devices: int,
    steps: int,
    strategy_kwargs: dict[str, Any],
    global_batch: int = 8,
    accumulate: int = 1,
    ckpt_dir: Optional[str] = None,
    ckpt_in: Optional[str] = None,
    limit_train_batches: Optional[int] = 3,
    validate: bool = False,
    gradient_clip_val: Optional[float] = None,
) -> dict[str, Any]:
    """Train the 4-block GPT (fp32); returns logged losses, this rank's full (dp-gathered) state, what a resume
    restored (`restored`: the parameters at `on_train_start`), reduce-scatter counts per micro-step, the global
    gradient norms clipping saw, the validation loss (`validate`: after fit, through the eval schedule)."""
    L.seed_everything(0, verbose=False)
    strategy = NPUHybridStrategy(**strategy_kwargs)
    model = GPTModule(**PP_GPT)
    recorder, counter, norms = LossRecorder(), ReduceScatterCounter(), GradNormRecorder()
    restored: dict[str, Any] = {}

    class Restored(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            if ckpt_in is not None:
                restored["params"] = full_local_state(pl_module)
                restored["step"] = trainer.global_step

    trainer, data = parity_trainer(
        strategy, model, devices, global_batch, steps, [recorder, counter, norms, Restored()], ckpt_dir,
        limit_train_batches, num_sanity_val_steps=0, accumulate_grad_batches=accumulate,
        gradient_clip_val=gradient_clip_val,
    )
    counter.install()
    try:
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_in)
    finally:
        counter.uninstall()
    val = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"] if validate else None
    runner = getattr(trainer.strategy, "_pipeline", None)
    return {
        "logged": recorder.logged,
        "state": full_local_state(model),
        "restored": restored,
        "reduce_scatters": counter.counts,
        "grad_norms": norms.norms,
        "val_loss": None if val is None else float(val),
        "global_step": trainer.global_step,
        "mesh": tuple(trainer.strategy.device_mesh.mesh.shape),
        "stages": runner.local_stages if runner is not None else None,
        "fully_sharded": data_parallel.is_fully_sharded(model),
        # elements this rank stores: its dp shards under ZeRO 2/3 (a DTensor's numel() is the global one)
        "local_numel": sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters()),
        "optimizer": type(trainer.strategy.optimizers[0]).__name__,
    }


def _world() -> int:
    # Lightning's environment deletes WORLD_SIZE at teardown; the next Trainer of this process needs it
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    os.environ["WORLD_SIZE"] = str(world)
    return world


def run_many(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [run(_world(), **c) for c in configs]
