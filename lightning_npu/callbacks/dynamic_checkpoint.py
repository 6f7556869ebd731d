"""`DynamicCheckpoint`: checkpoint often while a run is young and fragile, rarely once it is stable.

Early steps are the cheapest to lose but the likeliest to fail (bad configs, divergence), late
steps the reverse, and large checkpoints cost minutes each; a phase-dependent interval spends the
save time where a restart would otherwise cost the most. Saves go through `trainer.save_checkpoint`
and are committed once, atomically, by `lightning_npu.parallel.checkpoint.commit` (see `_saver`), so sharded
strategy checkpoints are committed the same way. Each marker carries the run's id: a new run in a
reused directory prunes only its own checkpoints, and a resumed run adopts the id it resumes.

It is a `ModelCheckpoint` (with every saving hook of its own), because Lightning asks only ModelCheckpoints
where ``ckpt_path="last"`` is: so ``fit(ckpt_path="last")`` resumes from the newest complete checkpoint, and
``trainer.checkpoint_callback.best_model_path`` / ``last_model_path`` / ``filename`` mean what they mean there.
"""

from __future__ import annotations

import logging
import math
import os
import re
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence
from weakref import proxy

from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_npu.callbacks import _store
from lightning_npu.callbacks._async_io import TrackedAsyncCheckpointIO
from lightning_npu.callbacks._dist import broadcast, raise_refused, rank_zero_refusal
from lightning_npu.callbacks._saver import AtomicSaver
from lightning_npu.validate import check_bool, check_int, check_numbers, check_path, check_writable_dir

log = logging.getLogger(__name__)
_OWNER = "DynamicCheckpoint"
DEFAULT_FILENAME = "{step:08d}"  # ModelCheckpoint inserts the metric's name: step=00000500.ckpt


def _validate_schedule(phase_fractions: Sequence[float], intervals: Sequence[int]) -> None:
    fractions = list(phase_fractions)
    if any(not (0.0 < f < 1.0) for f in fractions) or fractions != sorted(set(fractions)):
        raise ValueError(
            f"DynamicCheckpoint(phase_fractions={fractions!r}): fractions of max_steps must be strictly increasing "
            "and inside (0, 1), e.g. phase_fractions=(0.1, 0.8)."
        )
    if len(intervals) != len(fractions) + 1:
        raise ValueError(
            f"DynamicCheckpoint(intervals={list(intervals)!r}): give one interval per phase, i.e. "
            f"len(phase_fractions) + 1 = {len(fractions) + 1} intervals, e.g. intervals=(500, 2000, 5000)."
        )
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 1 for i in intervals):
        raise ValueError(f"DynamicCheckpoint(intervals={list(intervals)!r}): intervals must be positive integers (steps).")


