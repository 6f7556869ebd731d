"""A run resumed mid-epoch gets a progress bar that counts from the resumed batch, with a true rate and total.

Lightning skips ``on_train_epoch_start`` when it restarts mid-epoch (the epoch has started, in the checkpoint),
and that hook is where its bars are reset. `TQDMProgressBar` then keeps its "Training" bar of unknown total and
jumps from 0 to the resumed batch in one refresh: ``301/? ... 468 it/s`` (301 batches over the first batch's
time). `RichProgressBar` creates its task at the first batch end, which leaves its speed right (rich skips the
first sample), but its total under ``max_steps`` is the remaining steps, fewer than the batches it already shows
done (``8/4``). The subclasses here do at the first batch of such an epoch what the skipped hook does, with the
count starting at the resumed batch, and any epoch's total counts batches (Lightning's counts the remaining
optimizer steps, short by ``accumulate_grad_batches`` times: ``3/?`` at 2). `ResumedEpochProgress`, a callback the
strategy puts right after Lightning's bar at setup, does that to the user's own bar object (a reference to
``trainer.progress_bar_callback`` taken before fit stays the bar that is drawn).
"""

from __future__ import annotations

from typing import Any, Union

from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf


def resumed_total(trainer: Any, batch_idx: int) -> Union[int, float]:
    """Batches this epoch runs in all, counting the `batch_idx` done before the resume: its length, or fewer where
    ``max_steps`` (optimizer steps, ``accumulate_grad_batches`` batches each) ends it first."""
    total = trainer.num_training_batches
    if trainer.max_steps is not None and trainer.max_steps > 0:
        remaining = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
        total = min(total, batch_idx + max(remaining, 0))
    return total


class ResumedEpochProgress(Callback):
    """Acts on the trainer's Lightning bar (`TQDMProgressBar` or `RichProgressBar`, exactly: a subclass draws as it
    likes): each epoch's total counts batches, and the first batch of an epoch that skipped
    ``on_train_epoch_start`` (a mid-epoch resume) does what that hook does, counting from the resumed batch."""

    def __init__(self) -> None:
        self._epoch_started = False

    @staticmethod
    def _bar(trainer: Any) -> Any:
        bar = trainer.progress_bar_callback
        return bar if type(bar) in (TQDMProgressBar, RichProgressBar) and not bar.is_disabled else None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._epoch_started = False

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._epoch_started = True
        bar = self._bar(trainer)
        total = resumed_total(trainer, 0)  # Lightning's bounds the epoch by optimizer steps (max_epochs=-1)
        if isinstance(bar, TQDMProgressBar) and bar._train_progress_bar is not None:
            bar.train_progress_bar.total = convert_inf(total)
            bar.train_progress_bar.refresh()
        elif isinstance(bar, RichProgressBar) and bar.progress is not None and bar.train_progress_bar_id is not None:
            bar.progress.update(bar.train_progress_bar_id, total=total)
            bar.refresh()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._epoch_started:
            return
        self._epoch_started = True
        bar = self._bar(trainer)
        if isinstance(bar, TQDMProgressBar):
            tqdm_bar = bar.train_progress_bar
            tqdm_bar.reset(total=convert_inf(resumed_total(trainer, batch_idx)))  # the clock starts now
            tqdm_bar.initial = tqdm_bar.n = tqdm_bar.last_print_n = batch_idx
            tqdm_bar.set_description(f"Epoch {trainer.current_epoch}")
        elif isinstance(bar, RichProgressBar) and bar.progress is not None:
            if bar.train_progress_bar_id is None:
                bar._initialize_train_progress_bar_id()
            bar.progress.reset(bar.train_progress_bar_id, total=resumed_total(trainer, batch_idx),
                               completed=batch_idx, description=bar._get_train_description(trainer.current_epoch),
                               visible=True)
            bar.refresh()


def use_resumable_progress_bar(trainer: Any) -> None:
    """`ResumedEpochProgress` right after the trainer's progress bar (before the user's other callbacks, which then
    see the bar's totals), once per trainer; the bar itself is the user's, untouched."""
    callbacks = trainer.callbacks
    if any(isinstance(cb, ResumedEpochProgress) for cb in callbacks):
        return
    bar = trainer.progress_bar_callback
    if bar is None or type(bar) not in (TQDMProgressBar, RichProgressBar):
        return
    index = next(i for i, cb in enumerate(callbacks) if cb is bar)
    callbacks.insert(index + 1, ResumedEpochProgress())
