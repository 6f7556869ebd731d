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
from lightning_npu.callbacks._dist import agree_flag, broadcast
from lightning_npu.parallel.checkpoint import commit as _commit

log = logging.getLogger(__name__)


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
        io = getattr(trainer.strategy, "checkpoint_io", None)
        if isinstance(io, TrackedAsyncCheckpointIO):
            if wait:
                for tmp, _, _, _ in self._pending:
                    io.wait(tmp)
            elif not all(io.done(tmp) for tmp, _, _, _ in self._pending):
                return False
        return not trainer.is_global_zero or all(tmp.exists() for tmp, _, _, _ in self._pending)

    def _collect_requests(self, trainer: Any, wait: bool) -> list[Path]:
        if wait and self._requests:
            finalize = getattr(trainer.strategy, "finalize_checkpoints", None)
            if callable(finalize):
                finalize()  # collective; raises a failed write's error
        # a failed save is raised at a collective point (`wait`: the strategy's finalize agrees on it), never by
        # the one rank that knows first: its peers would wait for it in the next collective
        done = [(f, r) for f, r in self._requests if r.done.is_set() and (wait or r.error is None)]
        finished = {id(r) for _, r in done}
        self._requests = [(f, r) for f, r in self._requests if id(r) not in finished]
        for final, request in done:
            if request.error is not None:
                raise request.error
        return [final for final, _ in done]

    def poll(self, trainer: Any, wait: bool = False) -> list[Path]:
        """Finished saves (committed on rank 0). Collective for temporary-path saves: call on all ranks."""
        committed = self._collect_requests(trainer, wait)
        if not self._pending:
            return committed
        not_done = agree_flag(trainer, not self._local_done(trainer, wait))
        if not_done:
            if wait:
                raise RuntimeError(
                    f"checkpoint write to {self._pending[0][0]} did not produce that path; the strategy's "
                    "save_checkpoint must write exactly the path it is given."
                )
            return committed
        io = getattr(trainer.strategy, "checkpoint_io", None)
        pending, self._pending = self._pending, []
        try:
            for tmp, final, meta, token in pending:
                if isinstance(io, TrackedAsyncCheckpointIO):
                    io.wait(tmp)  # surfaces a failed write
                if trainer.is_global_zero:
                    _commit.commit(tmp, final, token, meta, self.checksum)
                committed.append(final)
        finally:
            for _, _, _, token in pending:
                _commit.release(token)
        trainer.strategy.barrier("lightning_npu.checkpoint_commit")
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
