"""TrainingGuard never loses progress to a failure that is not the checkpoint's, and PreemptionCheckpoint
chains the handlers it displaces and saves during validation (a real signal, delivered to this process)."""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_npu.callbacks import DynamicCheckpoint, PreemptionCheckpoint, TrainingFailure, TrainingGuard
from lightning_npu.callbacks import _store, recovery
from tests._callbacks_helpers import StepSeeded, flat_params, trainer_kwargs


class FlakyLoader(StepSeeded):
    """`train_dataloader` raises OSError on its first `failures` calls (a flaky file system)."""

    def __init__(self, failures: int = 0, **kw) -> None:
        super().__init__(**kw)
        self.failures = failures

    def train_dataloader(self) -> DataLoader:
        if self.failures > 0:
            self.failures -= 1
            raise OSError(5, "Input/output error: injected")
        return super().train_dataloader()


def _digest(ck: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(ck.iterdir()) if p.is_file()
            and p.name.startswith("step=")}


def _trainer(root: Path, max_steps: int, guard: TrainingGuard, interval: int = 2) -> L.Trainer:
    dyn = DynamicCheckpoint(dirpath=str(root / "ck"), phase_fractions=(), intervals=(interval,), keep_last_k=None)
    return L.Trainer(callbacks=[dyn, guard], **trainer_kwargs(root, max_steps))


def test_failing_dataloader_is_not_a_bad_checkpoint(tmp_path, monkeypatch):
    """The issue's scenario: train_dataloader raises OSError 4 times while resuming a run that reached step 8.

    Before the fix the guard took each failure for a bad checkpoint, walked 8 -> 6 -> 4 -> 2 -> none without
    counting a restart, and overwrote step=8 with a new trajectory."""
    sleeps: list[float] = []
    monkeypatch.setattr(recovery.time, "sleep", sleeps.append)
    root = tmp_path / "run"
    first = StepSeeded()
    _trainer(root, 8, TrainingGuard(restart_backoff=0)).fit(first)
    ck = root / "ck"
    before = _digest(ck)
    assert "step=00000008.ckpt" in before

    # max_restarts=2: three attempts, all from step 8, then a clear give-up; no checkpoint touched
    guard = TrainingGuard(max_restarts=2, restart_backoff=0.5)
    model, trainer = FlakyLoader(failures=4), None
    trainer = _trainer(root, 12, guard)
    with pytest.raises(TrainingFailure, match="3 restarts exceed max_restarts=2"):
        guard.fit(trainer, model)
    assert [e["event"] for e in guard.events] == ["restart", "restart", "gave_up"]
    assert all("OSError" in e["reason"] and "step=00000008.ckpt" in e["reason"] for e in guard.events[:2])
    assert sleeps == [0.5, 1.0]  # backoff between restarts, doubling
    assert _digest(ck) == before and not (ck / "quarantine").exists()

    # the budget is the job's: the same job gets no fresh one by calling fit again
    guard = TrainingGuard(max_restarts=2, restart_backoff=0.5)
    with pytest.raises(TrainingFailure, match="3 restarts exceed max_restarts=2"):
        guard.fit(_trainer(root, 12, guard), model)
    assert model.failures == 0 and [e["event"] for e in guard.events] == ["gave_up"]  # one attempt, no restart

    # another job: the attempt after the last failure resumes from step 8 and matches an uninterrupted run
    sleeps.clear()
    guard = TrainingGuard(max_restarts=2, restart_backoff=0.5, job_id="next-job")
    model.failures = 1
    trainer = _trainer(root, 12, guard)
    guard.fit(trainer, model)
    assert trainer.global_step == 12 and sorted(model.losses) == [8, 9, 10, 11]
    assert [e["event"] for e in guard.events] == ["restart"] and sleeps == [0.5]
    ref = StepSeeded()
    L.Trainer(**trainer_kwargs(tmp_path / "ref", 12)).fit(ref)
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=0, atol=0)
    after = _digest(ck)
    assert {k: after[k] for k in before} == before  # step=8 and older: the same bytes


