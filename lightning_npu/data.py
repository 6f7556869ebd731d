"""Asynchronous data loading: the next batch's host-to-device copy overlaps the current step.

Decoding and augmentation belong in DataLoader workers (``num_workers``, ``persistent_workers``, ``prefetch_factor``,
``pin_memory``): torch already runs them in other processes, ahead of the step. What is left on the training
process is the copy to the device; `DevicePrefetcher` issues it for batch i + 1 on a side stream (`device.side_stream`)
while step i runs, and makes the compute stream wait for it only when batch i + 1 is used. On a device without
streams (CPU) it only moves each batch, inline (a no-op for CPU batches).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from lightning_npu import device as dev


def _to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return type(batch)({k: _to_device(v, device, non_blocking) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device, non_blocking) for v in batch)
    return batch


def _record(batch: Any, stream: Any) -> None:
    """The caching allocator must not reuse a batch's memory before the compute stream is done with it."""
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, dict):
        for v in batch.values():
            _record(v, stream)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            _record(v, stream)


class DevicePrefetcher:
    """Iterate `loader`'s batches already on `device`, the next one copied on a side stream during this step.

    Use pinned host memory (``DataLoader(pin_memory=True)``) so that the copies are truly asynchronous. Works in a
    plain loop or as what a LightningDataModule's ``*_dataloader`` returns (Lightning then finds the batches on the
    device and does not move them again); `len` and attributes are the loader's.
    """

    def __init__(self, loader: Iterable[Any], device: torch.device | str, non_blocking: bool = True) -> None:
        self.loader = loader
        self.device = torch.device(device)
        self.non_blocking = non_blocking

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:  # the loader's batch_size, dataset, sampler, ...
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        stream = dev.side_stream(self.device)
        if stream is None:  # no streams: the copy is inline (nothing at all for CPU batches)
            for batch in self.loader:
                yield _to_device(batch, self.device, False)
            return
        compute = dev.current_stream(self.device)
        iterator = iter(self.loader)

        def copy_next() -> Any:
            try:
                batch = next(iterator)
            except StopIteration:
                return StopIteration
            with dev.stream_context(stream):
                return _to_device(batch, self.device, self.non_blocking)

        upcoming = copy_next()
        while upcoming is not StopIteration:
            compute.wait_stream(stream)  # this batch's copy is done before the step reads it
            batch = upcoming
            _record(batch, compute)
            upcoming = copy_next()  # overlaps the step that runs on `batch`
            yield batch
