"""Rank agreement through the strategy, so that the same code serves single-device, "ddp" and "npu_hybrid".

Every decision a callback takes (skip a step, save, stop) must be identical on all ranks: a rank
that skips an optimizer step or a save while its peers do not deadlocks the next collective.
"""

from __future__ import annotations

import builtins
from typing import Any, Callable, Optional, Sequence

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


def rank_zero_refusal(trainer: Any, check: Callable[[], Any]) -> Optional[tuple[str, str]]:
    """Run `check` on global rank 0 only; the OSError it raised as (class name, message), to broadcast.

    A rank that raised alone would leave its peers waiting in the next collective: broadcast the result and
    `raise_refused` it on every rank.
    """
    if not trainer.is_global_zero:
        return None
    try:
        check()
    except OSError as err:
        return type(err).__name__, str(err)
    return None


def raise_refused(refused: Optional[tuple[str, str]]) -> None:
    """Raise, on every rank, the OSError that rank 0 met (see `rank_zero_refusal`)."""
    if refused is not None:
        kind = getattr(builtins, refused[0], OSError)
        raise (kind if isinstance(kind, type) and issubclass(kind, OSError) else OSError)(refused[1])
