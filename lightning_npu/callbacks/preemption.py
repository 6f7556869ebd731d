"""`PreemptionCheckpoint`: turn SIGTERM/SIGUSR1 into a resumable checkpoint and a clean exit.

Schedulers and spot instances announce preemption with a signal and a grace period. A signal
handler must not touch collectives (Lightning 2.6's own SIGTERM handler broadcasts from inside the
handler, which deadlocks when only some ranks are signalled), so the handler only sets a flag; at
the next step (or validation batch) boundary the flag is all-reduced, every rank saves the same
checkpoint through the atomic path, and training stops normally, so the process exits 0 once the
script returns.

Handlers installed before this callback's (Lightning's SLURM ``SIGUSR1`` auto-requeue, a user's own)
are chained, not replaced: they run after the checkpoint is committed, at that same agreed step
boundary, on every rank, so that e.g. the SLURM job is still requeued. Lightning's own SIGTERM
notifier is the one exception: it broadcasts from inside the signal handler and makes the loop raise
instead of saving, which is what this callback replaces.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback

from lightning_npu.callbacks import _store
from lightning_npu.callbacks._dist import agree_max, broadcast, find_callback, raise_refused, rank_zero_refusal
from lightning_npu.callbacks._saver import AtomicSaver
from lightning_npu.callbacks.dynamic_checkpoint import DynamicCheckpoint
from lightning_npu.validate import check_path, check_writable_dir

log = logging.getLogger(__name__)


# cannot be caught (KILL, STOP), or report a fault in the running code: a handler that only sets a flag
# and returns would re-run the faulting instruction forever
_REFUSED = {"SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTRAP", "SIGSYS"}


def _signal(name: Any) -> signal.Signals:
    try:
        if isinstance(name, bool):
            raise TypeError
        if isinstance(name, signal.Signals):
            sig = name
        else:
            sig = signal.Signals[name] if isinstance(name, str) else signal.Signals(name)
    except (KeyError, ValueError, TypeError):
        raise ValueError(
            f"PreemptionCheckpoint(signals=[..., {name!r}]): not a signal; use names, numbers or signal.Signals, "
            "e.g. signals=('SIGTERM', 'SIGUSR1')."
        ) from None
    if sig.name in _REFUSED:
        raise ValueError(
            f"PreemptionCheckpoint(signals=[..., {name!r}]): {sig.name} cannot announce a preemption (it cannot be "
            "caught, or it reports a crash in the running code); use the scheduler's notice signal, e.g. 'SIGTERM' "
            "or 'SIGUSR1'."
        )
    return sig


def _chainable(handler: Any) -> list[Any]:
    """The callables a previous handler stands for, minus Lightning's SIGTERM notifier (see the module doc)."""
    if handler in (None, signal.SIG_DFL, signal.SIG_IGN) or not callable(handler):
        return []
    inner = getattr(handler, "signal_handlers", None)  # Lightning's _HandlersCompose
    if isinstance(inner, list):
        return [h for sub in inner for h in _chainable(signal.getsignal(sub) if isinstance(sub, int) else sub)]
    name = getattr(getattr(handler, "__func__", None), "__qualname__", "")
    if name in ("_SignalConnector._sigterm_notifier_fn", "_SignalConnector._sigterm_handler_fn"):
        return []
    return [handler]


class PreemptionCheckpoint(Callback):
    """Save on every rank at the next step boundary after a preemption signal, then stop.

    Grace period: the scheduler kills the job a fixed time after its notice (SLURM: ``--signal=USR1@SECONDS``
    before the time limit, and ``KillWait``, 30 s by default, after SIGTERM; Kubernetes:
    ``terminationGracePeriodSeconds``, 30 s by default; spot VMs: about 30 s to 2 min). The checkpoint is
    written at the first training *or validation* batch end after the signal, so the grace period must
    cover one training step or one validation batch plus one checkpoint write; measure the save time
    (``benchmarks/callbacks.py``) and ask the scheduler for that with a margin. A validation that is
    running goes on after the save and training stops when it ends; if the scheduler kills the process
    first, nothing is lost.

    Args:
        signals: the signal, or signals, that announce preemption: names (``"SIGTERM"``), numbers or
            `signal.Signals`. Uncatchable and crash signals (SIGKILL, SIGSTOP, SIGSEGV, ...) are refused.
        dirpath: where to save when there is no `DynamicCheckpoint` (whose directory is used otherwise);
            default ``<default_root_dir>/checkpoints``. Created and checked for writing at setup.
    """

    def __init__(self, signals: Any = ("SIGTERM", "SIGUSR1"), dirpath: Optional[str] = None) -> None:
        if isinstance(signals, (str, int, signal.Signals)):
            signals = (signals,)  # one signal, not the letters of its name
        if not isinstance(signals, (list, tuple, set, frozenset)):
            raise TypeError(
                f"PreemptionCheckpoint(signals={signals!r}): give a signal or a list of signals, "
                "e.g. ('SIGTERM', 'SIGUSR1')."
            )
        self.signals = list(dict.fromkeys(_signal(s) for s in signals))
        if not self.signals:
            raise ValueError("PreemptionCheckpoint(signals=[]): give at least one signal, e.g. ('SIGTERM',).")
        dirpath = check_path("dirpath", dirpath, owner="PreemptionCheckpoint")
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

    def _dirpath(self, trainer: Any) -> Path:
        return self.dirpath or Path(trainer.default_root_dir) / "checkpoints"

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Create the directory and check that it is writable now: the signal comes when it is too late to ask.

        With a `DynamicCheckpoint` its directory is used (and checked at its own setup)."""
        if stage != "fit" or find_callback(trainer, DynamicCheckpoint) is not None:
            return
        refused = rank_zero_refusal(
            trainer, lambda: check_writable_dir("dirpath", self._dirpath(trainer), owner="PreemptionCheckpoint"))
        raise_refused(broadcast(trainer, refused))  # on every rank: a peer must not wait in the next collective

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

    def _check(self, trainer: Any) -> None:
        if self.saved_path is not None:
            return
        signum = int(agree_max(trainer, [float(self.received or 0)])[0])  # every rank learns which signal came
        if signum:
            self._save_and_stop(trainer)
            self._chain(signum)

    def _chain(self, signum: int) -> None:
        """Run the handlers this callback displaced, now that the checkpoint is committed (see the module doc)."""
        for handler in _chainable(self._previous.get(signal.Signals(signum))):
            if handler == self._handler:
                continue
            try:
                handler(signum, None)
            except Exception as err:  # noqa: BLE001 - a failing handler must not cost the committed checkpoint
                log.warning("PreemptionCheckpoint: the previous handler of signal %d failed: %r", signum, err)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._check(trainer)

    def on_validation_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        # a long validation must not outlast the grace period; only inside fit, where the handlers are installed
        # (every rank runs as many validation batches: Lightning's distributed sampler pads the last one)
        if self._previous and not trainer.sanity_checking:
            self._check(trainer)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._check(trainer)
        self._restore()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._restore()

    def _save_and_stop(self, trainer: Any) -> None:
        dyn = find_callback(trainer, DynamicCheckpoint)
        if dyn is not None:
            if dyn.last_checkpoint is not None and dyn._last_saved_step == trainer.global_step:
                path = dyn.last_checkpoint
            else:
                path = dyn.save(trainer, reason="preemption")
            dyn.flush(trainer)
        else:
            dirpath = Path(broadcast(trainer, str(self._dirpath(trainer))))
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
