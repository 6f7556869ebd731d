"""Save through `trainer.save_checkpoint` and have it committed once, with a marker, sync or async.

Saving always goes through the Trainer, so whatever the strategy writes (one file, or a sharded
directory from every rank) is what gets committed, by `lightning_npu.parallel.checkpoint.commit`:

* a strategy that commits its own writes (``accepts_commit_request``, i.e. npu_hybrid) gets a
  `CommitRequest` with the marker as ``storage_options``; rank 0 commits as soon as every rank's
  write finished (for async saves, from the write's completion callback), so nothing here waits;
* any other strategy writes to a temporary path that rank 0 commits once every rank's write finished.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from lightning_npu.callbacks import _store
from lightning_npu.callbacks._async_io import TrackedAsyncCheckpointIO
from lightning_npu.callbacks._dist import agree_flag, agree_max, broadcast
from lightning_npu.parallel.checkpoint import commit as _commit
from lightning_npu.parallel.checkpoint.errors import CheckpointSaveError

log = logging.getLogger(__name__)


def _agree_on_error(trainer: Any, message: Optional[str]) -> Optional[str]:
    """The message of the lowest rank that has one, on every rank (None on every rank if none has). Collective."""
    if trainer.world_size == 1:
        return message
    first = int(-agree_max(trainer, [-float(trainer.global_rank if message is not None else trainer.world_size)])[0])
    return None if first >= trainer.world_size else trainer.strategy.broadcast(message, src=first)


class AtomicSaver:
    def __init__(self, checksum: bool = True) -> None:
        self.checksum = checksum
        # (tmp, final, meta, token) written to a temporary path; or requests the strategy commits itself
        self._pending: list[tuple[Path, Path, dict[str, Any], str]] = []
        self._requests: list[tuple[Path, _commit.CommitRequest]] = []

    def save(self, trainer: Any, final: Path, meta: dict[str, Any]) -> Path:
        meta = {**meta}
        meta.setdefault("run", None)  # DynamicCheckpoint stamps its run id, so pruning stays within the run
        if getattr(trainer.strategy, "accepts_commit_request", False):
            request = _commit.CommitRequest(marker=meta, checksum=self.checksum)
            trainer.save_checkpoint(str(final), weights_only=False, storage_options=request)
            self._requests.append((final, request))
            return final
        if self._pending:  # one write in flight at a time, like the strategies' own async writers
            self.poll(trainer, wait=True)
        token = broadcast(trainer, _store.new_token())
        _commit.hold(token, final)
        tmp = _store.temp_path(final, token)
        trainer.save_checkpoint(str(tmp), weights_only=False)
        self._pending.append((tmp, final, meta, token))
        if not self._async(trainer):
            self.poll(trainer, wait=True)
        return final

    @property
    def has_pending(self) -> bool:
        return bool(self._pending) or any(not r.done.is_set() for _, r in self._requests)

    @staticmethod
    def _async(trainer: Any) -> bool:
        io = getattr(trainer.strategy, "checkpoint_io", None)
        return isinstance(io, TrackedAsyncCheckpointIO)

    def _local_done(self, trainer: Any, wait: bool) -> bool:
        """This rank's writes to temporary paths are finished (`wait`: they will be; the commit then blocks for
        them, and a path never written is the commit's error). Never raises: errors are agreed on first."""
        if wait:
            return True
        io = getattr(trainer.strategy, "checkpoint_io", None)
        if isinstance(io, TrackedAsyncCheckpointIO) and not all(io.done(tmp) for tmp, _, _, _ in self._pending):
            return False
        return not trainer.is_global_zero or all(tmp.exists() for tmp, _, _, _ in self._pending)

    def _collect_requests(self, trainer: Any, wait: bool) -> list[Path]:
        """Saves the strategy commits itself. A failed one is raised on every rank at the first poll after it
        failed, not at the next save: while one is in flight, each poll agrees (one small all-reduce) on whether
        any rank's failed or is still busy; the list stays the same on every rank, so each poll's collectives
        match."""
        if not self._requests:
            return []
        finalize = getattr(trainer.strategy, "finalize_checkpoints", None)
        if not wait:
            failed = any(r.done.is_set() and r.error is not None for _, r in self._requests)
            busy = any(not r.done.is_set() for _, r in self._requests)
            if busy or failed or getattr(trainer.strategy, "async_save", False):  # sync saves: done on every rank
                failed, busy = (v > 0 for v in agree_max(trainer, [float(failed), float(busy)]))
            if busy and not failed:
                return []
        done, self._requests = self._requests, []
        if callable(finalize):
            finalize()  # collective: waits for a write in flight; raises rank 0's error (the commit's) on every rank
        else:  # (no strategy accepting requests lacks it; one that did would raise where the error is)
            for _, request in done:
                request.done.wait()
                if request.error is not None:
                    raise request.error
        return [final for final, _ in done]

    def poll(self, trainer: Any, wait: bool = False) -> list[Path]:
        """Finished saves (committed on rank 0). Collective: call on all ranks. A failed write or commit raises
        the same `CheckpointSaveError` on every rank, and leaves no temporary behind."""
        committed = self._collect_requests(trainer, wait)
        if not self._pending:
            return committed
        not_done = agree_flag(trainer, not self._local_done(trainer, wait))
        if not_done:
            return committed
        io = getattr(trainer.strategy, "checkpoint_io", None)
        pending, self._pending = self._pending, []
        problem: Optional[str] = None
        try:
            for tmp, final, meta, token in pending:
                err = io.error(tmp) if isinstance(io, TrackedAsyncCheckpointIO) else None
                try:
                    if err is None and trainer.is_global_zero:
                        _commit.commit(tmp, final, token, meta, self.checksum)
                except Exception as commit_err:  # e.g. disk full at the marker: the previous state is put back
                    err = commit_err
                if err is None:
                    committed.append(final)
                    continue
                if trainer.is_global_zero:
                    _commit.remove_path(tmp)
                problem = problem or (f"Saving the checkpoint {str(final)!r} failed on rank {trainer.global_rank}: "
                                      f"{err!r}. Nothing was committed; a previous checkpoint at that path is kept.")
        finally:
            for _, _, _, token in pending:
                _commit.release(token)
        # the agreement is also the barrier after rank 0's commits
        problem = _agree_on_error(trainer, problem)
        if problem is not None:
            raise CheckpointSaveError(problem)
        return committed

    def abandon(self, trainer: Any) -> Optional[list[Path]]:
        """After an exception no collective is safe. Saves the strategy commits itself are committed by rank 0
        when their write finishes, whatever happens here. A temporary path is committed when its write is known
        complete without asking the peers: one process, or a single file (Lightning's IO writes those on rank 0
        only); otherwise it is left for the next run's cleanup."""
        self._requests.clear()
        if not self._pending:
            return None
        io = getattr(trainer.strategy, "checkpoint_io", None)
        committed = []
        for tmp, final, meta, token in self._pending:
            try:
                if isinstance(io, TrackedAsyncCheckpointIO):
                    io.wait(tmp)
                if trainer.is_global_zero and (trainer.world_size == 1 or tmp.is_file()):
                    _commit.commit(tmp, final, token, meta, self.checksum)
                    committed.append(final)
            except Exception as err:  # the run is failing already; keep its first error
                log.warning("checkpoint %s was not committed: %s", final, err)
            finally:
                _commit.release(token)
        self._pending.clear()
        return committed
