"""Fault injection in real processes: a crash while writing a checkpoint, SIGTERM, SIGKILL under torchrun,
a failing step recovered in process, a corrupted checkpoint skipped at resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_npu.callbacks import (
    DynamicCheckpoint,
    GradientHealthGuard,
    TrainingFailure,
    TrainingGuard,
    _store,
)
from tests._callbacks_helpers import StepSeeded, flat_params, script_env, trainer_kwargs

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "callbacks_train.py"
PY = sys.executable


def _reference(tmp_path, max_steps, interval=2):
    model = StepSeeded()
    dyn = DynamicCheckpoint(dirpath=str(tmp_path / "ref_ck"), phase_fractions=(), intervals=(interval,))
    trainer = L.Trainer(callbacks=[dyn, GradientHealthGuard()], **trainer_kwargs(tmp_path / "ref", max_steps))
    trainer.fit(model)
    return model


def _guarded(root, max_steps, interval=2, max_restarts=2, **module_kw):
    model = StepSeeded(**module_kw)
    dyn = DynamicCheckpoint(dirpath=str(Path(root) / "ck"), phase_fractions=(), intervals=(interval,), keep_last_k=None)
    guard = TrainingGuard(max_restarts=max_restarts)
    trainer = L.Trainer(callbacks=[dyn, GradientHealthGuard(), guard], **trainer_kwargs(root, max_steps))
    return model, trainer, guard


def test_exception_in_step_restarts_from_latest_and_matches_uninterrupted(tmp_path):
    ref = _reference(tmp_path, 9)
    model, trainer, guard = _guarded(tmp_path / "run", 9, raise_at=5, raise_flag=str(tmp_path / "raised"))
    guard.fit(trainer, model)
    assert trainer.global_step == 9
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=0, atol=0)
    restarts = [e for e in guard.events if e["event"] == "restart"]
    assert len(restarts) == 1 and "injected failure at step 5" in restarts[0]["reason"]
    assert "step=00000004.ckpt" in restarts[0]["reason"]
    log = [json.loads(l) for l in (tmp_path / "run" / "ck" / "recovery_log.jsonl").read_text().splitlines()]
    assert [e["event"] for e in log] == ["restart"]


def test_gives_up_after_max_restarts(tmp_path):
    model, trainer, guard = _guarded(tmp_path, 9, max_restarts=1, raise_at=3)  # fails every time
    with pytest.raises(TrainingFailure, match="max_restarts=1"):
        guard.fit(trainer, model)
    assert [e["event"] for e in guard.events] == ["restart", "gave_up"]


def test_persistent_nonfinite_loss_is_a_failure(tmp_path):
    model = StepSeeded()
    model.net[0].weight.data.fill_(float("nan"))  # every loss is NaN; no guard would ever fix that
    dyn = DynamicCheckpoint(dirpath=str(tmp_path / "ck"), phase_fractions=(), intervals=(2,))
    guard = TrainingGuard(max_restarts=1, nonfinite_patience=3, save_initial=True)
    trainer = L.Trainer(callbacks=[dyn, guard], **trainer_kwargs(tmp_path, 20))
    with pytest.raises(TrainingFailure, match="non-finite for 3 consecutive steps"):
        guard.fit(trainer, model)
    assert [e["event"] for e in guard.events] == ["restart", "gave_up"]
    assert trainer.global_step == 5  # failed at 3, restarted from 2, failed again at 5


def test_crash_while_writing_checkpoint_keeps_previous_and_resumes(tmp_path):
    ref = _reference(tmp_path, 8)
    root = tmp_path / "run"
    proc = subprocess.run([PY, str(SCRIPT), "--root", str(root), "--out", str(tmp_path / "x.pt"), "--max-steps", "8",
                           "--crash-in-save-at", "4"], env=script_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    ck = root / "ck"
    assert [i.step for i in _store.list_complete(ck)] == [0, 2]
    assert not (ck / "step=00000004.ckpt").exists()
    assert [p for p in ck.iterdir() if p.name.startswith(".tmp-step=00000004")]  # the half-written file
    assert DynamicCheckpoint.find_latest(ck) == str(ck / "step=00000002.ckpt")
    model, trainer, guard = _guarded(root, 8)
    guard.fit(trainer, model)
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=0, atol=0)
    assert not [p for p in ck.iterdir() if p.name.startswith(".tmp-")]  # cleaned after the next commit


@pytest.mark.parametrize("checksum", [True, False])
def test_corrupted_latest_checkpoint_falls_back_to_previous(tmp_path, monkeypatch, caplog, checksum):
    """Same-size corruption: the CRC32 (the default) lets discovery skip it, naming it; with
    LIGHTNING_NPU_CHECKSUM=0 only loading can tell, and TrainingGuard sets it aside."""
    if not checksum:
        monkeypatch.setenv("LIGHTNING_NPU_CHECKSUM", "0")
    ref = _reference(tmp_path, 8)
    root = tmp_path / "run"
    model, trainer, guard = _guarded(root, 6)
    guard.fit(trainer, model)
    newest = root / "ck" / "step=00000006.ckpt"
    data = bytearray(newest.read_bytes())
    data[100:400] = b"\0" * 300  # same size
    newest.write_bytes(bytes(data))
    model, trainer, guard = _guarded(root, 8)
    if checksum:
        with caplog.at_level("WARNING", logger="lightning_npu.callbacks.recovery"):
            guard.fit(trainer, model)
        assert f"{newest} is corrupted: its CRC32 differs" in caplog.text
        assert not [e for e in guard.events if e["event"] == "bad_checkpoint"], guard.events
    else:
        guard.fit(trainer, model)
        events = [e for e in guard.events if e["event"] == "bad_checkpoint"]
        assert len(events) == 1 and str(newest) in events[0]["reason"]
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=0, atol=0)


def test_sigterm_saves_exits_zero_and_resume_continues_the_loss_curve(tmp_path):
    ref = _reference(tmp_path, 10)
    root = tmp_path / "run"
    proc = subprocess.run([PY, str(SCRIPT), "--root", str(root), "--out", str(tmp_path / "pre.pt"), "--max-steps", "10",
                           "--interval", "100", "--signal-at", "5", "--preemption"],
                          env=script_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pre = torch.load(tmp_path / "pre.pt", weights_only=False)
    assert pre["global_step"] == 6
    assert DynamicCheckpoint.find_latest(root / "ck") == str(root / "ck" / "step=00000006.ckpt")
    model, trainer, guard = _guarded(root, 10, interval=100)
    guard.fit(trainer, model)
    losses = {**pre["losses"], **model.losses}
    assert sorted(model.losses) == [6, 7, 8, 9]
    assert losses == ref.losses
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=0, atol=0)


def test_rank_killed_under_torchrun_resumes_and_matches_uninterrupted(tmp_path):
    torchrun = Path(PY).parent / "torchrun"
    common = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2"]
    args = ["--devices", "2", "--strategy", "ddp", "--max-steps", "8", "--interval", "3"]
    ref = subprocess.run([str(torchrun), *common, str(SCRIPT), "--root", str(tmp_path / "ref"), "--out",
                          str(tmp_path / "ref.pt"), *args], env=script_env(), capture_output=True, text=True, timeout=180)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = subprocess.run([str(torchrun), *common, str(SCRIPT), "--root", str(tmp_path / "run"), "--out",
                          str(tmp_path / "run.pt"), *args, "--kill-at", "5", "--kill-flag", str(tmp_path / "killed")],
                         env=script_env(), capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "killed").exists()
    a, b = torch.load(tmp_path / "ref.pt", weights_only=False), torch.load(tmp_path / "run.pt", weights_only=False)
    assert b["restart"] == 1 and a["restart"] == 0
    torch.testing.assert_close(b["params"], a["params"], rtol=0, atol=0)
    assert sorted(b["losses"]) == [3, 4, 5, 6, 7]  # the restarted worker resumed at step 3
    log = [json.loads(l) for l in (tmp_path / "run" / "ck" / "recovery_log.jsonl").read_text().splitlines()]
    assert [e["event"] for e in log] == ["rank_failure", "restart"]  # rank 0 saw its peer vanish; then torchrun
    assert log[1]["elastic_restart"] == 1 and "step=00000003.ckpt" in log[1]["reason"]
