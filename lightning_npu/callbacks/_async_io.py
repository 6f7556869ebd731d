"""Asynchronous checkpoint writes that report when each write has finished.

Lightning's `AsyncCheckpointIO` snapshots tensors and writes in a thread, but does not say when a
given write is done; an atomic rename that runs before the write ends would publish half a file.
This subclass keeps one future per path so `DynamicCheckpoint` can commit only finished writes.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Optional

import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


class TrackedAsyncCheckpointIO(AsyncCheckpointIO):
    def __init__(self, checkpoint_io: Any = None) -> None:
        super().__init__(checkpoint_io)
        self._futures: dict[str, Future] = {}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        self._ensure_setup()
        assert self._executor is not None and self.checkpoint_io is not None
        # the copy happens on the training thread: the next optimizer step must not leak into this checkpoint
        checkpoint = apply_to_collection(checkpoint, torch.Tensor, _snapshot)
        self._futures[str(path)] = self._executor.submit(
            self.checkpoint_io.save_checkpoint, checkpoint, path, storage_options=storage_options
        )

    def pending(self, path: Any) -> bool:
        return str(path) in self._futures

    def done(self, path: Any) -> bool:
        fut = self._futures.get(str(path))
        return fut is None or fut.done()

    def error(self, path: Any) -> Optional[BaseException]:
        """Block until the write of `path` ends; its error, returned rather than raised, so that the caller can
        first agree with its peers on it (a rank raising alone leaves them in the next collective)."""
        fut = self._futures.pop(str(path), None)
        return fut.exception() if fut is not None else None

    def wait(self, path: Any) -> None:
        """Block until the write of `path` ends; re-raises the write's error here."""
        err = self.error(path)
        if err is not None:
            raise err

    def teardown(self) -> None:
        for path in list(self._futures):
            self.wait(path)
        super().teardown()
