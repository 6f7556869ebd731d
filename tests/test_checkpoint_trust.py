"""Trust in checkpoints: loading never runs code, one commit path (atomic overwrite, async commits as soon as
written, cleanup of crashed saves), pruning scoped to the run, malformed markers skipped."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

import lightning_npu
from lightning_npu import NPUHybridStrategy
from lightning_npu.callbacks import DynamicCheckpoint, TrainingGuard, _store
from lightning_npu.callbacks.health import _read_rollback_checkpoint
from lightning_npu.parallel.checkpoint import commit
from lightning_npu.parallel.checkpoint.errors import UnsafeCheckpointError
from lightning_npu.parallel.checkpoint.safe_load import read_meta
from lightning_npu.parallel.checkpoint.sharded import consolidate_model_state
from tests._callbacks_helpers import StepSeeded, flat_params, script_env, trainer_kwargs
from tests._faults import Payload, plant_in_shard

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "commit_faults.py"


def _run(*args, timeout=240):
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=script_env(), capture_output=True, text=True,
                          timeout=timeout)


def _dyn(d, **kw):
    return DynamicCheckpoint(dirpath=str(d), phase_fractions=(), intervals=(2,), **kw)


# ---- security: a checkpoint never runs code when it is loaded ------------------------------------
class _Payload:
    """Unpickling it (weights_only=False, or plain pickle) creates the file `flag`."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __reduce__(self):
        return (open, (self.flag, "w"))


class _Module(StepSeeded):
    def __init__(self) -> None:
        super().__init__(lr_schedule=True)
        self.save_hyperparameters({"width": 16, "betas": (0.9, 0.95), "name": "tiny"})

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss


def test_planted_pickles_are_refused_by_fit_and_convert_checkpoint(tmp_path, capsys):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_npu.cli import main

    ck = tmp_path / "ck"
    trainer = L.Trainer(callbacks=[_dyn(ck), ModelCheckpoint(dirpath=str(tmp_path / "mc"), monitor="loss")],
                        strategy=NPUHybridStrategy(save_distributed_checkpoint=True), precision="bf16-mixed",
                        **trainer_kwargs(tmp_path, 4))
    trainer.fit(_Module())
    good = ck / "step=00000004.ckpt"
    # everything Lightning and we put in meta.pt loads as plain data
    meta = read_meta(good)
    assert {"loops", "callbacks", "lr_schedulers", "hyper_parameters", "HybridPrecision", "lightning_npu"} <= set(meta)
    assert meta["hyper_parameters"]["betas"] == (0.9, 0.95)

    flag = tmp_path / "payload-ran"
    bad_meta, bad_dcp = tmp_path / "bad_meta.ckpt", tmp_path / "bad_dcp.ckpt"
    shutil.copytree(good, bad_meta)
    shutil.copytree(good, bad_dcp)
    torch.save({**meta, "hyper_parameters": {"x": _Payload(str(flag))}}, bad_meta / "meta.pt")
    with open(good / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own, trusted file
    md.planner_data = _Payload(str(flag))
    with open(bad_dcp / ".metadata", "wb") as f:
        pickle.dump(md, f)

    for bad, name in ((bad_meta, "meta.pt"), (bad_dcp, ".metadata")):
        t = L.Trainer(callbacks=[_dyn(tmp_path / "ck2")], strategy=NPUHybridStrategy(), precision="bf16-mixed",
                      **trainer_kwargs(tmp_path / "resume", 6))
        with pytest.raises(UnsafeCheckpointError, match=f"Refused to load .*{name}.*may be malicious") as err:
            t.fit(_Module(), ckpt_path=str(bad))
        assert "open" in str(err.value)  # names what was refused
        out = tmp_path / f"{bad.name}.safetensors"
        with pytest.raises(SystemExit) as exit_:
            main(["convert-checkpoint", str(bad), str(out)])
        assert exit_.value.code != 0 and not out.exists()
        assert f"Refused to load '{bad / name}'" in capsys.readouterr().err
        assert not flag.exists(), f"the payload in {name} ran"

    # a single-file checkpoint resumed by npu_hybrid goes through the same refusal
    single = tmp_path / "single.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": _Payload(str(flag))}, single)
    t = L.Trainer(strategy=NPUHybridStrategy(), **trainer_kwargs(tmp_path / "resume", 6))
    with pytest.raises(UnsafeCheckpointError, match="Refused to load .*single.ckpt"):
        t.fit(_Module(), ckpt_path=str(single))
    assert not flag.exists()

    # the untouched checkpoint still resumes and converts
    model = _Module()
    t = L.Trainer(callbacks=[_dyn(tmp_path / "ck3")], strategy=NPUHybridStrategy(), precision="bf16-mixed",
                  **trainer_kwargs(tmp_path / "resume", 6))
    t.fit(model, ckpt_path=str(good))
    assert t.global_step == 6 and sorted(model.losses) == [4, 5]
    main(["convert-checkpoint", str(good), str(tmp_path / "good.safetensors")])
    assert (tmp_path / "good.safetensors").is_file()


