"""Module-level pipeline-parallel training functions that `lightning_npu.launch.spawn` runs in real processes."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch

import lightning_npu  # noqa: F401
from examples.gpt.data import TextDataModule
from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from lightning_npu.parallel.tp_shards import full_tensors
from tests._gpt_workers import SMALL_GPT, LossRecorder, parity_trainer

# 4 blocks: room for pp=2 x 2 virtual stages (interleaved 1F1B)
PP_GPT = {**SMALL_GPT, "n_layer": 4}


class GradNormRecorder(L.Callback):
    """The global gradient norm HybridPrecision computed for clipping (logged as grad_norm), every step."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        norm = trainer.callback_metrics.get("grad_norm")
        if norm is not None:
            self.norms.append(float(norm))


def train_pp(
    devices: int,
    global_batch: int,
    steps: int,
    strategy_kwargs: Optional[dict[str, Any]] = None,
    model_kwargs: Optional[dict[str, Any]] = None,
    ckpt_dir: Optional[str] = None,
    ckpt_in: Optional[str] = None,
    limit_train_batches: Optional[int] = None,
    gradient_clip_val: Optional[float] = None,
    accumulate_grad_batches: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """Train the 4-block GPT example; returns logged losses, the validation loss and this rank's (full) state."""
    L.seed_everything(seed, verbose=False)
    strategy = NPUHybridStrategy(**(strategy_kwargs or {}))
    model = GPTModule(**{**PP_GPT, **(model_kwargs or {})})
    recorder, norms = LossRecorder(), GradNormRecorder()
    trainer, data = parity_trainer(
        strategy, model, devices, global_batch, steps, [recorder, norms], ckpt_dir, limit_train_batches,
        num_sanity_val_steps=0, gradient_clip_val=gradient_clip_val, accumulate_grad_batches=accumulate_grad_batches,
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_in)
    val = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    # predictions for 4 validation samples: through the pipeline (the last stage returns the logits), or directly
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(data.val_set, range(4)), batch_size=4)
    if strategy.parallel_config.pipeline_parallel_size > 1:
        logits = trainer.predict(model, dataloaders=loader)[0]
    else:
        with torch.no_grad():
            logits = model(next(iter(loader))[0])
    state = full_tensors(model, model.state_dict())  # this stage's part, tp shards gathered
    runner = getattr(trainer.strategy, "_pipeline", None)
    return {
        "logged": recorder.logged,
        "local": recorder.local,
        "grad_norms": norms.norms,
        "state": {k: v.detach().clone().cpu() for k, v in state.items()},
        "val_loss": float(val),
        "global_step": trainer.global_step,
        "mesh": tuple(trainer.strategy.device_mesh.mesh.shape),
        "dp_rank": trainer.strategy.device_mesh["dp"].get_local_rank(),
        "stages": runner.local_stages if runner is not None else None,
        "plan": str(trainer.strategy.pipeline_plan) if trainer.strategy.pipeline_plan is not None else None,
        "local_numel": sum(p.numel() for p in model.parameters()),
        "logits": None if logits is None else logits.detach().clone(),
    }


def expect_error(devices: int, strategy_kwargs: dict[str, Any], model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Trainer.fit with a pipeline layout that must be refused: the error and whether a process group existed."""
    import torch.distributed as dist

    model = GPTModule(**{**PP_GPT, **model_kwargs})
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=NPUHybridStrategy(**strategy_kwargs),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    data = TextDataModule(block_size=model.hparams.block_size, batch_size=2, shuffle=False)
    try:
        trainer.fit(model, datamodule=data)
    except Exception as err:  # noqa: BLE001
        return {"type": type(err).__name__, "message": str(err), "pg": dist.is_initialized()}
    return {"type": None, "message": "", "pg": dist.is_initialized()}


def expect_errors(devices: int, cases: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    """`expect_error` for several (strategy_kwargs, model_kwargs) cases in the same processes, in order."""
    return [expect_error(devices, strategy_kwargs, model_kwargs) for strategy_kwargs, model_kwargs in cases]
