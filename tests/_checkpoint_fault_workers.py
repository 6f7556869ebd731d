"""Module-level workers for tests/test_checkpoint_faults.py, run in 2 real processes (gloo) by `launch.spawn`.

`campaign` runs every multi-process check in one launch (the start-up and imports are most of a tiny run's cost):
a fit continued exactly from a checkpoint saved after `fit()` returned (dp=2 and pp=2 sharded directories, tp=2
and ZeRO-3 single files), a corrupted shard refused with the same error on both ranks, and a save that fails on one
rank raising the same `CheckpointSaveError` on both, at once.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

import lightning_npu  # noqa: F401
from examples.gpt.data import TextDataModule
from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from lightning_npu.callbacks import DynamicCheckpoint
from lightning_npu.parallel.checkpoint import commit
from tests._callbacks_helpers import StepSeeded, trainer_kwargs
from tests._faults import disk_full_at
from tests._gpt_workers import SMALL_GPT
from tests._sampler_workers import Recorder


def _world() -> int:
    # Lightning's environment deletes WORLD_SIZE at teardown; the next Trainer of this process needs it
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    os.environ["WORLD_SIZE"] = str(world)
    return world


def _trainer(root: Path, steps: int, strategy: dict[str, Any], callbacks: list[Any]) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=_world(), strategy=NPUHybridStrategy(**strategy),
                     precision="32-true", max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                     enable_checkpointing=any(isinstance(c, DynamicCheckpoint) for c in callbacks),
                     enable_progress_bar=False, enable_model_summary=False,
                     callbacks=callbacks, deterministic=True, default_root_dir=str(root))


def _fit(root: Path, steps: int, strategy: dict[str, Any], ckpt_in: Optional[str] = None,
         callbacks: tuple = ()) -> tuple[L.Trainer, Recorder]:
    """The small example GPT on shuffled data (the losses follow the samples read), fp32."""
    L.seed_everything(0, verbose=False)
    recorder = Recorder()
    trainer = _trainer(root, steps, strategy, [recorder, *callbacks])
    trainer.fit(GPTModule(**SMALL_GPT), datamodule=TextDataModule(block_size=SMALL_GPT["block_size"], batch_size=2,
                                                                   shuffle=True), ckpt_path=ckpt_in)
    return trainer, recorder


def _error(fn: Any) -> Optional[str]:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def _after_fit(root: Path, name: str, strategy: dict[str, Any], steps: int, stop: int,
               full_callbacks: tuple = ()) -> dict[str, Any]:
    """Losses of `steps` uninterrupted steps vs `stop` steps, ``trainer.save_checkpoint`` after fit returned, and
    a later fit to `steps` from that checkpoint."""
    _, full = _fit(root / f"{name}_full", steps, strategy, callbacks=full_callbacks)
    first, _ = _fit(root / f"{name}_first", stop, strategy)
    after = root / f"{name}_after.ckpt"
    first.save_checkpoint(after)
    _, resumed = _fit(root / f"{name}_resumed", steps, strategy, ckpt_in=str(after))
    return {"full": full.losses, "resumed": resumed.losses, "samples_full": full.samples,
            "samples_resumed": resumed.samples, "is_dir": after.is_dir()}


def _corrupt_copies(ck: Path, out: Path) -> dict[str, str]:
    """Rank 0: copies of the checkpoint folder `ck` (steps 2, 4 and 6, markers included) with step 6 damaged one
    way each; returns kind -> the damaged file."""
    damaged = {}
    for kind in ("flipped", "swapped", "truncated", "deleted"):
        folder = out / kind
        shutil.copytree(ck, folder)
        shard = folder / "step=00000006.ckpt" / "__1_0.distcp"
        if kind == "flipped":
            data = bytearray(shard.read_bytes())
            middle = len(data) // 2
            data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
            shard.write_bytes(bytes(data))
        elif kind == "swapped":  # the same-sized shard of an older step
            older = folder / "step=00000004.ckpt" / "__1_0.distcp"
            assert older.stat().st_size == shard.stat().st_size, "the shards of steps 4 and 6 differ in size"
            shutil.copyfile(older, shard)
        elif kind == "truncated":
            with open(shard, "r+b") as f:
                f.truncate(shard.stat().st_size // 2)
        else:
            shard.unlink()
        damaged[kind] = str(shard)
    return damaged


def _save_failures(root: Path, rank: int) -> dict[str, Any]:
    """A save that fails on one rank only (rank 0's marker: disk full at the commit; rank 1's shard write; rank
    0's meta.pt): every rank must raise the same `CheckpointSaveError`, without waiting out a timeout."""
    out = {}
    real_marker, real_write, real_save = commit._write_json_atomic, FileSystemWriter.write_data, torch.save

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device (injected)")

    def failing_write(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError(28, "No space left on device (injected)")

    def failing_meta(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        if str(f).endswith("meta.pt"):
            raise OSError(28, "No space left on device (injected)")
        return real_save(obj, f, *args, **kwargs)

    for phase, target, patch in (("marker", rank == 0, ("marker", full_disk)),
                                 ("shard", rank == 1, ("write", failing_write)),
                                 ("meta", rank == 0, ("save", failing_meta))):
        if target:
            if patch[0] == "marker":
                commit._write_json_atomic = patch[1]
            elif patch[0] == "write":
                FileSystemWriter.write_data = patch[1]
            else:
                torch.save = patch[1]
        ck = root / f"fail_{phase}"
        dyn = DynamicCheckpoint(dirpath=str(ck), phase_fractions=(), intervals=(2,), keep_last_k=None)
        t0 = time.monotonic()
        try:
            error = _error(lambda: _fit(root / f"fail_{phase}_run", 2, {"save_distributed_checkpoint": True},
                                        callbacks=(dyn,)))
        finally:
            commit._write_json_atomic, FileSystemWriter.write_data, torch.save = real_marker, real_write, real_save
        dist.barrier()
        out[phase] = {"error": error, "seconds": time.monotonic() - t0,
                      "left": sorted(p.name for p in ck.iterdir()) if ck.is_dir() else []}
    return out


class _WriteFinished(L.Callback):
    """At step 3's end, before DynamicCheckpoint's poll (Lightning runs checkpoint callbacks last), wait for this
    rank's part of the step-2 async write: the failed commit is then known, without a race on the clock."""

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step != 3:
            return
        pending = getattr(getattr(trainer.strategy, "_ckpt_writer", None), "_pending", None)
        if pending is not None:  # npu_hybrid's own async writer
            pending[1].wait(60)
        for future in list(getattr(trainer.strategy.checkpoint_io, "_futures", {}).values()):  # DynamicCheckpoint's
            future.exception(60)


def _async_failures(root: Path, rank: int) -> dict[str, Any]:
    """An async save whose commit fails at rank 0's marker (disk full), with npu_hybrid's writer and with
    DynamicCheckpoint(async_save=True) under Lightning's ddp: every rank raises the same `CheckpointSaveError` at
    the first step after the write finished (3), not at the next save or the end of fit (step 8)."""
    out = {}
    for name, strategy, own_async in (("hybrid", NPUHybridStrategy(async_save=True), False), ("ddp", "ddp", True)):
        ck = root / f"async_{name}"
        # one save, at step 2: intervals 2 until step 2, then 100
        dyn = DynamicCheckpoint(dirpath=str(ck), phase_fractions=(0.25,), intervals=(2, 100), keep_last_k=None,
                                save_on_train_end=False, async_save=own_async)
        trainer = L.Trainer(callbacks=[_WriteFinished(), dyn], strategy=strategy,
                            **trainer_kwargs(root / f"async_{name}_run", 8, devices=_world()))
        with disk_full_at(commit, "_write_json_atomic", lambda path, *a: path.name.endswith(".complete"),
                          active=rank == 0):
            error = _error(lambda: trainer.fit(StepSeeded()))
        dist.barrier()
        out[name] = {"error": error, "step": trainer.global_step, "left": sorted(p.name for p in ck.iterdir())}
    return out


def campaign(root: str) -> dict[str, Any]:
    root = Path(root)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    out: dict[str, Any] = {}
    # exact continuation after fit: dp=2, pp=2 (sharded directories), tp=2 and ZeRO-3 (one file); the
    # uninterrupted dp=2 run also saves the checkpoints of steps 2, 4 and 6 (sharded directories) damaged below
    ck = root / "ck"
    saves = DynamicCheckpoint(dirpath=str(ck), phase_fractions=(), intervals=(2,), keep_last_k=None)
    out["after_fit_dp2"] = _after_fit(root, "dp2", {"save_distributed_checkpoint": True}, 6, 3, (saves,))
    out["after_fit_tp2"] = _after_fit(root, "tp2", {"tensor_parallel_size": 2, "save_distributed_checkpoint": False},
                                      5, 2)
    out["after_fit_pp2"] = _after_fit(root, "pp2", {"pipeline_parallel_size": 2, "micro_batches": 2,
                                                    "save_distributed_checkpoint": True}, 4, 2)
    out["after_fit_zero3"] = _after_fit(root, "zero3", {"zero_stage": 3, "save_distributed_checkpoint": False}, 4, 2)
    dist.barrier()
    damaged = _corrupt_copies(ck, root / "damaged") if rank == 0 else None
    damaged = [damaged]
    dist.broadcast_object_list(damaged, src=0)
    damaged = damaged[0]
    # an explicit resume from the flipped checkpoint fails on both ranks with the same error, naming the shard;
    # discovery (here on both ranks) falls back to step 4
    flipped = root / "damaged" / "flipped"
    out["resume_flipped"] = _error(lambda: _fit(root / "resume_bad", 8, {"save_distributed_checkpoint": True},
                                                ckpt_in=str(flipped / "step=00000006.ckpt")))
    out["found"] = {kind: DynamicCheckpoint.find_latest(root / "damaged" / kind) for kind in damaged}
    out["damaged"] = damaged
    out["saved_markers"] = json.loads((ck / "step=00000006.ckpt.complete").read_text())
    out["save_failures"] = _save_failures(root, rank)
    out["async_failures"] = _async_failures(root, rank)
    return out
