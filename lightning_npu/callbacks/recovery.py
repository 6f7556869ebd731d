"""`TrainingGuard`: restart a failed run from its newest complete checkpoint, and say why.

Two failure modes need two mechanisms. A failure every rank sees together (an exception on a
single device, persistent non-finite loss agreed over all ranks) is recovered inside the process
by `TrainingGuard.fit`, which re-enters `trainer.fit` from the newest checkpoint. A failure of one
rank (an exception in one process, a lost process) cannot be recovered in place: its peers are
blocked in collectives. The process exits non-zero, torchrun's elastic agent (`--max-restarts`)
restarts every worker, and `TrainingGuard.fit` in the new workers resumes from the checkpoint it
names. Both paths write to the same recovery log, ``<checkpoint dir>/recovery_log.jsonl``.

A restart must never cost more progress than the failure did. So a checkpoint counts as bad only
when the error was raised while Lightning was restoring it (a failing ``train_dataloader`` says
nothing about the checkpoint), every attempt counts against ``max_restarts``, restarts back off, a
start from scratch needs ``allow_fresh_start=True``, and checkpoints newer than the one a run
restarts from are moved to ``<checkpoint dir>/quarantine/`` rather than overwritten by the older
trajectory.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback

from lightning_npu import device as dev
from lightning_npu.callbacks import _store
from lightning_npu.callbacks._dist import agree_flag, broadcast, find_callback
from lightning_npu.callbacks.dynamic_checkpoint import DynamicCheckpoint
from lightning_npu.validate import check_bool, check_fraction, check_int, check_number, check_path, check_str

log = logging.getLogger(__name__)


class TrainingFailure(RuntimeError):
    """Training cannot go on as it is (raised on every rank at once, so recovery stays collective)."""


def _init_process_group_after_elastic_restart(trainer: Any, restart: int) -> None:
    """Join the process group under a key prefix unique to this restart.

    torchrun's agent keeps one store for all restarts and torch's env:// rendezvous adds no per-attempt
    prefix, so a restarted rank can read the address its dead predecessor published and fail with
    "Gloo connectFullMesh failed ... Connection refused" (NCCL: a stale unique id). Lightning's
    strategies skip their own initialisation when a default group exists, so creating it here is safe.
    """
    import torch.distributed as dist

    if trainer.world_size < 2 or dist.is_initialized() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    strategy = trainer.strategy
    timeout = getattr(strategy, "_timeout", None) or dist.constants.default_pg_timeout
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), trainer.world_size, is_master=False, timeout=timeout
    )
    store = dist.PrefixStore(f"lightning_npu/elastic_restart_{restart}", client)
    backend_of = getattr(strategy, "_get_process_group_backend", None)
    backend = backend_of() if callable(backend_of) else None
    dist.init_process_group(backend, store=store, rank=trainer.global_rank, world_size=trainer.world_size, timeout=timeout)


_MAX_BACKOFF_S = 300.0
_RESTORE_FILE = os.path.join("connectors", "checkpoint_connector.py")


def _raised_while_loading(err: BaseException) -> bool:
    """Whether `err` came out of Lightning's checkpoint restore (`_CheckpointConnector.resume_start`/`restore*`).

    The traceback, not the phase of the run, decides: between `setup` and `on_train_start` Lightning also runs
    `configure_model`, the DataModule's setup, `train_dataloader` and the sanity check, and none of their errors
    says anything about the checkpoint. A communication error is a lost peer, not a bad file.
    """
    try:
        import torch.distributed as dist

        if isinstance(err, getattr(dist, "DistError", ())):
            return False
    except ImportError:  # pragma: no cover
        pass
    tb = err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.endswith(_RESTORE_FILE) and (
            code.co_name.startswith(("restore", "_restore", "resume_start"))
        ):
            return True
        tb = tb.tb_next
    return False


def job_id() -> str:
    """This job's identity, stable across torchrun restarts of its workers and distinct between jobs.

    ``TORCHELASTIC_RUN_ID`` is ``"none"`` under torchrun's default static rendezvous, so it alone would make every
    job share one restart budget. SLURM's job id comes first; under a static torchrun the agent's process id
    (the workers' parent, alive across restarts) and the rendezvous address; a plain process is its own job.
    """
    for var in ("LIGHTNING_NPU_JOB_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID"):
        if os.environ.get(var):
            suffix = os.environ.get("SLURM_ARRAY_TASK_ID", "") if var == "SLURM_JOB_ID" else ""
            return f"{var.lower()}:{os.environ[var]}" + (f"_{suffix}" if suffix else "")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"torchelastic:{run_id}"
    host = socket.gethostname()
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        return f"torchrun:{host}:{os.getppid()}:{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    return f"process:{host}:{os.getpid()}"


def _identity(path: Any) -> Optional[int]:
    """Tells a checkpoint from a later one written under the same name."""
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _still(bad: dict[str, Optional[int]]) -> list[str]:
    """The bad checkpoints still there: a bad one's name may since hold a new, good checkpoint."""
    return [p for p, ident in bad.items() if _identity(p) == ident]


class TrainingGuard(Callback):
    """Automatic recovery and cheap periodic health checks.

    Args:
        max_restarts: recoveries allowed per run (in-process and torchrun restarts together).
        checkpoint_dir: where to find checkpoints; default: the `DynamicCheckpoint`'s directory.
        nonfinite_patience: consecutive steps with a non-finite loss (on any rank) that count as a failure.
        health_check_interval: every this many steps, read device memory and synchronize the device
            (an unhealthy device raises there rather than in the middle of a collective); None disables.
        memory_warn_fraction: warn when device memory in use exceeds this fraction of the total.
        save_initial: save a step-0 checkpoint when a run starts with none, so that even a failure before
            the first scheduled save restarts from a known state.
        allow_fresh_start: when a restart finds no usable checkpoint (none was saved yet, or every one
            failed to load), start over from the initial weights. Off by default: a silent start from
            scratch loses the run's progress; when on, the start is logged as ``fresh_start`` and the
            unusable checkpoints are moved to ``quarantine/``, never overwritten.
        restart_backoff: seconds to wait before the first restart, doubled for each further one (at most
            5 minutes): a failing file system or a busy node gets time to recover.
        job_id: names this job in the recovery log, whose restarts count against one ``max_restarts``;
            default from ``SLURM_JOB_ID``, a named torchrun rendezvous, or the torchrun agent (see `job_id`).

    Multi-rank runs: a failure of one rank cannot be recovered in place (its peers wait in collectives),
    so the process exits non-zero and torchrun ``--max-restarts`` restarts every worker; the new workers
    count the restart and resume. Only `TrainingFailure`, which every rank raises at the same step, is
    restarted in place.

    Use ``guard.fit(trainer, model, datamodule=...)`` instead of ``trainer.fit(...)`` to get restarts.
    Added to a Trainer used with plain ``trainer.fit`` the guard still checks health and raises
    `TrainingFailure` on persistent non-finite loss.
    """

    LOG_NAME = "recovery_log.jsonl"

    def __init__(
        self,
        max_restarts: int = 3,
        checkpoint_dir: Optional[str] = None,
        nonfinite_patience: Optional[int] = 20,
        health_check_interval: Optional[int] = 100,
        memory_warn_fraction: float = 0.95,
        save_initial: bool = True,
        allow_fresh_start: bool = False,
        restart_backoff: float = 1.0,
        job_id: Optional[str] = None,
    ) -> None:
        o = "TrainingGuard"
        check_int("max_restarts", max_restarts, minimum=0, example=3, owner=o)
        check_int("nonfinite_patience", nonfinite_patience, minimum=1, example=20, allow_none=True, owner=o)
        check_int("health_check_interval", health_check_interval, minimum=1, example=100, allow_none=True, owner=o)
        memory_warn_fraction = check_fraction("memory_warn_fraction", memory_warn_fraction, example=0.95, owner=o)
        checkpoint_dir = check_path("checkpoint_dir", checkpoint_dir, owner=o)
        check_bool("save_initial", save_initial, owner=o)
        check_bool("allow_fresh_start", allow_fresh_start, owner=o)
        restart_backoff = check_number("restart_backoff", restart_backoff, at_least=0.0, example=1.0, owner=o)
        check_str("job_id", job_id, example="'run-42'", allow_none=True, owner=o)
        self.allow_fresh_start = allow_fresh_start
        self.restart_backoff = float(restart_backoff)
        self.job_id = job_id
        self.max_restarts = max_restarts
        self.checkpoint_dir = checkpoint_dir
        self.nonfinite_patience = nonfinite_patience
        self.health_check_interval = health_check_interval
        self.memory_warn_fraction = memory_warn_fraction
        self.save_initial = save_initial
        self.restarts = 0
        self.events: list[dict[str, Any]] = []
        self._nonfinite_steps = 0
        self._last_exception: Optional[BaseException] = None
        self._job = ""

    # ---- where checkpoints are ----------------------------------------------------------
    def _dynamic(self, trainer: Any) -> Any:
        return find_callback(trainer, DynamicCheckpoint)

    def resolve_checkpoint_dir(self, trainer: Any) -> Path:
        if self.checkpoint_dir is not None:
            return Path(self.checkpoint_dir)
        dyn = self._dynamic(trainer)
        if dyn is None:
            raise ValueError(
                "TrainingGuard needs checkpoints to recover from: add DynamicCheckpoint(...) to Trainer(callbacks=[...]) "
                "or pass TrainingGuard(checkpoint_dir=...)."
            )
        return dyn.dirpath if dyn.dirpath is not None else Path(trainer.default_root_dir) / "checkpoints"

    def latest_checkpoint(self, trainer: Any, exclude: Any = ()) -> Optional[str]:
        found = _store.latest_complete(self.resolve_checkpoint_dir(trainer), exclude=exclude, warn=log.warning)
        return str(found) if found is not None else None

    # ---- the recovery driver ------------------------------------------------------------
    def fit(self, trainer: Any, model: Any, ckpt_path: Optional[str] = "latest", **fit_kwargs: Any) -> Any:
        """`trainer.fit` with restarts from the newest complete checkpoint (``ckpt_path="latest"``)."""
        if self not in trainer.callbacks:
            raise ValueError("TrainingGuard.fit: add this guard to Trainer(callbacks=[...]) first; it observes the run.")
        ckpt_dir = self.resolve_checkpoint_dir(trainer)
        self._log_file = ckpt_dir / self.LOG_NAME
        self._job = job = f"{self.job_id or job_id()}@{ckpt_dir.resolve()}"
        history = [e for e in self._read_log() if e.get("job") == job]
        # bad checkpoints found by an earlier attempt of this job (another process, before torchrun restarted it)
        bad: dict[str, Optional[int]] = {e["path"]: e.get("identity") for e in history
                                         if e["event"] == "bad_checkpoint" and "path" in e}
        self.restarts = sum(1 for e in history if e["event"] == "restart")
        elastic_restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if elastic_restart > 0:
            if not any(e.get("elastic_restart") == elastic_restart for e in history):
                self.restarts += 1
                latest = self.latest_checkpoint(trainer, exclude=_still(bad)) if ckpt_path == "latest" else ckpt_path
                self._record(trainer, "restart", f"torchrun restarted the workers (restart {elastic_restart}): a rank "
                             f"failed or was lost; resuming from {latest} "
                             f"(restart {self.restarts}/{self.max_restarts})",
                             elastic_restart=elastic_restart)
            if self.restarts > self.max_restarts:
                self._give_up(trainer, f"torchrun restart {elastic_restart}")
            self._backoff()
            _init_process_group_after_elastic_restart(trainer, elastic_restart)
        restarting = elastic_restart > 0
        path = self._start_point(trainer, ckpt_path, bad, restarting)
        while True:
            trainer.should_stop = False
            try:
                return trainer.fit(model, ckpt_path=path, **fit_kwargs)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as err:  # noqa: BLE001 - every failure is a candidate for recovery
                reason = f"{type(err).__name__}: {err}"
                if path is not None and _raised_while_loading(err):
                    bad[str(path)] = _identity(path)
                    self._record(trainer, "bad_checkpoint", f"could not resume from {path} ({reason})",
                                 any_rank=True, path=str(path), identity=_identity(path))
                if trainer.world_size > 1 and not isinstance(err, TrainingFailure):
                    self._record(trainer, "rank_failure", f"{reason}; other ranks cannot recover in place, "
                                 "exiting so that torchrun --max-restarts restarts the workers")
                    raise
                self.restarts += 1
                if self.restarts > self.max_restarts:
                    self._give_up(trainer, reason, err)
                try:
                    path = self._start_point(trainer, "latest", bad, restarting=True, reason=reason)
                except TrainingFailure as no_start:
                    raise no_start from err
                self._record(trainer, "restart", f"{reason} at step {trainer.global_step}; restarting from "
                             f"{path or 'scratch'} (restart {self.restarts}/{self.max_restarts})")
                self._backoff()

    def _start_point(
        self, trainer: Any, ckpt_path: Optional[str], bad: dict[str, Optional[int]], restarting: bool, reason: str = ""
    ) -> Optional[str]:
        """The checkpoint the next attempt loads; newer (unusable) ones are first moved out of the way."""
        if ckpt_path != "latest" and not restarting:
            return ckpt_path  # the user's explicit choice
        ckpt_dir = self.resolve_checkpoint_dir(trainer)
        path = self.latest_checkpoint(trainer, exclude=_still(bad))
        newer = self._newer_than(ckpt_dir, path)
        if path is None and (restarting or newer):
            if not self.allow_fresh_start:
                self._record(trainer, "gave_up", f"{reason + '; ' if reason else ''}no usable checkpoint in {ckpt_dir}")
                raise TrainingFailure(
                    f"TrainingGuard: no usable checkpoint in {ckpt_dir} to restart from"
                    + (f" ({len(newer)} could not be loaded)" if newer else "")
                    + (f"; last failure: {reason}" if reason else "")
                    + ". Starting over would lose the run's progress, so it is not done silently: fix the cause, or "
                    "pass TrainingGuard(allow_fresh_start=True) to start from the initial weights."
                )
            self._record(trainer, "fresh_start", f"no usable checkpoint in {ckpt_dir}; starting from the initial "
                         "weights (allow_fresh_start=True)")
        if newer and trainer.global_rank == 0:
            moved = [str(self._set_aside(p)) for p in newer]
            self._record(trainer, "set_aside", f"moved {len(newer)} checkpoint(s) newer than {path or 'scratch'} "
                         f"that could not be used to {ckpt_dir / 'quarantine'}, so that the run does not overwrite "
                         f"them: {', '.join(moved)}", paths=[str(p) for p in newer])
        return path

    @staticmethod
    def _newer_than(ckpt_dir: Path, path: Optional[str]) -> list[Path]:
        listed = _store.list_complete(ckpt_dir)
        if path is None:
            return [c.path for c in listed]
        step = next((c.step for c in listed if c.path.resolve() == Path(path).resolve()), None)
        return [c.path for c in listed if step is not None and c.step > step]

    @staticmethod
    def _set_aside(path: Path) -> Path:
        """Move a checkpoint and its marker to ``quarantine/<time>-<id>/``; the marker first, so that it never
        vouches for data being moved."""
        dest = path.parent / "quarantine" / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        dest.mkdir(parents=True, exist_ok=True)
        for src in (_store.marker_path(path), path):
            try:
                os.rename(src, dest / src.name)
            except FileNotFoundError:  # another rank moved it first
                pass
        if not any(dest.iterdir()):
            dest.rmdir()
        return dest / path.name

    def _backoff(self) -> None:
        if self.restart_backoff > 0 and self.restarts > 0:
            time.sleep(min(self.restart_backoff * 2 ** (self.restarts - 1), _MAX_BACKOFF_S))

    def _give_up(self, trainer: Any, reason: str, err: Optional[BaseException] = None) -> None:
        self._record(trainer, "gave_up", f"{reason}; {self.restarts} restarts exceed max_restarts={self.max_restarts}")
        raise TrainingFailure(
            f"TrainingGuard gave up: {self.restarts} restarts exceed max_restarts={self.max_restarts} for job "
            f"{self._job}; last failure: {reason}. No checkpoint was overwritten; see {self._log_file}."
        ) from err

    # ---- hooks --------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._nonfinite_steps = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        dyn = self._dynamic(trainer)
        if self.save_initial and dyn is not None and trainer.global_step == 0:
            has_any = broadcast(trainer, _store.latest_complete(dyn.dirpath) is not None if trainer.is_global_zero else None)
            if not has_any:
                dyn.save(trainer, reason="initial")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.nonfinite_patience is not None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            local_bad = isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss.detach()).all())
            if agree_flag(trainer, local_bad):
                self._nonfinite_steps += 1
                if self._nonfinite_steps >= self.nonfinite_patience:
                    raise TrainingFailure(
                        f"the loss was non-finite for {self._nonfinite_steps} consecutive steps "
                        f"(nonfinite_patience={self.nonfinite_patience})"
                    )
            else:
                self._nonfinite_steps = 0
        if self.health_check_interval and trainer.global_step % self.health_check_interval == 0:
            self.health_check(trainer, pl_module)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._last_exception = exception

    def health_check(self, trainer: Any, pl_module: Any) -> dict[str, float]:
        """Device memory and a device synchronize; metrics go to the loggers. Cheap: no collectives."""
        device = trainer.strategy.root_device
        dev.synchronize(device)  # a failed device raises here, with a clear origin
        stats = dev.memory_stats(device)
        metrics = {f"health/{k}": float(v) for k, v in stats.items()}
        total, free = stats.get("total_bytes"), stats.get("free_bytes")
        if total and free is not None and (total - free) / total > self.memory_warn_fraction and trainer.is_global_zero:
            log.warning(
                "TrainingGuard: device memory %.1f%% used (> memory_warn_fraction=%s) at step %d.",
                100 * (total - free) / total, self.memory_warn_fraction, trainer.global_step,
            )
        if pl_module._trainer is not None and metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False, batch_size=1)
        return metrics

    # ---- the log ------------------------------------------------------------------------
    def _read_log(self) -> list[dict[str, Any]]:
        try:
            with open(self._log_file) as f:
                return [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError):
            return []

    def _record(self, trainer: Any, event: str, reason: str, any_rank: bool = False, **extra: Any) -> None:
        """Append to the recovery log (rank 0; `any_rank` for what only the failing rank may know)."""
        entry = {"time": time.time(), "event": event, "reason": reason, "step": trainer.global_step, "job": self._job,
                 **extra}
        self.events.append(entry)
        log.warning("TrainingGuard: %s: %s", event, reason)
        if trainer.global_rank == 0 or any_rank:
            self._log_file.parent.mkdir(parents=True, exist_ok=True)
            with open(self._log_file, "a") as f:
                f.write(json.dumps(entry) + "\n")