def test_a_pickle_in_a_shard_entry_runs_on_no_path(tmp_path, capsys):
    """DCP's default planner unpickles a shard's non-tensor entries with weights_only=False; ours must not.
    (The 2-process `--ckpt_path latest` path is in test_cli.py.)"""
    from lightning_npu.cli import main

    ck = tmp_path / "ck"
    L.Trainer(callbacks=[_dyn(ck, keep_last_k=None)], strategy=NPUHybridStrategy(save_distributed_checkpoint=True),
              **trainer_kwargs(tmp_path, 4)).fit(_Module())
    newest = ck / "step=00000004.ckpt"
    flag = tmp_path / "payload-ran"
    shard, key = plant_in_shard(newest, Payload(str(flag)))

    t = L.Trainer(strategy=NPUHybridStrategy(), **trainer_kwargs(tmp_path / "resume", 6))
    with pytest.raises(UnsafeCheckpointError, match=f"Refused to load '{shard}' \\(its entry '{key}'\\).*malicious"):
        t.fit(_Module(), ckpt_path=str(newest))
    # the offline readers take tensors only, and a Lightning strategy's rollback reader is never reached
    assert lightning_npu.load_checkpoint(newest)["global_step"] == 4
    main(["convert-checkpoint", str(newest), str(tmp_path / "w.safetensors")])

    class ForeignStrategy:
        def load_checkpoint(self, *a, **k):
            raise AssertionError("the planted directory reached a reader that unpickles it")

    with pytest.raises(UnsafeCheckpointError, match=key):
        _read_rollback_checkpoint(ForeignStrategy(), str(newest))
    assert not flag.exists()

    # TrainingGuard refuses the planted checkpoint, sets it aside and resumes from the one before
    guard = TrainingGuard(max_restarts=1, restart_backoff=0)
    model = _Module()
    trainer = L.Trainer(callbacks=[_dyn(ck, keep_last_k=None), guard], strategy=NPUHybridStrategy(),
                        **trainer_kwargs(tmp_path / "guarded", 6))
    guard.fit(trainer, model)
    assert trainer.global_step == 6 and sorted(model.losses) == [2, 3, 4, 5]
    assert [e["event"] for e in guard.events][:2] == ["bad_checkpoint", "set_aside"], guard.events
    assert "UnsafeCheckpointError" in guard.events[0]["reason"]
    assert [p.name for p in (ck / "quarantine").glob("*/*.ckpt")] == [newest.name]
    assert not flag.exists(), "the payload in a shard entry ran"


# ---- markers ---------------------------------------------------------------------------------------------
def _fake(d: Path, step: int, run: str = "r", name: str | None = None) -> Path:
    tmp = d / f"src{step}"
    tmp.mkdir(parents=True)
    (tmp / "data.bin").write_bytes(bytes([step]) * 10)
    return _store.commit(tmp, d / (name or _store.checkpoint_name(step)), {"step": step, "run": run})


def test_malformed_markers_are_skipped_with_a_warning(tmp_path):
    d = tmp_path
    _fake(d, 2)
    _fake(d, 4)
    for name, text in [(".complete", "{}"), ("a.ckpt.complete", '{"step": "abc"}'), ("b.ckpt.complete", "[1, 2]"),
                       ("c.ckpt.complete", ""), ("d.ckpt.complete", '{"step": true}'),
                       ("gone.ckpt.complete", '{"step": 99}'), ("e.ckpt.complete", '{"step": 7, "files": [1]}')]:
        (d / name).write_text(text)
        if name[0] not in ".g":
            (d / name[: -len(".complete")]).mkdir()
    with pytest.warns(UserWarning) as record:
        assert [i.step for i in _store.list_complete(d)] == [2, 4]
    text = "\n".join(str(w.message) for w in record)
    for needle in ("stray checkpoint marker", "a.ckpt.complete", "'abc'", "b.ckpt.complete: it holds a list",
                   "c.ckpt.complete: it is unreadable", "gone.ckpt does not exist", "e.ckpt.complete"):
        assert needle in text, needle
    with pytest.warns(UserWarning):
        assert DynamicCheckpoint.find_latest(d) == str(d / "step=00000004.ckpt")
    with pytest.raises(_store.CheckpointCorruptedError, match="a.ckpt.complete is malformed"):
        _store.verify(d / "a.ckpt")
    # pruning walks the same directory without crashing
    dyn = _dyn(d, keep_last_k=1)
    dyn.run_id = "r"
    with pytest.warns(UserWarning):
        dyn._prune(type("T", (), {"is_global_zero": True})())
    assert not (d / "step=00000002.ckpt").exists() and (d / "step=00000004.ckpt").exists()


