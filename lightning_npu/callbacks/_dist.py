"""Rank agreement through the strategy, so that the same code serves single-device, "ddp" and "npu_hybrid".

Every decision a callback takes (skip a step, save, stop) must be identical on all ranks: a rank
that skips an optimizer step or a save while its peers do not deadlocks the next collective.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


def agree_max(trainer: Any, values: Sequence[float]) -> list[float]:
    """Element-wise maximum over all ranks (one collective for the whole vector)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float32, device=trainer.strategy.root_device)
    if trainer.world_size > 1:
        # the whole world explicitly: npu_hybrid's default group for reduce is dp only
        t = trainer.strategy.reduce(t, group=torch.distributed.group.WORLD, reduce_op="max")
    return t.tolist()


def agree_flag(trainer: Any, flag: bool) -> bool:
    """True on every rank as soon as one rank says True."""
    return agree_max(trainer, [1.0 if flag else 0.0])[0] > 0


def broadcast(trainer: Any, obj: Any) -> Any:
    return trainer.strategy.broadcast(obj, src=0) if trainer.world_size > 1 else obj


def find_callback(trainer: Any, cls: type) -> Any:
    for cb in trainer.callbacks:
        if isinstance(cb, cls):
            return cb
    return None
