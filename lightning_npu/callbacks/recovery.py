"""`TrainingGuard`: restart a failed run from its newest complete checkpoint, and say why.

Two failure modes need two mechanisms. A failure every rank sees together (an exception on a
single device, persistent non-finite loss agreed over all ranks) is recovered inside the process
by `TrainingGuard.fit`, which re-enters `trainer.fit` from the newest checkpoint. A failure of one
rank (an exception in one process, a lost process) cannot be recovered in place: its peers are
blocked in collectives. The process exits non-zero, torchrun's elastic agent (`--max-restarts`)
restarts every worker, and `TrainingGuard.fit` in the new workers resumes from the checkpoint it
names. Both paths write to the same recovery log, ``<checkpoint dir>/recovery_log.jsonl``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback

from lightning_npu import device as dev
from lightning_npu.callbacks import _store
from lightning_npu.callbacks._dist import agree_flag, broadcast, find_callback

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
    ) -> None:
        if not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"TrainingGuard(max_restarts={max_restarts!r}): must be an integer >= 0, e.g. 3.")
        if nonfinite_patience is not None and (not isinstance(nonfinite_patience, int) or nonfinite_patience < 1):
            raise ValueError(f"TrainingGuard(nonfinite_patience={nonfinite_patience!r}): a positive number of steps, or None.")
        if health_check_interval is not None and (not isinstance(health_check_interval, int) or health_check_interval < 1):
            raise ValueError(
                f"TrainingGuard(health_check_interval={health_check_interval!r}): a positive number of steps, or None."
            )
        if not 0.0 < memory_warn_fraction <= 1.0:
            raise ValueError(f"TrainingGuard(memory_warn_fraction={memory_warn_fraction!r}): must be in (0, 1].")
        self.max_restarts = max_restarts
        self.checkpoint_dir = checkpoint_dir
        self.nonfinite_patience = nonfinite_patience
        self.health_check_interval = health_check_interval
        self.memory_warn_fraction = memory_warn_fraction
        self.save_initial = save_initial
        self.restarts = 0
        self.events: list[dict[str, Any]] = []
        self._nonfinite_steps = 0
        self._setup_done = False
        self._loaded = False
        self._last_exception: Optional[BaseException] = None

    # ---- where checkpoints are ----------------------------------------------------------
    def _dynamic(self, trainer: Any) -> Any:
        from lightning_npu.callbacks.dynamic_checkpoint import DynamicCheckpoint

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
        self._log_file = self.resolve_checkpoint_dir(trainer) / self.LOG_NAME
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", f"local-{os.getpid()}")
        elastic_restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.restarts = sum(1 for e in self._read_log() if e.get("run_id") == run_id and e["event"] == "restart")
        if elastic_restart > 0 and not any(
            e.get("run_id") == run_id and e.get("elastic_restart") == elastic_restart for e in self._read_log()
        ):
            self.restarts += 1
            latest = self.latest_checkpoint(trainer) if ckpt_path == "latest" else ckpt_path
            self._record(trainer, "restart", f"torchrun restarted the workers (restart {elastic_restart}): a rank "
                         f"failed or was lost; resuming from {latest}", run_id=run_id, elastic_restart=elastic_restart)
            if self.restarts > self.max_restarts:
                self._record(trainer, "gave_up", f"{self.restarts} restarts exceed max_restarts={self.max_restarts}",
                             run_id=run_id)
                raise TrainingFailure(f"TrainingGuard: {self.restarts} restarts exceed max_restarts={self.max_restarts}.")
        if elastic_restart > 0:
            _init_process_group_after_elastic_restart(trainer, elastic_restart)
        bad: list[str] = []
        attempt = 0
        while True:
            path = self.latest_checkpoint(trainer, exclude=bad) if ckpt_path == "latest" or attempt else ckpt_path
            if attempt:
                trainer.should_stop = False
            self._setup_done = self._loaded = False
            try:
                return trainer.fit(model, ckpt_path=path, **fit_kwargs)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as err:  # noqa: BLE001 - every failure is a candidate for recovery
                attempt += 1
                reason = f"{type(err).__name__}: {err}"
                if path is not None and self._setup_done and not self._loaded:
                    bad.append(path)
                    self._record(trainer, "bad_checkpoint", f"could not resume from {path} ({reason}); "
                                 "falling back to an earlier checkpoint", run_id=run_id)
                    continue
                if trainer.world_size > 1 and not isinstance(err, TrainingFailure):
                    self._record(trainer, "rank_failure", f"{reason}; other ranks cannot recover in place, "
                                 "exiting so that torchrun --max-restarts restarts the workers", run_id=run_id)
                    raise
                self.restarts += 1
                if self.restarts > self.max_restarts:
                    self._record(trainer, "gave_up", f"{reason}; {self.restarts} restarts exceed "
                                 f"max_restarts={self.max_restarts}", run_id=run_id)
                    raise TrainingFailure(
                        f"TrainingGuard gave up after max_restarts={self.max_restarts} restarts; last failure: {reason}"
                    ) from err
                nxt = self.latest_checkpoint(trainer, exclude=bad)
                if nxt is None:
                    self._record(trainer, "gave_up", f"{reason}; no complete checkpoint to restart from", run_id=run_id)
                    raise TrainingFailure(
                        f"TrainingGuard cannot restart: no complete checkpoint in {self.resolve_checkpoint_dir(trainer)} "
                        "(keep save_initial=True, or save earlier). Last failure: " + reason
                    ) from err
                self._record(trainer, "restart", f"{reason} at step {trainer.global_step}; restarting from {nxt} "
                             f"(restart {self.restarts}/{self.max_restarts})", run_id=run_id)

    # ---- hooks --------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._setup_done = True
        self._nonfinite_steps = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._loaded = True  # from here on a failure is the run's, not the checkpoint's
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

    def _record(self, trainer: Any, event: str, reason: str, **extra: Any) -> None:
        entry = {"time": time.time(), "event": event, "reason": reason, "step": trainer.global_step, **extra}
        self.events.append(entry)
        log.warning("TrainingGuard: %s: %s", event, reason)
        if trainer.global_rank == 0:
            self._log_file.parent.mkdir(parents=True, exist_ok=True)
            with open(self._log_file, "a") as f:
                f.write(json.dumps(entry) + "\n")