# ---- item 7: overwrite is atomic, whatever moment a crash strikes -----------------------------------------
# crash after the data went aside (its marker not yet) / after both went aside, before the rename (the case) /
# after the rename, before the new marker
@pytest.mark.parametrize("crash_at", [2, 3, "marker"])
def test_overwrite_interrupted_at_any_rename_leaves_the_old_checkpoint_loadable(tmp_path, monkeypatch, crash_at):
    d = tmp_path
    _fake(d, 4)
    new = commit.temp_path(d / "step=00000004.ckpt", commit.new_token())  # a write that finished, never committed
    new.mkdir()
    (new / "data.bin").write_bytes(b"\xff" * 10)
    calls = []
    real_move, real_write = commit._move, commit._write_json_atomic

    def move(src, dst):
        calls.append(src)
        if len(calls) == crash_at:
            raise KeyboardInterrupt("crash")
        real_move(src, dst)

    def write_marker(path, payload):
        if crash_at == "marker":
            raise KeyboardInterrupt("crash")
        real_write(path, payload)

    monkeypatch.setattr(commit, "_move", move)
    monkeypatch.setattr(commit, "_write_json_atomic", write_marker)
    with pytest.raises(KeyboardInterrupt):
        commit.commit(new, d / "step=00000004.ckpt", commit.new_token(), {"step": 4, "run": "r"})
    monkeypatch.undo()
    latest = _store.latest_complete(d)
    assert latest is not None and latest.name.startswith(".old-step=00000004.ckpt-"), sorted(p.name for p in d.iterdir())
    assert (latest / "data.bin").read_bytes() == bytes([4]) * 10  # the old, complete data
    _store.verify(latest, _store.list_complete(d)[-1].meta)
    # the aside copy is the only good one: cleanup keeps it; the next commit of that name retires it
    assert not [p for p in commit.clean_stale(d) if p.name.startswith(".old-")]
    _fake(d, 4)
    commit.clean_stale(d)
    assert sorted(p.name for p in d.iterdir()) == ["step=00000004.ckpt", "step=00000004.ckpt.complete"]


def _age(path: Path, seconds: float) -> None:
    """Date `path` (and what it holds) `seconds` back: the leftover of a crash that long ago."""
    t = time.time() - seconds
    for p in [path, *(path.rglob("*") if path.is_dir() else [])]:
        os.utime(p, (t, t))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_clean_stale_spares_live_saves(tmp_path):
    final = tmp_path / "x.ckpt"
    other_host = f"{int(commit._HOST_TAG, 16) ^ 1:04x}"
    live = commit.new_token()  # held: a save in flight in this process
    ours_dead = commit.new_token()  # this process, not held: a save of an earlier attempt that crashed
    pid_dead = f"{_dead_pid()}-{commit._HOST_TAG}beef"  # a process of this host that is gone
    pid_alive = f"{os.getppid()}-{commit._HOST_TAG}beef"  # another process of this host that still runs
    foreign = f"{os.getpid()}-{other_host}beef"  # another host: only its age tells
    foreign_old = f"{os.getpid() + 1}-{other_host}cafe"
    for token in (live, ours_dead, pid_dead, pid_alive, foreign, foreign_old):
        commit.temp_path(final, token).mkdir()
        (commit.temp_path(final, token) / "shard").write_bytes(b"x")
    _age(commit.temp_path(final, foreign_old), commit.STALE_AFTER_S + 5)
    commit.hold(live)
    try:
        removed = commit.clean_stale(tmp_path)
        assert sorted(removed) == sorted(commit.temp_path(final, t) for t in (ours_dead, pid_dead, foreign_old))
        for token in (live, pid_alive, foreign):
            assert commit.temp_path(final, token).exists()
    finally:
        commit.release(live)


