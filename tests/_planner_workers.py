"""What a rank holds after a training step of the example GPT, measured by `MemoryMonitor`, for the planner's check.

`lightning_npu.callbacks.MemoryMonitor` counts the storages exactly: parameters and optimizer state (moments and fp32
masters, ZeRO-1's slices included) after the step, gradients before it (ZeRO-1's reduced slices included), and the
peak of the activations autograd saves for backward (`torch.autograd.graph.saved_tensors_hooks`). Two steps run and
the second one's figures are kept: on the first, the pipeline's shape inference runs an extra forward.
"""

from __future__ import annotations

from typing import Any

import lightning as L

from examples.gpt.data import TextDataModule
from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from lightning_npu.callbacks import MemoryMonitor

MODEL = dict(vocab_size=256, n_layer=4, n_head=4, n_embd=64, block_size=64, bias=False, dropout=0.0)
PER_DP_BATCH = 4


def measure(layouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Train two steps of the GPT under each layout (in the same 4 processes); each rank's bytes and pp stage."""
    results = []
    for kwargs in layouts:
        L.seed_everything(0, verbose=False)
        monitor = MemoryMonitor()
        trainer = L.Trainer(
            accelerator="cpu", devices=4, strategy=NPUHybridStrategy(**kwargs), max_steps=2, precision="32-true",
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            limit_val_batches=0, callbacks=[monitor],
        )
        trainer.fit(GPTModule(**MODEL), datamodule=TextDataModule(block_size=MODEL["block_size"],
                                                                  batch_size=PER_DP_BATCH, shuffle=False))
        mesh = trainer.strategy.device_mesh
        stage = mesh["pp"].get_local_rank() if "pp" in (mesh.mesh_dim_names or ()) else 0
        last = monitor.last
        results.append({"parameters": last["parameters"], "gradients": last["gradients"],
                        "optimizer": last["optimizer_state"],
                        "activations": last["activations_peak"], "stage": stage})
    return results