@pytest.mark.parametrize("checksum", [True, False])
def test_no_silent_fresh_start_and_unusable_checkpoints_are_set_aside(tmp_path, monkeypatch, checksum):
    """Same-size garbage in both checkpoints. With CRC32s (the default) discovery rejects them both and the guard
    gives up at once; with LIGHTNING_NPU_CHECKSUM=0 only loading can tell, one attempt per checkpoint."""
    monkeypatch.setattr(recovery.time, "sleep", lambda s: None)
    if not checksum:
        monkeypatch.setenv("LIGHTNING_NPU_CHECKSUM", "0")
    root = tmp_path / "run"
    _trainer(root, 4, TrainingGuard(save_initial=False)).fit(StepSeeded())
    ck = root / "ck"
    for name in ("step=00000002.ckpt", "step=00000004.ckpt"):  # same size, garbage inside
        data = bytearray((ck / name).read_bytes())
        data[100:400] = b"\0" * 300
        (ck / name).write_bytes(bytes(data))
    corrupted = _digest(ck)

    guard = TrainingGuard(max_restarts=5, save_initial=False)
    with pytest.raises(TrainingFailure, match="allow_fresh_start=True") as failure:
        guard.fit(_trainer(root, 6, guard), StepSeeded())
    moved = {p.name: p for p in (ck / "quarantine").rglob("step=*.ckpt")}
    if checksum:  # nothing was tried, nothing moved or overwritten
        assert [e["event"] for e in guard.events] == ["gave_up"] and "2 could not be loaded" in str(failure.value)
        assert moved == {} and _digest(ck) == corrupted
    else:
        assert [e["event"] for e in guard.events] == ["bad_checkpoint", "set_aside", "restart", "bad_checkpoint",
                                                      "gave_up"]
        # the newer bad checkpoint was moved aside before the older one was tried, never overwritten
        assert sorted(moved) == ["step=00000004.ckpt"]
        assert hashlib.sha256(moved["step=00000004.ckpt"].read_bytes()).hexdigest() == corrupted["step=00000004.ckpt"]
        assert (moved["step=00000004.ckpt"].parent / "step=00000004.ckpt.complete").exists()

    guard = TrainingGuard(max_restarts=5, save_initial=False, allow_fresh_start=True)
    model, trainer = StepSeeded(), None
    trainer = _trainer(root, 6, guard)
    guard.fit(trainer, model)
    events = [e["event"] for e in guard.events]
    # an explicit fresh start (without checksums the same job remembers from its recovery log that step=2 failed to
    # load: no retry); what could not be used is moved aside, never overwritten
    assert events == ["fresh_start", "set_aside"] and trainer.global_step == 6
    assert sorted(p.name for p in (ck / "quarantine").rglob("step=*.ckpt")) == ["step=00000002.ckpt",
                                                                                  "step=00000004.ckpt"]
    assert [i.step for i in _store.list_complete(ck)] == [2, 4, 6]  # the new trajectory's own


def _stub_trainer(tmp_path: Path, guard: TrainingGuard, fit) -> SimpleNamespace:
    t = SimpleNamespace(callbacks=[guard], world_size=2, global_rank=0, global_step=0, should_stop=False,
                        default_root_dir=str(tmp_path), calls=0)

    def _fit(model, ckpt_path=None, **kw):
        t.calls += 1
        return fit(ckpt_path)

    t.fit = _fit
    return t


