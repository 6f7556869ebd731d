"""Fault injection against checkpoints (issue #34): damaged files are never loaded silently and each gives one
clear error naming the file, on every path; a save that fails on one rank fails on all of them at once; kill -9 at
the commit's steps leaves nothing that the next start does not clean; a checkpoint saved after `fit()` continues
the data exactly.

Two processes run once (`campaign`, tests/_checkpoint_fault_workers.py) for every multi-rank check; the kill -9
and exit checks are real processes of tests/scripts/commit_faults.py, started together."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

import lightning_npu
from lightning_npu import NPUHybridStrategy
from lightning_npu.callbacks import CheckpointCorruptedError, DynamicCheckpoint, _store
from lightning_npu.cli import main
from lightning_npu.launch import spawn
from lightning_npu.parallel.checkpoint import commit
from lightning_npu.parallel.checkpoint.errors import CheckpointLoadError
from tests._callbacks_helpers import StepSeeded, script_env, trainer_kwargs
from tests._checkpoint_fault_workers import campaign

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "commit_faults.py"
KINDS = ("flipped", "swapped", "truncated", "deleted")


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    """The real-process faults, started together (they overlap with the spawned campaign's start-up)."""
    root = tmp_path_factory.mktemp("scripts")
    procs = {}
    for mode in ("rename_crash", "prune_crash", "marker_full"):
        (root / mode).mkdir()
        procs[mode] = subprocess.Popen([sys.executable, str(SCRIPT), "--root", str(root / mode), "--mode", mode,
                                        "--max-steps", "6"], env=script_env(), stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, text=True)
    yield {"root": root, "procs": procs}
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()


def _finished(scripts, mode):
    proc = scripts["procs"][mode]
    _, err = proc.communicate(timeout=240)
    return proc.returncode, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory, scripts):
    root = tmp_path_factory.mktemp("campaign")
    ranks = spawn(campaign, 2, str(root))
    return {"root": root, "ranks": ranks}


# ---- exact continuation after fit ------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["after_fit_dp2", "after_fit_tp2", "after_fit_pp2", "after_fit_zero3"])
def test_a_checkpoint_saved_after_fit_continues_the_data_exactly(runs, layout):
    """`trainer.save_checkpoint()` once fit(max_steps=k) returned, resumed by fit(max_steps=n): the same losses and
    samples as n uninterrupted steps (Lightning counts the cut epoch as finished and would start the next one)."""
    for rank in runs["ranks"]:
        run = rank[layout]
        n = len(run["resumed"])
        assert n and run["resumed"] == run["full"][-n:], (run["resumed"], run["full"])
        assert run["samples_resumed"] == run["samples_full"][-n:]
    assert runs["ranks"][0][layout]["is_dir"] == (layout in ("after_fit_dp2", "after_fit_pp2"))  # both forms
    samples = [r[layout]["samples_full"] for r in runs["ranks"]]
    # dp ranks read their own samples; tp and pp ranks the same ones
    assert (samples[0] != samples[1]) == (layout in ("after_fit_dp2", "after_fit_zero3"))


