"""Resumable data-parallel sampling: a resume in the middle of an epoch continues where the checkpoint stopped.

Lightning restarts a non-stateful DataLoader at batch 0 of the epoch it resumes in. For LLM pretraining an epoch is
the whole corpus, so every crash would re-train on the epoch's first batches. As Megatron's pretraining sampler does,
the position in the epoch is kept as the number of *global* samples consumed (``consumed_samples``):

- `ResumableDistributedSampler` draws the same global order as ``torch.utils.data.DistributedSampler`` (the same
  seeded permutation per epoch, ``seed + epoch``, the same padding/truncation) and deals it out over the dp ranks
  the same way: global positions ``p, p + dp, p + 2 * dp, ...`` go to dp rank ``p``. A per-rank batch of ``B`` is
  therefore one slice of a global batch of ``B * dp`` read in the global order, and the consumed count does not
  depend on dp: a resume under another dp size (with the batch or accumulation adjusted) reads the same samples.
- `ResumableDataLoader` counts the batches it has *handed out* (not those its workers prefetched) and is stateful
  (``state_dict``/``load_state_dict``), so Lightning's fit loop stores its position with the loop state in the
  checkpoint (``loops.fit_loop.state_dict.combined_loader``) and restores it on resume. The state is plain ints and
  bools, readable with ``torch.load(weights_only=True)``.

`NPUHybridStrategy` turns a plain ``DataLoader`` over a map-style dataset, with the ``DistributedSampler`` Lightning
injects (``use_distributed_sampler=True``, the default), into a `ResumableDataLoader`: nothing changes in the data
order of an uninterrupted run. Other training loaders are left as they are:

- Iterable datasets have no sampler; they must be stateful themselves: a dataset with ``state_dict``/
  ``load_state_dict`` (its position in the stream) inside torchdata's ``StatefulDataLoader``, which saves it (also
  with workers), or a loader of your own with those methods. Lightning checkpoints the loader's state, not the
  dataset's.
- DataLoader subclasses, custom samplers and batch samplers keep Lightning's behaviour (restart at batch 0); make
  them stateful the same way.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler

STATE_VERSION = 1


class ResumableDistributedSampler(Sampler[int]):
    """``DistributedSampler``'s global order and split, able to start an epoch at a consumed global position."""

    def __init__(
        self,
        dataset_size: int,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"ResumableDistributedSampler(rank={rank}): expected 0 <= rank < num_replicas={num_replicas}."
            )
        self.dataset_size = int(dataset_size)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        # (epoch, consumed global samples) to start from, set by a checkpoint; used by the next __iter__ of that epoch
        self._resume: Optional[tuple[int, int]] = None

    @property
    def total_size(self) -> int:
        """Global samples in an epoch: padded (or truncated with drop_last) to a multiple of num_replicas."""
        n, dp = self.dataset_size, self.num_replicas
        return (n // dp) * dp if self.drop_last else math.ceil(n / dp) * dp

    def __len__(self) -> int:
        """This rank's samples in a whole epoch (Lightning's epoch length, also in a resumed epoch)."""
        return self.total_size // self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def global_order(self) -> list[int]:
        """The epoch's global sample order, the one ``DistributedSampler`` draws (padding repeats its start)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_size, generator=g).tolist()
        else:
            order = list(range(self.dataset_size))
        total = self.total_size
        if total > len(order):
            pad = total - len(order)
            order += (order * math.ceil(pad / len(order)))[:pad]
        return order[:total]

    def start_position(self) -> int:
        """The global position the next iteration of this epoch starts at (0 unless a checkpoint said otherwise)."""
        if self._resume is None or self._resume[0] != self.epoch:
            return 0
        return min(self._resume[1], self.total_size)

    def __iter__(self) -> Iterator[int]:
        start = self.start_position()
        self._resume = None  # later epochs (and a re-iteration of this one) start at 0
        return iter(self.global_order()[start + self.rank : self.total_size : self.num_replicas])

    def resume_from(self, epoch: int, consumed_samples: int) -> None:
        self.epoch = int(epoch)
        self._resume = (int(epoch), int(consumed_samples))


class ResumableDataLoader(DataLoader):
    """A DataLoader over a `ResumableDistributedSampler` whose position in the epoch goes into the checkpoint.

    ``len()`` stays the whole epoch's batch count (Lightning's progress counters resume at the saved batch index);
    an iteration after ``load_state_dict`` yields only the batches not consumed yet.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.sampler, ResumableDistributedSampler) or self.batch_size is None:
            raise ValueError(
                "ResumableDataLoader needs `sampler=ResumableDistributedSampler(...)` and an integer `batch_size` "
                f"(got sampler={type(self.sampler).__name__}, batch_size={self.batch_size})."
            )
        self._iter_start: Optional[int] = None  # global position where the running iteration began
        self._iter_epoch: Optional[int] = None  # and its epoch
        self._yielded = 0  # batches handed out by the running iteration

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # a generator: the start is read at the first `next`, after Lightning's set_epoch and load_state_dict
        sampler: ResumableDistributedSampler = self.sampler  # type: ignore[assignment]
        self._iter_start, self._iter_epoch, self._yielded = sampler.start_position(), sampler.epoch, 0
        for batch in super().__iter__():
            self._yielded += 1
            yield batch

    def consumed_samples(self) -> int:
        """Global samples consumed in the current epoch: the same number on every dp rank, whatever dp is."""
        sampler: ResumableDistributedSampler = self.sampler  # type: ignore[assignment]
        if self._iter_start is None or self._iter_epoch != sampler.epoch:
            return sampler.start_position()  # this epoch's iteration has not begun: where it will begin
        per_rank_left = len(range(self._iter_start + sampler.rank, sampler.total_size, sampler.num_replicas))
        taken = min(self._yielded * self.batch_size, per_rank_left)  # the last batch may be short
        return min(self._iter_start + taken * sampler.num_replicas, sampler.total_size)

    def state_dict(self) -> dict[str, Any]:
        sampler: ResumableDistributedSampler = self.sampler  # type: ignore[assignment]
        return {
            "version": STATE_VERSION,
            "epoch": sampler.epoch,
            "consumed_samples": self.consumed_samples(),
            "dataset_size": sampler.dataset_size,
            "shuffle": sampler.shuffle,
            "seed": sampler.seed,
            "global_batch_size": int(self.batch_size) * sampler.num_replicas,  # samples per loader batch, all ranks
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sampler: ResumableDistributedSampler = self.sampler  # type: ignore[assignment]
        if not isinstance(state_dict, dict) or not {"epoch", "consumed_samples"} <= state_dict.keys():
            raise ValueError(
                "ResumableDataLoader.load_state_dict: the checkpoint's train loader state "
                f"{sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__} has no "
                "'epoch'/'consumed_samples'; another kind of loader saved it. Resume with the loader that saved it."
            )
        now = {"dataset_size": sampler.dataset_size, "shuffle": sampler.shuffle, "seed": sampler.seed}
        changed = [f"{k}: {state_dict[k]!r} -> {v!r}" for k, v in now.items() if k in state_dict and state_dict[k] != v]
        if changed:
            warnings.warn(
                "The training data order differs from the checkpoint's (" + ", ".join(changed) + "): resuming at "
                f"global sample {state_dict['consumed_samples']} of a different order. Keep the dataset and the seed "
                "(`seed_everything`) of the run that saved it to continue exactly.",
                stacklevel=2,
            )
        old_global = state_dict.get("global_batch_size")
        new_global = int(self.batch_size) * sampler.num_replicas
        if old_global is not None and new_global > old_global:
            warnings.warn(
                f"The global samples per batch grew from {old_global} to {new_global} (batch_size x dp) on resume: the "
                "sample order is kept, but Lightning counts the resumed epoch's batches in the old unit and may end "
                "the epoch before its last samples. Keep batch_size x dp (use `accumulate_grad_batches` to change "
                "the step size) or resume from an end-of-epoch checkpoint.",
                stacklevel=2,
            )
        self._iter_start, self._iter_epoch, self._yielded = None, None, 0
        sampler.resume_from(int(state_dict["epoch"]), int(state_dict["consumed_samples"]))


def resumable_dataloader(dataloader: object) -> object:
    """`dataloader` as a `ResumableDataLoader` when it is a plain DataLoader with the ``DistributedSampler``
    Lightning injects and an automatic batch sampler; anything else is returned unchanged (see the module doc)."""
    if (
        type(dataloader) is not DataLoader
        or type(dataloader.sampler) is not DistributedSampler
        or type(dataloader.batch_sampler) is not BatchSampler
    ):
        return dataloader
    dist: DistributedSampler = dataloader.sampler
    sampler = ResumableDistributedSampler(
        len(dist.dataset),  # type: ignore[arg-type]
        num_replicas=dist.num_replicas,
        rank=dist.rank,
        shuffle=dist.shuffle,
        seed=dist.seed,
        drop_last=dist.drop_last,
    )
    sampler.set_epoch(dist.epoch)
    kwargs: dict[str, Any] = dict(
        batch_size=dataloader.batch_size,
        sampler=sampler,
        num_workers=dataloader.num_workers,
        collate_fn=dataloader.collate_fn,
        pin_memory=dataloader.pin_memory,
        drop_last=dataloader.drop_last,
        timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn,
        multiprocessing_context=dataloader.multiprocessing_context,
        generator=dataloader.generator,
        prefetch_factor=dataloader.prefetch_factor,
        persistent_workers=dataloader.persistent_workers,
        pin_memory_device=dataloader.pin_memory_device,
    )
    if hasattr(dataloader, "in_order"):
        kwargs["in_order"] = dataloader.in_order
    return ResumableDataLoader(dataloader.dataset, **kwargs)