def test_multi_rank_failure_exits_and_restart_budget_is_per_job(tmp_path, monkeypatch):
    for var in ("SLURM_JOB_ID", "LIGHTNING_NPU_JOB_ID", "PBS_JOBID", "LSB_JOBID", "TORCHELASTIC_USE_AGENT_STORE",
                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(recovery.time, "sleep", lambda s: None)

    def failing(ckpt_path):
        raise OSError("injected: train_dataloader failed on this rank")

    # a failure on one of two ranks is not re-entered in place (its peers wait in collectives): exit non-zero
    guard = TrainingGuard(checkpoint_dir=str(tmp_path), allow_fresh_start=True)
    trainer = _stub_trainer(tmp_path, guard, failing)
    with pytest.raises(OSError, match="injected"):
        guard.fit(trainer, None)
    assert trainer.calls == 1 and [e["event"] for e in guard.events] == ["rank_failure"]

    # torchrun restarts under a static rendezvous (TORCHELASTIC_RUN_ID="none"): two jobs, two budgets
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    restarts = {}
    for job in ("1001", "1002"):
        monkeypatch.setenv("SLURM_JOB_ID", job)
        for attempt in (1, 2):
            monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
            guard = TrainingGuard(checkpoint_dir=str(tmp_path), max_restarts=3, allow_fresh_start=True)
            guard.fit(_stub_trainer(tmp_path, guard, lambda p: "ok"), None)
            restarts[job, attempt] = guard.restarts
    assert restarts == {("1001", 1): 1, ("1001", 2): 2, ("1002", 1): 1, ("1002", 2): 2}
    monkeypatch.delenv("SLURM_JOB_ID")
    assert "none" not in recovery.job_id()  # static torchrun without a scheduler: keyed by the agent process


class LongValidation(StepSeeded):
    def __init__(self, signal_at_val_batch: int = 3) -> None:
        super().__init__()
        self.val_signal_at = signal_at_val_batch
        self.val_seen: list[tuple[int, bool]] = []
        self.pre: PreemptionCheckpoint | None = None

    def validation_step(self, batch, batch_idx):
        if not self.trainer.sanity_checking:
            self.val_seen.append((batch_idx, self.pre.saved_path is not None))
            if batch_idx == self.val_signal_at and len(self.val_seen) == batch_idx + 1:
                os.kill(os.getpid(), signal.SIGUSR1)  # a real signal, as the scheduler sends it

    def val_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(40, 1)), batch_size=1)


def test_preemption_during_validation_saves_at_once_and_chains_the_previous_handler(tmp_path):
    calls = []

    def requeue(signum, frame):  # stands for Lightning's SLURM auto-requeue handler (or a user's)
        calls.append((signum, sorted(p.name for p in (tmp_path / "ck").glob("*.complete"))))

    previous = signal.signal(signal.SIGUSR1, requeue)
    try:
        model = LongValidation()
        pre = model.pre = PreemptionCheckpoint(signals="SIGUSR1")  # one signal given as a string
        assert pre.signals == [signal.SIGUSR1]
        dyn = DynamicCheckpoint(dirpath=str(tmp_path / "ck"), phase_fractions=(), intervals=(100,), keep_last_k=None)
        trainer = L.Trainer(callbacks=[dyn, pre], val_check_interval=4, limit_val_batches=40,
                            **trainer_kwargs(tmp_path, 20))
        trainer.fit(model)
        # saved at the validation batch end right after the signal, not after the 40 batches nor the next step
        assert model.val_seen[3:5] == [(3, False), (4, True)]
        assert trainer.global_step == 4 and pre.saved_path == tmp_path / "ck" / "step=00000004.ckpt"
        assert calls == [(signal.SIGUSR1, ["step=00000004.ckpt.complete"])]  # chained, after the commit
        assert signal.getsignal(signal.SIGUSR1) is requeue  # restored when training ended
    finally:
        signal.signal(signal.SIGUSR1, previous)
    # the checkpoint taken in the middle of validation resumes like any other
    resumed = StepSeeded()
    L.Trainer(**trainer_kwargs(tmp_path / "resume", 8)).fit(resumed, ckpt_path=str(pre.saved_path))
    ref = StepSeeded()
    L.Trainer(**trainer_kwargs(tmp_path / "ref", 8)).fit(ref)
    torch.testing.assert_close(flat_params(resumed), flat_params(ref), rtol=0, atol=0)


def test_lightning_sigterm_notifier_is_not_chained_but_others_are():
    from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector

    from lightning_npu.callbacks.preemption import _chainable

    connector = _SignalConnector(trainer=None)
    user = lambda signum, frame: None  # noqa: E731
    sigterm = _HandlersCompose([connector._sigterm_notifier_fn, connector._sigterm_handler_fn, user])
    assert _chainable(sigterm) == [user]
    slurm = _HandlersCompose([connector._slurm_sigusr_handler_fn])
    assert _chainable(slurm) == [connector._slurm_sigusr_handler_fn]
    assert _chainable(signal.SIG_DFL) == [] and _chainable(signal.SIG_IGN) == []
