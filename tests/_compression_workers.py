"""Module-level workers for the gradient-compression training tests (run in real processes by `launch.spawn`)."""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist

import lightning_npu
from examples.gpt.data import TextDataModule
from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from lightning_npu.parallel.data_parallel import sync as grad_sync
from tests._gpt_workers import SMALL_GPT

COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
               "all_gather_single", "all_to_all_single")


class Wire:
    """Bytes this rank hands to torch.distributed collectives inside `grad_sync.reduce_bucket` (gradient traffic).

    gloo's uncompressed ZeRO-1 buckets reduce-scatter by an all-to-all that hands over only the other ranks' rows,
    (w-1)/w of the bucket; it counts as the bucket it reduces, as a reduce-scatter's input does."""

    def __init__(self) -> None:
        self.bytes = 0
        self.inside = False
        self.groups: set[tuple[int, ...]] = set()  # the global ranks of every group gradient traffic used

    @contextlib.contextmanager
    def counting(self):
        originals = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n)}
        original_reduce = grad_sync.reduce_bucket

        def wrap(name, fn):
            def counted(*a, **k):
                if self.inside:
                    t = a[0] if name == "all_reduce" else a[1]
                    group = k.get("group")
                    nbytes = t.numel() * t.element_size()
                    if name == "all_to_all_single":  # the other ranks' rows of the bucket it reduce-scatters
                        world = dist.get_world_size(group)
                        nbytes = nbytes * world // (world - 1)
                    self.bytes += nbytes
                    self.groups.add(tuple(dist.get_process_group_ranks(group)) if group is not None else ())
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
        ckpt_dir: Optional[str] = None, ckpt_in: Optional[str] = None, tp: int = 1, devices: int = 2) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    world = dist.get_world_size() if dist.is_initialized() else devices
    strategy = NPUHybridStrategy(zero_stage=zero_stage, gradient_compression=compression,
                                 pipeline_parallel_size=pp, micro_batches=2 if pp > 1 else None,
                                 tensor_parallel_size=tp, save_distributed_checkpoint=True)
    model = GPTModule(**{**SMALL_GPT, "warmup_steps": 3})
    losses, wire = Losses(), Wire()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision="32-true", max_steps=steps,
                        limit_val_batches=0, logger=False, enable_checkpointing=ckpt_dir is not None, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True,
                        callbacks=[losses] + ([L.pytorch.callbacks.ModelCheckpoint(
                            dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)] if ckpt_dir else []),
                        accumulate_grad_batches=accumulate)
    data = TextDataModule(block_size=SMALL_GPT["block_size"], batch_size=8 // 2, shuffle=False)
    early: list[int] = []  # per GradientBuckets.finish: buckets already launched (inside the pipeline schedule)
    original_finish = grad_sync.GradientBuckets.finish

    def finish(self):
        early.append((sum(b.launched for b in self.buckets), len(self.buckets)))
        return original_finish(self)

    grad_sync.GradientBuckets.finish = finish
    try:
        with wire.counting():
            trainer.fit(model, datamodule=data, ckpt_path=ckpt_in)
    finally:
        grad_sync.GradientBuckets.finish = original_finish
    compressor = trainer.strategy._grad_sync.compressor
    mesh = trainer.strategy.device_mesh
    return {"losses": losses.losses, "bytes": wire.bytes, "world": world, "groups": wire.groups,
            "dp_ranks": tuple(dist.get_process_group_ranks(mesh["dp"].get_group())), "launched_early": early,
            "numel": {n: p.numel() for n, p in model.named_parameters()},
            "calls": None if compressor is None else dict(compressor.steps),
            "q_factors": None if compressor is None else sorted(compressor.q_factors)}


def run_many(scenarios: list[dict]) -> list[dict]:
    import os

    out = []
    for s in scenarios:
        os.environ["WORLD_SIZE"] = str(s.get("devices", 2))
        out.append(run(**s))
    return out


# ---- a model of two branches, for per-module globs ------------------------------------------------------------
class TwoBranches(L.LightningModule):
    """`text` and `vision` sub-networks whose outputs are added (the gradients of both depend on the same loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.text = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
        self.vision = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))

    def training_step(self, batch, batch_idx):
        x, y, target = batch
        loss = torch.nn.functional.mse_loss(self.text(x) + self.vision(y), target)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 16, generator=g),
                                              torch.randn(64, 8, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4, shuffle=False)


def run_branches(zero_stage: int, compression: Any, steps: int) -> dict[str, Any]:
    """dp=2 training of `TwoBranches`; returns the parameters after `steps`, the gradient bytes and the buckets."""
    L.seed_everything(0, verbose=False)
    strategy = NPUHybridStrategy(zero_stage=zero_stage, gradient_compression=compression)
    model, losses, wire = TwoBranches(), Losses(), Wire()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="32-true", max_steps=steps,
                        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True, callbacks=[losses])
    with wire.counting():
        trainer.fit(model)
    compressor = trainer.strategy._grad_sync.compressor
    params = {n: p.detach().clone() for n, p in lightning_npu.full_state_dict(model).items()}
    return {"losses": losses.losses, "bytes": wire.bytes, "params": params,
            "calls": None if compressor is None else dict(compressor.steps),
            "numel": {b: sum(p.numel() for p in getattr(model, b).parameters()) for b in ("text", "vision")}}


def run_many_branches(scenarios: list[dict]) -> list[dict]:
    return [run_branches(**s) for s in scenarios]


def unmatched_glob_error(compression: Any) -> str:
    """The error `Trainer.fit` raises for a glob that matches no parameter of `TwoBranches` (dp=2)."""
    strategy = NPUHybridStrategy(zero_stage=0, gradient_compression=compression)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(TwoBranches())
    except Exception as err:  # noqa: BLE001  (the test checks the type and the message)
        return f"{type(err).__name__}: {err}"
    return "no error"