# ---- damaged shards ----------------------------------------------------------------------------------------
def test_every_file_is_recorded_with_size_and_crc32(runs):
    marker = runs["ranks"][0]["saved_markers"]
    assert marker["checksum"] is True
    assert sorted(marker["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert all(set(e) == {"size", "crc32"} for e in marker["files"].values())


def test_damaged_shards_are_skipped_by_discovery_and_refused_when_named(runs, capsys):
    damaged = runs["ranks"][0]["damaged"]
    for rank in runs["ranks"]:  # both ranks, the same verdict
        for kind in KINDS:
            assert rank["found"][kind] == str(runs["root"] / "damaged" / kind / "step=00000004.ckpt"), kind
    # an explicit resume on 2 ranks: one error, the same on both, naming the shard
    errors = {r["resume_flipped"] for r in runs["ranks"]}
    assert len(errors) == 1
    (error,) = errors
    assert error.startswith("CheckpointCorruptedError") and damaged["flipped"] in error and "CRC32" in error
    why = {"flipped": "CRC32", "swapped": "CRC32", "truncated": "truncated", "deleted": "missing"}
    for kind, shard in damaged.items():
        path = runs["root"] / "damaged" / kind / "step=00000006.ckpt"
        with pytest.raises(CheckpointCorruptedError, match=why[kind]) as err:
            lightning_npu.load_checkpoint(path)
        assert shard in str(err.value)
        with pytest.raises(SystemExit) as exit_:
            main(["convert-checkpoint", str(path), str(runs["root"] / f"{kind}.pt")])
        assert exit_.value.code == 2 and not (runs["root"] / f"{kind}.pt").exists()
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and shard in lines[0] and "Traceback" not in lines[0], lines
    # the good one still converts
    main(["convert-checkpoint", str(runs["root"] / "damaged" / "flipped" / "step=00000004.ckpt"),
          str(runs["root"] / "good.pt")])
    assert torch.load(runs["root"] / "good.pt", weights_only=True)


def test_a_save_failing_on_one_rank_fails_on_every_rank_at_once(runs):
    """Disk full at rank 0's marker, at rank 1's shard, at rank 0's meta.pt: the same CheckpointSaveError on both
    ranks within seconds (not gloo's "Connection closed by peer" after a 60 s barrier), nothing left behind."""
    by_phase = {phase: [r["save_failures"][phase] for r in runs["ranks"]] for phase in ("marker", "shard", "meta")}
    where = {"marker": "failed on rank 0", "shard": "failed on rank(s) [1]", "meta": "failed on rank 0"}
    for phase, results in by_phase.items():
        assert results[0]["error"] == results[1]["error"], results
        assert results[0]["error"].startswith("CheckpointSaveError") and where[phase] in results[0]["error"]
        assert "No space left on device" in results[0]["error"]
        assert max(r["seconds"] for r in results) < 30, results
        assert results[0]["left"] == [], results  # rank 0's marker failure puts the previous state back


def test_a_failed_async_commit_is_raised_on_every_rank_at_the_next_step(runs):
    """The step-2 async save's commit fails at rank 0's marker; its write finished by step 3's end: the same
    CheckpointSaveError on both ranks by then (not at the next save, nor at the end of fit: step 8), nothing left."""
    for name in ("hybrid", "ddp"):
        results = [r["async_failures"][name] for r in runs["ranks"]]
        assert results[0]["error"] == results[1]["error"], results
        assert results[0]["error"].startswith("CheckpointSaveError") and "No space left on device" in results[0]["error"]
        assert "step=00000002.ckpt" in results[0]["error"] and "rank 0" in results[0]["error"], results
        assert results[0]["step"] == results[1]["step"] <= 3, results  # 2: the write was done by the save's poll
        assert results[0]["left"] == [], results


def test_a_failed_save_exits_every_rank_promptly(scripts):
    """Lightning's launcher, 2 processes: both raise the same error and leave at once (the process groups' shutdown
    does not wait out its 60 s barrier for a peer stuck in a collective)."""
    code, err = _finished(scripts, "marker_full")
    assert code != 0 and "Connection closed by peer" not in err, err[-3000:]
    root = scripts["root"] / "marker_full"
    exits = [json.loads((root / f"exit{r}.json").read_text()) for r in (0, 1)]
    assert exits[0]["error"] == exits[1]["error"] and "CheckpointSaveError" in exits[0]["error"], exits
    assert max(e["exit_s"] for e in exits) < 20, exits
    assert sorted(p.name for p in (root / "ck").iterdir()) == ["step=00000002.ckpt", "step=00000002.ckpt.complete"]


# ---- kill -9 at the commit's steps, and the next start -----------------------------------------------------------
def test_leftovers_of_killed_commits_are_cleaned_at_the_next_start(scripts, tmp_path, monkeypatch, caplog):
    for mode in ("rename_crash", "prune_crash"):
        code, err = _finished(scripts, mode)
        assert code == -signal.SIGKILL, err[-3000:]
    renamed, pruned = scripts["root"] / "rename_crash" / "ck", scripts["root"] / "prune_crash" / "ck"
    # the kill struck after the rename (no marker) / after the prune unmarked step 2 and removed one of its files
    assert (renamed / "step=00000004.ckpt").is_dir() and not (renamed / "step=00000004.ckpt.complete").exists()
    assert (pruned / "step=00000002.ckpt").is_dir() and not (pruned / "step=00000002.ckpt.complete").exists()
    assert len(list((pruned / "step=00000002.ckpt").iterdir())) == 2
    for ck, good in ((renamed, "step=00000002.ckpt"), (pruned, "step=00000004.ckpt")):
        assert DynamicCheckpoint.find_latest(ck) == str(ck / good)
    # a live commit marks its checkpoint milliseconds after the rename: only one unmarked for a while is a leftover
    in_flight = shutil.copytree(renamed, tmp_path / "in_flight", copy_function=shutil.copyfile)  # written just now
    assert commit.clean_leftovers(in_flight, _store.CHECKPOINT_NAME) == []
    monkeypatch.setattr(commit, "UNMARKED_AFTER_S", 0.0)  # the restart came later
    for ck, good, stale in ((renamed, "step=00000002.ckpt", "step=00000004.ckpt"),
                            (pruned, "step=00000004.ckpt", "step=00000002.ckpt")):
        caplog.clear()
        with caplog.at_level("WARNING", logger="lightning_npu.callbacks.dynamic_checkpoint"):
            trainer = L.Trainer(callbacks=[DynamicCheckpoint(dirpath=str(ck), phase_fractions=(), intervals=(2,),
                                                             keep_last_k=None, save_on_train_end=False)],
                                strategy=NPUHybridStrategy(save_distributed_checkpoint=True),
                                **trainer_kwargs(ck.parent / "next", 6))
            trainer.fit(StepSeeded(), ckpt_path=str(ck / good))
        lines = [r.getMessage() for r in caplog.records if "leftover" in r.getMessage()]
        assert len(lines) == 1 and stale in lines[0], lines
        names = sorted(p.name for p in ck.iterdir())
        assert not [n for n in names if n.startswith(".")], names
        assert all(f"{n}.complete" in names for n in names if not n.endswith(".complete")), names


# ---- one process: files without a marker (older versions, Lightning's own), opt-out --------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("one")
    for form in ("dir", "file"):
        L.Trainer(callbacks=[DynamicCheckpoint(dirpath=str(root / form), phase_fractions=(), intervals=(2,))],
                  strategy=NPUHybridStrategy(save_distributed_checkpoint=form == "dir"),
                  **trainer_kwargs(root / f"{form}_run", 2)).fit(StepSeeded())
    return root


def _unmarked_copy(src: Path, dst: Path) -> Path:
    (shutil.copytree if src.is_dir() else shutil.copyfile)(src, dst)
    return dst


def test_damaged_files_without_a_marker_give_one_clear_error_on_every_path(saved, tmp_path, capsys):
    ckpt_dir, ckpt_file = saved / "dir" / "step=00000002.ckpt", saved / "file" / "step=00000002.ckpt"
    cases = {}
    empty = _unmarked_copy(ckpt_file, tmp_path / "empty.ckpt")
    empty.write_bytes(b"")
    cases["empty file"] = (empty, empty, "it is empty")
    no_meta = _unmarked_copy(ckpt_dir, tmp_path / "empty_meta.ckpt")
    (no_meta / "meta.pt").write_bytes(b"")
    cases["empty meta.pt"] = (no_meta, no_meta / "meta.pt", "it is empty")
    truncated = _unmarked_copy(ckpt_dir, tmp_path / "truncated.ckpt")
    shard = truncated / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    cases["truncated shard"] = (truncated, shard, "truncated or corrupt")
    metadata = _unmarked_copy(ckpt_dir, tmp_path / "metadata.ckpt")
    data = bytearray((metadata / ".metadata").read_bytes())
    data[10:200] = os.urandom(190)
    (metadata / ".metadata").write_bytes(bytes(data))
    cases["corrupted .metadata"] = (metadata, metadata / ".metadata", "truncated or corrupt")
    for name, (path, file, why) in cases.items():
        assert commit.find_marker(path) is None  # an older version's checkpoint: loaded unverified
        with pytest.raises(CheckpointLoadError, match=why) as err:  # never EOFError / UnicodeDecodeError
            lightning_npu.load_checkpoint(path)
        assert str(file) in str(err.value), name
        trainer = L.Trainer(strategy=NPUHybridStrategy(), **trainer_kwargs(tmp_path / "resume", 4))
        with pytest.raises(CheckpointLoadError, match=why) as err:
            trainer.fit(StepSeeded(), ckpt_path=str(path))
        assert str(file) in str(err.value), name
        with pytest.raises(SystemExit):
            main(["convert-checkpoint", str(path), str(tmp_path / "out.pt")])
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and str(file) in lines[0], (name, lines)


def test_checkpoints_without_a_marker_load_and_the_checksum_opt_out(saved, tmp_path, monkeypatch):
    for form in ("dir", "file"):
        copy = _unmarked_copy(saved / form / "step=00000002.ckpt", tmp_path / f"{form}.ckpt")
        assert lightning_npu.load_checkpoint(copy)["global_step"] == 2
        model = StepSeeded()
        L.Trainer(strategy=NPUHybridStrategy(), **trainer_kwargs(tmp_path / form, 4)).fit(model, ckpt_path=str(copy))
        assert sorted(model.losses) == [2, 3]
    # LIGHTNING_NPU_CHECKSUM=0: sizes only, recorded and checked
    monkeypatch.setenv(commit.CHECKSUM_ENV, "0")
    ck = tmp_path / "sizes"
    L.Trainer(callbacks=[DynamicCheckpoint(dirpath=str(ck), phase_fractions=(), intervals=(2,))],
              strategy=NPUHybridStrategy(save_distributed_checkpoint=True), **trainer_kwargs(tmp_path, 2)).fit(StepSeeded())
    marker = json.loads((ck / "step=00000002.ckpt.complete").read_text())
    assert marker["checksum"] is False and all(set(e) == {"size"} for e in marker["files"].values())
    with open(ck / "step=00000002.ckpt" / "meta.pt", "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointCorruptedError, match="meta.pt is truncated"):
        lightning_npu.load_checkpoint(ck / "step=00000002.ckpt")
