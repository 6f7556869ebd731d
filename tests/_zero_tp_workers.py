"""Module-level workers for ZeRO 2/3 x tensor parallelism (run in real processes by `launch.spawn`).

One spawned process group runs several Trainers in sequence (as `tests._zero_workers.run_many`), so the
4-process start-up is paid once per test module.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L

import lightning_npu  # noqa: F401
from lightning_npu import NPUHybridStrategy
from lightning_npu.parallel.data_parallel import wrap as data_parallel
from tests._gpt_workers import LossRecorder, full_state, parity_trainer
from tests._tp_workers import _make_model
from tests._zero_workers import _world


class ParamBytes(L.Callback):
    """Per-parameter bytes this rank holds between steps (its (dp, tp) shard under ZeRO 3 x TP)."""

    def __init__(self) -> None:
        self.per_param: dict[str, int] = {}
        self.total: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.per_param = {n: data_parallel._local_bytes(p) for n, p in pl_module.named_parameters()}
        self.total.append(data_parallel.parameter_bytes(pl_module))


def train_zero_tp(
    strategy_kwargs: dict[str, Any],
    steps: int,
    global_batch: int = 8,
    ckpt_dir: Optional[str] = None,
    ckpt_in: Optional[str] = None,
    limit_train_batches: Optional[int] = None,
    arch: str = "gpt",
    seed: int = 0,
) -> dict[str, Any]:
    devices = _world()
    L.seed_everything(seed, verbose=False)
    strategy = NPUHybridStrategy(**strategy_kwargs)
    model = _make_model(arch, None)
    recorder, probe = LossRecorder(), ParamBytes()
    trainer, data = parity_trainer(
        strategy, model, devices, global_batch, steps, [recorder, probe], ckpt_dir, limit_train_batches
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_in)
    val = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    return {
        "logged": recorder.logged,
        "state": full_state(model),
        "val_loss": float(val),
        "global_step": trainer.global_step,
        "optimizer": type(trainer.strategy.optimizers[0]).__name__,
        "mesh": tuple(trainer.strategy.device_mesh.mesh.shape),
        "fully_sharded": data_parallel.is_fully_sharded(model),
        "placements": {n: str(getattr(p, "placements", None)) for n, p in model.named_parameters()},
        "param_bytes": probe.per_param,
        "param_bytes_total": probe.total,
        "report": str(trainer.strategy.tp_report) if trainer.strategy.tp_report is not None else None,
    }


def _run(config: dict[str, Any]) -> dict[str, Any]:
    if not config.get("expect_error"):
        return train_zero_tp(**config)
    try:
        train_zero_tp(**{k: v for k, v in config.items() if k != "expect_error"})
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {err}"}
    return {"error": None}


def run_many(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_run(c) for c in configs]