class DynamicCheckpoint(ModelCheckpoint):
    """Phase-dependent, atomic, rotating checkpoints; resume with ``fit(ckpt_path="last")`` (``--ckpt_path last``).

    Lightning's ``ckpt_path="last"`` resolves to the newest complete, verified checkpoint of `dirpath`
    (``DynamicCheckpoint.find_latest(dirpath)``; no ``last.ckpt`` file is needed). As with a ``ModelCheckpoint``
    without ``monitor``, ``best_model_path`` and ``last_model_path`` are the newest checkpoint saved.

    Args:
        dirpath: where checkpoints go; default ``<default_root_dir>/checkpoints``. Created at setup, where a
            directory this process cannot write fails at once (not at the first save).
        phase_fractions: phase boundaries as fractions of ``max_steps`` (or of the estimated total steps).
        intervals: save interval in optimizer steps for each phase (one more than ``phase_fractions``).
        save_on_train_end: also save the final state.
        keep_last_k: complete checkpoints kept on disk (``None`` keeps all).
        async_save: write in a background thread (wraps the strategy's checkpoint IO); the commit
            happens at the first step boundary after every rank's write finished. With npu_hybrid use
            ``NPUHybridStrategy(async_save=True)`` instead: its checkpoints are committed as soon as written.
        checksum: record a CRC32 of every file (besides its size), verified by discovery and by every load.
            npu_hybrid computes the shards' CRC32s while writing them; other strategies' files are read once more
            at the commit. ``LIGHTNING_NPU_CHECKSUM=0`` turns CRC32s off everywhere (sizes stay).
        filename: ModelCheckpoint's name template (without ``.ckpt``), default ``"{step:08d}"``, which names
            ``step=00000500.ckpt``; the metrics it may name are ``step`` and ``epoch``.
    """

    def __init__(
        self,
        dirpath: Optional[str] = None,
        phase_fractions: Sequence[float] = (0.1, 0.8),
        intervals: Sequence[int] = (500, 2000, 5000),
        save_on_train_end: bool = True,
        keep_last_k: Optional[int] = 3,
        async_save: bool = False,
        checksum: bool = True,
        filename: Optional[str] = None,
    ) -> None:
        o = _OWNER
        phase_fractions = check_numbers("phase_fractions", phase_fractions, example="(0.1, 0.8)", owner=o)
        intervals = check_numbers("intervals", intervals, example="(500, 2000, 5000)", owner=o)
        _validate_schedule(phase_fractions, intervals)
        check_int("keep_last_k", keep_last_k, minimum=1, example=3, allow_none=True, owner=o)
        dirpath = check_path("dirpath", dirpath, owner=o)
        for flag, value in (("save_on_train_end", save_on_train_end), ("async_save", async_save),
                            ("checksum", checksum)):
            check_bool(flag, value, owner=o)
        if filename is not None and (not isinstance(filename, str) or not filename or "/" in filename):
            raise ValueError(f"DynamicCheckpoint(filename={filename!r}): give a name template without a folder, "
                             "e.g. filename='{epoch}-{step}' (the folder is dirpath=...).")
        super().__init__(dirpath=None, filename=filename or DEFAULT_FILENAME, save_top_k=1)
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.phase_fractions = tuple(float(f) for f in phase_fractions)
        self.intervals = tuple(intervals)
        self.save_on_train_end = save_on_train_end
        self.keep_last_k = keep_last_k
        self.async_save = async_save
        self._saver = AtomicSaver(checksum=checksum)
        self._last_saved_step = -1
        self.last_checkpoint: Optional[Path] = None
        self.run_id: Optional[str] = None  # set at setup, or adopted from the checkpoint a run resumes

    # ---- schedule -----------------------------------------------------------------------
    def interval_at(self, step: int, total_steps: float) -> int:
        """Save interval for the phase that `step` (completed optimizer steps) falls in."""
        if not math.isfinite(total_steps) or total_steps <= 0:
            return self.intervals[0]
        for fraction, interval in zip(self.phase_fractions, self.intervals):
            if step <= fraction * total_steps:
                return interval
        return self.intervals[-1]

    def should_save(self, step: int, total_steps: float) -> bool:
        return step > 0 and step % self.interval_at(step, total_steps) == 0

    def schedule(self, max_steps: int) -> list[int]:
        """Exactly the steps that save for a run of `max_steps` optimizer steps (train end included)."""
        steps = [s for s in range(1, max_steps + 1) if self.should_save(s, max_steps)]
        if self.save_on_train_end and (not steps or steps[-1] != max_steps):
            steps.append(max_steps)
        return steps

    @staticmethod
    def _total_steps(trainer: Any) -> float:
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return float(trainer.max_steps)
        return float(trainer.estimated_stepping_batches)

    # ---- discovery ----------------------------------------------------------------------
    @staticmethod
    def find_latest(dirpath: str | os.PathLike, exclude: Sequence[Any] = ()) -> Optional[str]:
        """Newest complete, verified checkpoint in `dirpath` (file or directory), or None."""
        found = _store.latest_complete(dirpath, exclude=exclude, warn=rank_zero_warn)
        return str(found) if found is not None else None

    def latest(self) -> Optional[str]:
        return self.find_latest(self.dirpath) if self.dirpath is not None else None

    # ---- Lightning's ModelCheckpoint conventions ---------------------------------------------
    @property
    def state_key(self) -> str:
        # not ModelCheckpoint's (made of monitor, mode...): the callback state of earlier checkpoints still loads
        return self.__class__.__qualname__

    def _resolved_dir(self, trainer: Any) -> Path:
        # the default that setup resolves; `ckpt_path="last"` is parsed before setup runs
        return self.dirpath if self.dirpath is not None else Path(trainer.default_root_dir) / "checkpoints"

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        """What Lightning's ``ckpt_path="last"`` picks from (the newest by modification time): our newest
        complete, verified checkpoint, which is never a half-written one."""
        found = self.find_latest(self._resolved_dir(trainer))
        return {found} if found is not None else set()

    def _name(self, trainer: Any) -> str:
        if self.filename == DEFAULT_FILENAME:
            return _store.checkpoint_name(trainer.global_step)  # the name PreemptionCheckpoint also writes
        return Path(self.format_checkpoint_name({"step": trainer.global_step, "epoch": trainer.current_epoch})).name

    def _unmarked_pattern(self) -> "re.Pattern[str]":
        # checkpoints without a marker are removed only under the default names, never a user's other files
        return _store.CHECKPOINT_NAME if self.filename == DEFAULT_FILENAME else re.compile(r"(?!)")

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        pass  # saving follows the step schedule only (ModelCheckpoint would save every epoch)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        pass

    # ---- hooks --------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = Path(trainer.default_root_dir) / "checkpoints"
        # the directory is created and checked now, not at the first save hours into the run
        refused = rank_zero_refusal(trainer, lambda: check_writable_dir("dirpath", self.dirpath, owner=_OWNER))
        dirpath, self.run_id, refused = broadcast(trainer, (str(self.dirpath), self.run_id or uuid.uuid4().hex[:12],
                                                            refused))
        raise_refused(refused)
        self.dirpath = Path(dirpath)
        self._fs = get_filesystem(str(self.dirpath))
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            # left by crashed saves and prunes (temporaries, aside copies, unmarked checkpoints); live ones are kept
            stale = _store.clean_leftovers(self.dirpath, self._unmarked_pattern())
            if stale:
                log.warning("DynamicCheckpoint: removed %d leftover(s) of interrupted saves or prunes in %s: %s",
                            len(stale), self.dirpath, ", ".join(p.name for p in stale))
        if self.async_save and not isinstance(trainer.strategy.checkpoint_io, TrackedAsyncCheckpointIO):
            trainer.strategy.checkpoint_io = TrackedAsyncCheckpointIO(trainer.strategy.checkpoint_io)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._saver.poll(trainer):
            self._prune(trainer)
        step = trainer.global_step
        if step != self._last_saved_step and self.should_save(step, self._total_steps(trainer)):
            self.save(trainer, reason="schedule")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.save_on_train_end and trainer.global_step != self._last_saved_step:
            self.save(trainer, reason="train_end")
        self.flush(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._saver.abandon(trainer)

    # ---- saving -------------------------------------------------------------------------
    def save(self, trainer: Any, reason: str = "manual") -> Path:
        """Save now, on every rank (collective). Returns the final path (committed later if async)."""
        assert self.dirpath is not None, "DynamicCheckpoint.save() runs after setup (inside Trainer.fit)."
        step = trainer.global_step
        final = self.dirpath / self._name(trainer)
        meta = {"step": step, "epoch": trainer.current_epoch, "reason": reason, "world_size": trainer.world_size,
                "run": self.run_id}
        self._saver.save(trainer, final, meta)
        self._last_saved_step = self._last_global_step_saved = step
        self.last_checkpoint = final
        # ModelCheckpoint without a monitor: the best model is the newest one (committed already unless async)
        self.best_model_path = self.last_model_path = self._last_checkpoint_saved = str(final)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))
        if self._saver.poll(trainer) or not self._saver.has_pending:
            self._prune(trainer)
        return final

    def flush(self, trainer: Any) -> None:
        """Wait for asynchronous writes and commit them (collective)."""
        if self._saver.poll(trainer, wait=True):
            self._prune(trainer)

    def _prune(self, trainer: Any) -> None:
        """Keep this run's newest `keep_last_k`; other runs' checkpoints in the directory are not ours to delete."""
        if not trainer.is_global_zero or self.dirpath is None or self.keep_last_k is None:
            return
        mine = [i for i in _store.list_complete(self.dirpath) if i.meta.get("run") == self.run_id]
        for info in mine[: max(0, len(mine) - self.keep_last_k)]:
            _store.delete(info.path)

    def state_dict(self) -> dict[str, Any]:
        return {"dirpath": str(self.dirpath) if self.dirpath else None, "last_saved_step": self._last_saved_step,
                "run_id": self.run_id, "best_model_path": self.best_model_path, "last_model_path": self.last_model_path}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_saved_step = int(state_dict.get("last_saved_step", -1))
        if isinstance(state_dict.get("run_id"), str):
            self.run_id = state_dict["run_id"]  # a resumed run continues (and prunes) the run it resumes
        for key in ("best_model_path", "last_model_path"):
            if isinstance(state_dict.get(key), str):
                setattr(self, key, state_dict[key])
