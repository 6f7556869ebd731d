"""Module-level workers for pipeline x tensor parallelism with checkpoints and ZeRO 2/3 (run in real processes by
`lightning_npu.launch.spawn`; several Trainers per spawn, as tests/_pp_zero_workers.py)."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch

import lightning_npu  # noqa: F401
from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from lightning_npu.parallel.data_parallel import wrap as data_parallel
from lightning_npu.parallel.tensor_parallel.shards import fused_layout
from tests._gpt_workers import LossRecorder, full_state, parity_trainer
from tests._pp_workers import PP_GPT
from tests._pp_zero_workers import _world
from tests._zero_sp_workers import _record_norm_weight_dtypes


def full_local_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's (stage's) keys of the model's full, original-layout state (a collective)."""
    own = module.state_dict().keys()
    return {k: v for k, v in full_state(module).items() if k in own}


def run(
    steps: int,
    strategy_kwargs: dict[str, Any],
    global_batch: int = 8,
    ckpt_dir: Optional[str] = None,
    ckpt_in: Optional[str] = None,
    limit_train_batches: Optional[int] = 3,
    validate: bool = False,
    precision: str = "32-true",
) -> dict[str, Any]:
    """Train the 4-block GPT (fp32); returns the logged losses, this rank's full state after fit, and what a resume
    restored (`restored`: the full parameters at `on_train_start`, and the global step)."""
    devices = _world()
    L.seed_everything(0, verbose=False)
    strategy = NPUHybridStrategy(**strategy_kwargs)
    model = GPTModule(**PP_GPT)
    norm_dtypes = _record_norm_weight_dtypes(model)  # as each norm's forward sees its (gathered) weight
    recorder = LossRecorder()
    restored: dict[str, Any] = {}

    class Restored(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            if ckpt_in is not None:
                restored["params"] = full_local_state(pl_module)
                restored["step"] = trainer.global_step

    trainer, data = parity_trainer(
        strategy, model, devices, global_batch, steps, [recorder, Restored()], ckpt_dir, limit_train_batches,
        num_sanity_val_steps=0, precision=precision,
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_in)
    val = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"] if validate else None
    runner = getattr(trainer.strategy, "_pipeline", None)
    return {
        "logged": recorder.logged,
        "state": full_local_state(model),
        "restored": restored,
        "val_loss": None if val is None else float(val),
        "global_step": trainer.global_step,
        "mesh": tuple(trainer.strategy.device_mesh.mesh.shape),
        "stages": runner.local_stages if runner is not None else None,
        "fully_sharded": data_parallel.is_fully_sharded(model),
        "placements": {n: str(getattr(p, "placements", None)) for n, p in model.named_parameters()},
        "fsdp_units": sorted(type(m).__name__ for m in data_parallel.fsdp_modules(model)),
        "norm_weight_dtypes": sorted(norm_dtypes),
        "fused": fused_layout(model),
        "optimizer": type(trainer.strategy.optimizers[0]).__name__,
    }


def run_many(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [run(**c) for c in configs]
