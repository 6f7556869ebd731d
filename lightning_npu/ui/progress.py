"""A run resumed mid-epoch gets a progress bar that counts from the resumed batch, with a true rate and total.

Lightning skips ``on_train_epoch_start`` when it restarts mid-epoch (the epoch has started, in the checkpoint),
and that hook is where its bars are reset. `TQDMProgressBar` then keeps its "Training" bar of unknown total and
jumps from 0 to the resumed batch in one refresh: ``301/? ... 468 it/s`` (301 batches over the first batch's
time). `RichProgressBar` creates its task at the first batch end, which leaves its speed right (rich skips the
first sample), but its total under ``max_steps`` is the remaining steps, fewer than the batches it already shows
done (``8/4``). The subclasses here do at the first batch of such an epoch what the skipped hook does, with the
count starting at the resumed batch, and any epoch's total counts batches (Lightning's counts the remaining
optimizer steps, short by ``accumulate_grad_batches`` times: ``3/?`` at 2). The strategy puts them in place of
Lightning's own bars at setup.
"""

from __future__ import annotations

from typing import Any, Union

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf


def resumed_total(trainer: Any, batch_idx: int) -> Union[int, float]:
    """Batches this epoch runs in all, counting the `batch_idx` done before the resume: its length, or fewer where
    ``max_steps`` (optimizer steps, ``accumulate_grad_batches`` batches each) ends it first."""
    total = trainer.num_training_batches
    if trainer.max_steps is not None and trainer.max_steps > 0:
        remaining = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
        total = min(total, batch_idx + max(remaining, 0))
    return total


class _ResumedEpoch:
    """Notes whether the current training epoch ran ``on_train_epoch_start``; the first batch of one that did not
    (a mid-epoch resume) calls `_start_resumed_epoch`."""

    _epoch_started = False

    @property
    def total_train_batches(self) -> Union[int, float]:
        # Lightning's bounds the epoch by the remaining optimizer steps, not batches, and only with max_epochs=-1
        return resumed_total(self.trainer, 0)  # type: ignore[attr-defined]

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._epoch_started = False
        super().on_train_start(trainer, pl_module)  # type: ignore[misc]

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._epoch_started = True
        super().on_train_epoch_start(trainer, pl_module)  # type: ignore[misc]

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if not self._epoch_started:
            self._epoch_started = True
            if not self.is_disabled:  # type: ignore[attr-defined]
                self._start_resumed_epoch(trainer, batch_idx)
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)  # type: ignore[misc]

    def _start_resumed_epoch(self, trainer: Any, batch_idx: int) -> None:
        raise NotImplementedError


class ResumableTQDMProgressBar(_ResumedEpoch, TQDMProgressBar):
    """`TQDMProgressBar` whose bar, resumed mid-epoch, starts at the resumed batch (tqdm's rate counts from
    ``initial``) with the epoch's total."""

    def _start_resumed_epoch(self, trainer: Any, batch_idx: int) -> None:
        bar = self.train_progress_bar
        bar.reset(total=convert_inf(resumed_total(trainer, batch_idx)))  # the clock starts now
        bar.initial = bar.n = bar.last_print_n = batch_idx
        bar.set_description(f"Epoch {trainer.current_epoch}")


class ResumableRichProgressBar(_ResumedEpoch, RichProgressBar):
    """`RichProgressBar` whose task, resumed mid-epoch, starts at the resumed batch with the epoch's total."""

    def _start_resumed_epoch(self, trainer: Any, batch_idx: int) -> None:
        if self.progress is None:
            return
        if self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self.progress.reset(self.train_progress_bar_id, total=resumed_total(trainer, batch_idx), completed=batch_idx,
                            description=self._get_train_description(trainer.current_epoch), visible=True)
        self.refresh()


def use_resumable_progress_bar(trainer: Any) -> None:
    """Put the subclasses in place of Lightning's own bar (its default, or a user's), same options and state."""
    for i, cb in enumerate(trainer.callbacks):
        if type(cb) is TQDMProgressBar:
            new: Any = ResumableTQDMProgressBar(cb.refresh_rate, cb.process_position, cb._leave)
        elif type(cb) is RichProgressBar:
            new = ResumableRichProgressBar(cb.refresh_rate, cb._leave, cb.theme, cb._console_kwargs)
        else:
            continue
        new.setup(trainer, trainer.lightning_module, trainer.state.fn)  # Lightning ran the old one's already
        if cb.is_disabled:
            new.disable()
        trainer.callbacks[i] = new
        return
