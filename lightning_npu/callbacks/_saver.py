"""Save through `trainer.save_checkpoint` into a temporary path, then commit it on rank 0.

Saving always goes through the Trainer so that whatever the strategy writes (one file, or a
sharded directory from every rank) is what gets committed; only the rename and the marker are ours.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from lightning_npu.callbacks import _store
from lightning_npu.callbacks._async_io import TrackedAsyncCheckpointIO
from lightning_npu.callbacks._dist import agree_flag, broadcast

log = logging.getLogger(__name__)


class AtomicSaver:
    def __init__(self, checksum: bool = False) -> None:
        self.checksum = checksum
        self._pending: list[tuple[Path, Path, dict[str, Any]]] = []

    def save(self, trainer: Any, final: Path, meta: dict[str, Any]) -> Path:
        if self._pending:  # one write in flight at a time, like the strategies' own async writers
            self.poll(trainer, wait=True)
        token = broadcast(trainer, _store.new_token())
        tmp = _store.temp_path(final, token)
        trainer.save_checkpoint(str(tmp))
        self._pending.append((tmp, final, meta))
        if not self._async(trainer):
            self.poll(trainer, wait=True)
        return final

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    @staticmethod
    def _async(trainer: Any) -> bool:
        """Writes may outlive `save_checkpoint`: our async IO, or a strategy with its own async writer
        (one that exposes ``finalize_checkpoints()``, e.g. npu_hybrid's DCP writer with ``async_save=True``)."""
        io = getattr(trainer.strategy, "checkpoint_io", None)
        return isinstance(io, TrackedAsyncCheckpointIO) or bool(getattr(trainer.strategy, "async_save", False))

    def _local_done(self, trainer: Any, wait: bool) -> bool:
        io = getattr(trainer.strategy, "checkpoint_io", None)
        if wait:
            finalize = getattr(trainer.strategy, "finalize_checkpoints", None)
            if callable(finalize):
                finalize()  # collective; poll() runs on every rank
        if isinstance(io, TrackedAsyncCheckpointIO):
            if wait:
                for tmp, _, _ in self._pending:
                    io.wait(tmp)
            elif not all(io.done(tmp) for tmp, _, _ in self._pending):
                return False
        # the strategy's writer renames into our temporary path when its write is complete (rank 0)
        return not trainer.is_global_zero or all(tmp.exists() for tmp, _, _ in self._pending)

    def poll(self, trainer: Any, wait: bool = False) -> list[Path]:
        """Commit the writes that have finished on every rank (collective: call on all ranks)."""
        if not self._pending:
            return []
        not_done = agree_flag(trainer, not self._local_done(trainer, wait))
        if not_done:
            if wait:
                raise RuntimeError(
                    f"checkpoint write to {self._pending[0][0]} did not produce that path; the strategy's "
                    "save_checkpoint must write exactly the path it is given."
                )
            return []
        io = getattr(trainer.strategy, "checkpoint_io", None)
        committed = []
        for tmp, final, meta in self._pending:
            if isinstance(io, TrackedAsyncCheckpointIO):
                io.wait(tmp)  # surfaces a failed write
            if trainer.is_global_zero:
                _store.commit(tmp, final, meta, self.checksum)
            committed.append(final)
        self._pending.clear()
        trainer.strategy.barrier("lightning_npu.checkpoint_commit")
        return committed

    def abandon(self, trainer: Any) -> Optional[list[Path]]:
        """After an exception no collective is safe: finish local writes; commit only when alone."""
        if not self._pending:
            return None
        io = getattr(trainer.strategy, "checkpoint_io", None)
        committed = []
        for tmp, final, meta in self._pending:
            try:
                if isinstance(io, TrackedAsyncCheckpointIO):
                    io.wait(tmp)
                if trainer.world_size == 1:
                    _store.commit(tmp, final, meta, self.checksum)
                    committed.append(final)
            except Exception as err:  # the run is failing already; keep its first error
                log.warning("checkpoint %s was not committed: %s", final, err)
        self._pending.clear()
        return committed
