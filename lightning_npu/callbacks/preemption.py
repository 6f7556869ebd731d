"""`PreemptionCheckpoint`: turn SIGTERM/SIGUSR1 into a resumable checkpoint and a clean exit.

Schedulers and spot instances announce preemption with a signal and a grace period. A signal
handler must not touch collectives (Lightning 2.6's own SIGTERM handler broadcasts from inside the
handler, which deadlocks when only some ranks are signalled), so the handler only sets a flag; at
the next step boundary the flag is all-reduced, every rank saves the same checkpoint through the
atomic path, and training stops normally, so the process exits 0 once the script returns.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning.pytorch.callbacks import Callback

from lightning_npu.callbacks import _store
from lightning_npu.callbacks._dist import agree_flag, broadcast, find_callback
from lightning_npu.callbacks._saver import AtomicSaver

log = logging.getLogger(__name__)


def _signal(name: Any) -> signal.Signals:
    if isinstance(name, signal.Signals):
        return name
    try:
        return signal.Signals[name] if isinstance(name, str) else signal.Signals(name)
    except (KeyError, ValueError):
        raise ValueError(f"PreemptionCheckpoint(signals=[..., {name!r}]): not a signal name; use e.g. 'SIGTERM', 'SIGUSR1'.")


class PreemptionCheckpoint(Callback):
    """Save on every rank at the next step boundary after a preemption signal, then stop.

    Args:
        signals: signals that announce preemption.
        dirpath: where to save when there is no `DynamicCheckpoint` (whose directory is used otherwise).
    """

    def __init__(self, signals: Sequence[Any] = ("SIGTERM", "SIGUSR1"), dirpath: Optional[str] = None) -> None:
        self.signals = [_signal(s) for s in signals]
        if not self.signals:
            raise ValueError("PreemptionCheckpoint(signals=[]): give at least one signal, e.g. ('SIGTERM',).")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.received: Optional[int] = None
        self.saved_path: Optional[Path] = None
        self._previous: dict[signal.Signals, Any] = {}
        self._saver = AtomicSaver()
        self._trainer: Any = None

    def _handler(self, signum: int, frame: Any) -> None:
        first = self.received is None
        self.received = signum
        launcher = getattr(self._trainer.strategy, "launcher", None) if self._trainer is not None else None
        if first and launcher is not None and getattr(launcher, "procs", None):
            launcher.kill(signum)  # Lightning's own subprocess launcher: pass the notice on to its children

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # after Lightning registered its handlers (they are restored by the Trainer at teardown)
        self.received, self.saved_path, self._trainer = None, None, trainer
        if threading.current_thread() is not threading.main_thread():
            log.warning("PreemptionCheckpoint: not on the main thread, signals cannot be handled here.")
            return
        for sig in self.signals:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handler)

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            if signal.getsignal(sig) == self._handler and handler is not None:
                signal.signal(sig, handler)
        self._previous.clear()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.saved_path is None and agree_flag(trainer, self.received is not None):
            self._save_and_stop(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.saved_path is None and agree_flag(trainer, self.received is not None):
            self._save_and_stop(trainer)
        self._restore()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._restore()

    def _save_and_stop(self, trainer: Any) -> None:
        from lightning_npu.callbacks.dynamic_checkpoint import DynamicCheckpoint

        dyn = find_callback(trainer, DynamicCheckpoint)
        if dyn is not None:
            if dyn.last_checkpoint is not None and dyn._last_saved_step == trainer.global_step:
                path = dyn.last_checkpoint
            else:
                path = dyn.save(trainer, reason="preemption")
            dyn.flush(trainer)
        else:
            dirpath = self.dirpath or Path(trainer.default_root_dir) / "checkpoints"
            dirpath = Path(broadcast(trainer, str(dirpath)))
            if trainer.is_global_zero:
                dirpath.mkdir(parents=True, exist_ok=True)
            path = dirpath / _store.checkpoint_name(trainer.global_step)
            self._saver.save(trainer, path, {"step": trainer.global_step, "epoch": trainer.current_epoch,
                                             "reason": "preemption", "world_size": trainer.world_size})
        self.saved_path = Path(path)
        trainer.should_stop = True
        if trainer.is_global_zero:
            log.warning("PreemptionCheckpoint: signal %s: saved %s at step %d; stopping.",
                        self.received, path, trainer.global_step)
