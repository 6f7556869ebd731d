"""Run under real torchrun: collectives, predict and validate through `npu_hybrid` with dp=2."""

import json
import sys

import lightning as L
import torch

import lightning_npu  # noqa: F401
from examples.gpt.data import TextDataModule
from examples.gpt.model import GPTModule
from tests._gpt_workers import SMALL_GPT


def main(out_path: str) -> None:
    L.seed_everything(0, verbose=False)
    model = GPTModule(**SMALL_GPT)
    data = TextDataModule(block_size=32, batch_size=4, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="npu_hybrid", max_steps=2, limit_val_batches=2,
        limit_predict_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    s = trainer.strategy
    rank = s.global_rank
    gathered = s.all_gather(torch.tensor([float(rank)]))
    summed = s.reduce(torch.tensor(float(rank + 1)), reduce_op="sum")
    mean = s.reduce(torch.tensor(float(rank + 1)))
    from_zero = s.broadcast({"rank": rank})
    s.barrier("after-collectives")
    preds = trainer.predict(model, datamodule=data)
    val = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    result = {
        "rank": rank,
        "world": s.world_size,
        "env": type(s.cluster_environment).__name__,
        "launched_externally": s.cluster_environment.creates_processes_externally,
        "gathered": gathered.flatten().tolist(),
        "summed": float(summed),
        "mean": float(mean),
        "from_zero": from_zero,
        "pred_batches": len(preds),
        "pred_shape": list(preds[0].shape),
        "val_loss": float(val),
        "sampler": s.distributed_sampler_kwargs,
    }
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
