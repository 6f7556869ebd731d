"""Module-level functions that `lightning_npu.launch.spawn` runs for the fused-op tests."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

import lightning_npu  # noqa: F401
from examples.gpt.data import TextDataModule
from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy


class _Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"].detach()))


def train_small_gpt(fuse_ops: bool, steps: int = 4) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    strategy = NPUHybridStrategy(fuse_ops=fuse_ops, zero_stage=0)
    model = GPTModule(n_layer=2, n_head=4, n_embd=32, block_size=32, learning_rate=1e-3, bias=True, attention="explicit")
    rec = _Losses()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[rec],
    )
    trainer.fit(model, datamodule=TextDataModule(block_size=32, batch_size=4, shuffle=False))
    report = getattr(strategy, "fusion_report", None)
    return {
        "losses": rec.losses,
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "replaced": [] if report is None else [r.kernel for r in report.replaced],
    }


def dtensor_local_shards() -> dict[str, float]:
    """Fused ops on DTensors sharded over tokens (dim 0) and over the hidden dim (elementwise)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from lightning_npu.ops import functional as fx
    from lightning_npu.ops import reference as ref

    owned = not dist.is_initialized()  # else: one of several checks in a launch (`tests._layouts.run_calls`)
    if owned:
        dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(0)
        x, r, w, b = torch.randn(6, 16), torch.randn(6, 16), torch.randn(16), torch.randn(16)
        out: dict[str, float] = {}
        xd, rd = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(r, mesh, [Shard(0)])
        wd, bd = distribute_tensor(w, mesh, [Replicate()]), distribute_tensor(b, mesh, [Replicate()])
        y, h = fx.add_layer_norm(xd, rd, wd, bd, 1e-5)
        assert isinstance(y, DTensor) and y.placements == (Shard(0),)
        yr, hr = ref.add_layer_norm(x, r, w, b, 1e-5)
        out["ln"] = (y.full_tensor() - yr).abs().max().item() + (h.full_tensor() - hr).abs().max().item()
        # colwise-sharded activations with a Shard(0) bias: elementwise, exact on local shards
        xc, bc = distribute_tensor(x, mesh, [Shard(1)]), distribute_tensor(b, mesh, [Shard(0)])
        g = fx.bias_gelu(xc, bc, "tanh")
        out["gelu"] = (g.full_tensor() - ref.bias_gelu(x, b, "tanh")).abs().max().item()
        # a row op over a sharded hidden dim cannot run locally: must still be correct (eager path)
        y2 = fx.rms_norm(distribute_tensor(x, mesh, [Shard(1)]), wd, 1e-6)
        out["rms_hidden_sharded"] = (y2.full_tensor() - ref.add_rms_norm(x, None, w, 1e-6)[0]).abs().max().item()
        xg = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
        fx.layer_norm(xg, wd, bd).sum().backward()
        xe = x.clone().requires_grad_()
        ref.add_layer_norm(xe, None, w, b, 1e-5)[0].sum().backward()
        out["ln_grad"] = (xg.grad.full_tensor() - xe.grad).abs().max().item()
        return out
    finally:
        if owned:
            dist.destroy_process_group()
