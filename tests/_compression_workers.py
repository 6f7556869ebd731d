"""Module-level workers for the gradient-compression training tests (run in real processes by `launch.spawn`)."""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist

from examples.gpt.data import TextDataModule
from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from lightning_npu.parallel import grad_sync
from tests._gpt_workers import SMALL_GPT

COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
               "all_gather_single")


class Wire:
    """Bytes this rank hands to torch.distributed collectives inside `grad_sync.reduce_bucket` (gradient traffic)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.inside = False

    @contextlib.contextmanager
    def counting(self):
        originals = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
        original_reduce = grad_sync.reduce_bucket

        def wrap(name, fn):
            def counted(*a, **k):
                if self.inside:
                    t = a[0] if name == "all_reduce" else a[1]
                    self.bytes += t.numel() * t.element_size()
                return fn(*a, **k)
            return counted

        def reduce(*a, **k):
            self.inside = True
            try:
                return original_reduce(*a, **k)
            finally:
                self.inside = False

        for n, fn in originals.items():
            setattr(dist, n, wrap(n, fn))
        grad_sync.reduce_bucket = reduce
        try:
            yield
        finally:
            grad_sync.reduce_bucket = original_reduce
            for n, fn in originals.items():
                setattr(dist, n, fn)


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if "train_loss" in trainer.callback_metrics:
            self.losses.append(float(trainer.callback_metrics["train_loss"]))


def run(zero_stage: int, compression: Any, steps: int, accumulate: int = 1, pp: int = 1,
        ckpt_dir: Optional[str] = None, ckpt_in: Optional[str] = None) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    world = dist.get_world_size() if dist.is_initialized() else 2
    strategy = NPUHybridStrategy(zero_stage=zero_stage, gradient_compression=compression,
                                 pipeline_parallel_size=pp, micro_batches=2 if pp > 1 else None,
                                 save_distributed_checkpoint=True)
    model = GPTModule(**{**SMALL_GPT, "warmup_steps": 3})
    losses, wire = Losses(), Wire()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="32-true", max_steps=steps,
                        limit_val_batches=0, logger=False, enable_checkpointing=ckpt_dir is not None, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True,
                        callbacks=[losses] + ([L.pytorch.callbacks.ModelCheckpoint(
                            dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)] if ckpt_dir else []),
                        accumulate_grad_batches=accumulate)
    data = TextDataModule(block_size=SMALL_GPT["block_size"], batch_size=8 // 2, shuffle=False)
    with wire.counting():
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_in)
    compressor = trainer.strategy._grad_sync.compressor
    return {"losses": losses.losses, "bytes": wire.bytes, "world": world,
            "calls": None if compressor is None else dict(compressor.steps)}


def run_many(scenarios: list[dict]) -> list[dict]:
    import os

    out = []
    for s in scenarios:
        os.environ["WORLD_SIZE"] = "2"
        out.append(run(**s))
    return out
