"""The pipeline tests' model and workers that `lightning_npu.launch.spawn` runs in real processes."""

from __future__ import annotations

from typing import Any

import lightning as L

from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from tests._gpt_workers import SMALL_GPT, parity_trainer

# 4 blocks: room for pp=2 x 2 virtual stages (interleaved 1F1B)
PP_GPT = {**SMALL_GPT, "n_layer": 4}


class GradNormRecorder(L.Callback):
    """The global gradient norm HybridPrecision computed for clipping (logged as npu/grad_norm), every step."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        norm = trainer.callback_metrics.get("npu/grad_norm")
        if norm is not None:
            self.norms.append(float(norm))


def expect_error(devices: int, strategy_kwargs: dict[str, Any], model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Trainer.fit with a pipeline layout that must be refused: the error and whether a process group existed."""
    import torch.distributed as dist

    model = GPTModule(**{**PP_GPT, **model_kwargs})
    strategy = NPUHybridStrategy(**strategy_kwargs)
    cfg = strategy.parallel_config  # a per-rank batch of 2
    global_batch = 2 * (devices // cfg.tensor_parallel_size // cfg.pipeline_parallel_size)
    trainer, data = parity_trainer(strategy, model, devices, global_batch, 1, [], num_sanity_val_steps=0)
    try:
        trainer.fit(model, datamodule=data)
    except Exception as err:  # noqa: BLE001
        return {"type": type(err).__name__, "message": str(err), "pg": dist.is_initialized()}
    return {"type": None, "message": "", "pg": dist.is_initialized()}


def expect_errors(devices: int, cases: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    """`expect_error` for several (strategy_kwargs, model_kwargs) cases in the same processes, in order."""
    return [expect_error(devices, strategy_kwargs, model_kwargs) for strategy_kwargs, model_kwargs in cases]