# ---- item 5: a new run in a reused directory keeps its own checkpoints -----------------------------------
def test_new_run_in_reused_directory_prunes_only_its_own(tmp_path):
    d = tmp_path / "ck"
    L.Trainer(callbacks=[_dyn(d, keep_last_k=2)], **trainer_kwargs(tmp_path / "a", 10)).fit(StepSeeded())
    old = [p.name for p in d.iterdir() if not p.name.endswith(".complete")]
    assert sorted(old) == ["step=00000008.ckpt", "step=00000010.ckpt"]
    dyn = _dyn(d, keep_last_k=2)
    L.Trainer(callbacks=[dyn], **trainer_kwargs(tmp_path / "b", 6)).fit(StepSeeded())
    steps = {i.step: i.meta["run"] for i in _store.list_complete(d)}
    assert sorted(steps) == [4, 6, 8, 10], steps  # the new run kept its last 2; the old run's are untouched
    assert steps[4] == steps[6] == dyn.run_id != steps[8]
    # a run resumed from a checkpoint continues that run: same id, prunes its older checkpoints
    resumed = _dyn(d, keep_last_k=2)
    L.Trainer(callbacks=[resumed], **trainer_kwargs(tmp_path / "c", 10)).fit(StepSeeded(),
                                                                             ckpt_path=str(d / "step=00000006.ckpt"))
    assert resumed.run_id == dyn.run_id
    assert sorted(i.step for i in _store.list_complete(d) if i.meta["run"] == dyn.run_id) == [8, 10]


# ---- item 6: async saves with npu_hybrid -------------------------------------------------------------------
def test_failed_async_write_removes_its_temp_dir_and_setup_cleans_crashed_leftovers(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    d = tmp_path / "ck"
    d.mkdir()
    stale_tmp = d / ".tmp-step=00000099.ckpt-1-deadbeef"
    legacy_tmp = d / "..tmp-step=00000098.ckpt-1-deadbeef.tmp-0123456789ab"
    for p in (stale_tmp, legacy_tmp):
        p.mkdir()
    _fake(d, 50, run="other")
    done_aside = d / ".old-step=00000050.ckpt-1-deadbeef"  # its overwrite completed: a leftover
    done_aside.mkdir()
    _fake(d, 60, run="other", name=".old-step=00000060.ckpt-1-cafebabe")  # the only copy of step 60: kept
    for p in (stale_tmp, legacy_tmp, done_aside, d / ".old-step=00000060.ckpt-1-cafebabe"):
        _age(p, commit.STALE_AFTER_S + 5)  # crashes long ago, of processes that cannot be told dead otherwise

    real = FileSystemWriter.write_data

    def failing(self, plan, planner):
        if "step=00000004" in str(self.path):
            raise OSError(28, "No space left on device")
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", failing)
    trainer = L.Trainer(callbacks=[_dyn(d, keep_last_k=None)], strategy=NPUHybridStrategy(async_save=True),
                        **trainer_kwargs(tmp_path, 6))
    with pytest.raises(Exception, match="step=00000004.ckpt.*No space left"):
        trainer.fit(StepSeeded())
    names = sorted(p.name for p in d.iterdir())
    assert not [n for n in names if "tmp-" in n], names  # the failed write's temp dir and the stale ones
    assert not done_aside.exists() and (d / ".old-step=00000060.ckpt-1-cafebabe").exists()
    assert "step=00000002.ckpt.complete" in names and "step=00000004.ckpt" not in names


def test_async_checkpoint_is_visible_once_written_and_survives_a_killed_rank(tmp_path):
    proc = _run("--root", str(tmp_path), "--mode", "async_kill")
    assert proc.returncode != 0, proc.stdout[-2000:]  # rank 1 was killed; rank 0 failed on its next collective
    visible = json.loads((tmp_path / "visible.json").read_text())
    assert visible["visible"], (visible, proc.stderr[-3000:])  # during step 3, before the step-4 save
    ck = tmp_path / "ck"
    assert DynamicCheckpoint.find_latest(ck) == str(ck / "step=00000002.ckpt")
    tensors, meta = consolidate_model_state(ck / "step=00000002.ckpt")
    assert meta["global_step"] == 2 and tensors
    assert not [p for p in ck.iterdir() if "tmp-" in p.name or ".old-" in p.name]


def test_crash_between_aside_and_rename_leaves_a_loadable_checkpoint(tmp_path):
    ref = StepSeeded()
    L.Trainer(strategy=NPUHybridStrategy(), **trainer_kwargs(tmp_path / "ref", 6)).fit(ref)
    root = tmp_path / "run"
    first = _run("--root", str(root), "--mode", "plain", "--max-steps", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    ck = root / "ck"
    crashed = _run("--root", str(root), "--mode", "overwrite_crash", "--max-steps", "4",
                   "--ckpt-path", str(ck / "step=00000002.ckpt"))
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    assert not (ck / "step=00000004.ckpt").exists()  # the crash struck between the two renames
    latest = DynamicCheckpoint.find_latest(ck)
    assert latest is not None and Path(latest).name.startswith(".old-step=00000004.ckpt-")
    model = StepSeeded()
    trainer = L.Trainer(callbacks=[_dyn(ck, keep_last_k=None)], strategy=NPUHybridStrategy(),
                        **trainer_kwargs(root, 6))
    trainer.fit(model, ckpt_path=latest)
    assert sorted(model.losses) == [4, 5]
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=0, atol=0)
