"""DynamicCheckpoint: the schedule, atomic commits, rotation, discovery of the latest complete checkpoint."""

from __future__ import annotations

import zlib
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_npu.callbacks import CheckpointCorruptedError, DynamicCheckpoint, _store
from tests._callbacks_helpers import StepSeeded, flat_params, trainer_kwargs

REPO = Path(__file__).resolve().parents[1]


def test_default_schedule_exact_steps():
    cb = DynamicCheckpoint()
    # phase 1 (<= 10% = 1000): every 500; phase 2 (<= 80% = 8000): every 2000; then every 5000; + train end
    assert cb.schedule(10_000) == [500, 1000, 2000, 4000, 6000, 8000, 10_000]
    assert cb.schedule(12_000) == [500, 1000, 2000, 4000, 6000, 8000, 10_000, 12_000]
    assert cb.schedule(3) == [3]
    assert DynamicCheckpoint(save_on_train_end=False).schedule(999) == []  # 500 falls in phase 2 (> 99.9)
    assert DynamicCheckpoint(save_on_train_end=False).schedule(5000) == [500, 2000, 4000, 5000]


def test_custom_schedule_exact_steps():
    cb = DynamicCheckpoint(phase_fractions=(0.25, 0.5), intervals=(2, 5, 10), save_on_train_end=False)
    # <= 10: every 2; <= 20: every 5; > 20: every 10
    assert cb.schedule(40) == [2, 4, 6, 8, 10, 15, 20, 30, 40]
    assert DynamicCheckpoint(phase_fractions=(), intervals=(3,)).schedule(10) == [3, 6, 9, 10]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(phase_fractions=(0.8, 0.1)), "phase_fractions=[0.8, 0.1]"),
        (dict(phase_fractions=(0.1, 1.5)), "phase_fractions"),
        (dict(intervals=(500, 2000)), "intervals=[500, 2000]"),
        (dict(intervals=(500, 0, 10)), "positive integers"),
        (dict(keep_last_k=0), "keep_last_k=0"),
    ],
)
def test_bad_arguments_name_argument_and_value(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        DynamicCheckpoint(**kwargs)


def _fit(tmp_path, max_steps, cb, trainer_kw=None, **module_kw):
    model = StepSeeded(**module_kw)
    trainer = L.Trainer(callbacks=[cb], **trainer_kwargs(tmp_path, max_steps, **(trainer_kw or {})))
    trainer.fit(model)
    return model, trainer


def test_saves_on_schedule_rotates_and_resumes_latest(tmp_path):
    d = tmp_path / "ck"
    cb = DynamicCheckpoint(dirpath=str(d), phase_fractions=(0.5,), intervals=(2, 3), keep_last_k=2)
    assert cb.schedule(10) == [2, 4, 6, 9, 10]
    model, _ = _fit(tmp_path, 10, cb)
    kept = sorted(p.name for p in d.iterdir())
    assert kept == [
        "step=00000009.ckpt", "step=00000009.ckpt.complete", "step=00000010.ckpt", "step=00000010.ckpt.complete"
    ]
    latest = DynamicCheckpoint.find_latest(d)
    assert latest == str(d / "step=00000010.ckpt")
    ckpt = torch.load(latest, weights_only=False)
    assert ckpt["global_step"] == 10
    final = flat_params(model)
    saved = torch.cat([v.flatten() for v in ckpt["state_dict"].values()])
    torch.testing.assert_close(saved, final, rtol=0, atol=0)


def test_resume_from_last_equals_uninterrupted(tmp_path):
    """Lightning's `ckpt_path="last"` resumes from DynamicCheckpoint's newest complete checkpoint, and the
    callback answers ModelCheckpoint's questions (`trainer.checkpoint_callback.best_model_path`, ...)."""
    ref, _ = _fit(tmp_path / "ref", 8, DynamicCheckpoint(dirpath=str(tmp_path / "ref_ck"), phase_fractions=(), intervals=(4,)))
    first_cb = DynamicCheckpoint(dirpath=str(tmp_path / "ck"), phase_fractions=(), intervals=(4,),
                                 save_on_train_end=False)
    first, trainer = _fit(tmp_path / "a", 5, first_cb)
    latest = DynamicCheckpoint.find_latest(tmp_path / "ck")
    assert latest == str(tmp_path / "ck" / "step=00000004.ckpt")
    assert trainer.checkpoint_callback is first_cb and trainer.checkpoint_callbacks == [first_cb]
    assert first_cb.best_model_path == first_cb.last_model_path == latest and first_cb.filename == "{step:08d}"
    # an unmarked (never committed) newer "last.ckpt" is not what "last" picks
    (tmp_path / "ck" / "last.ckpt").write_bytes(b"not a checkpoint")
    model = StepSeeded()
    cb = DynamicCheckpoint(dirpath=str(tmp_path / "ck"), phase_fractions=(), intervals=(4,))
    trainer = L.Trainer(callbacks=[cb], **trainer_kwargs(tmp_path / "b", 8))
    trainer.fit(model, ckpt_path="last")
    assert trainer.ckpt_path == latest
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=0, atol=0)
    assert model.losses == {s: ref.losses[s] for s in range(4, 8)}
    assert cb.best_model_path == cb.last_model_path == str(tmp_path / "ck" / "step=00000008.ckpt")
    assert trainer.checkpoint_callback.best_model_path == cb.best_model_path  # the idiom the docs use


def test_filename_template_and_no_epoch_end_saves(tmp_path):
    # ModelCheckpoint's template meaning; saving follows the step schedule only (no save at each epoch's end)
    d = tmp_path / "ck"
    cb = DynamicCheckpoint(dirpath=str(d), filename="{epoch}-{step}", phase_fractions=(), intervals=(3,),
                           keep_last_k=None)
    _fit(tmp_path, 7, cb, trainer_kw=dict(limit_train_batches=4))
    names = sorted(p.name for p in d.glob("*.ckpt"))
    # train end: Lightning counts the epoch that max_steps cut short as finished (trainer.current_epoch)
    assert names == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "epoch=2-step=7.ckpt"], names
    assert DynamicCheckpoint.find_latest(d) == cb.last_model_path == str(d / "epoch=2-step=7.ckpt")
    with pytest.raises(ValueError, match="filename='ck/x'.*dirpath="):
        DynamicCheckpoint(filename="ck/x")


def test_truncated_checkpoint_is_named_and_skipped(tmp_path):
    d = tmp_path / "ck"
    _fit(tmp_path, 6, DynamicCheckpoint(dirpath=str(d), phase_fractions=(), intervals=(2,), keep_last_k=None))
    newest = d / "step=00000006.ckpt"
    with open(newest, "r+b") as f:
        f.truncate(newest.stat().st_size // 2)
    with pytest.raises(CheckpointCorruptedError, match="step=00000006.ckpt is truncated"):
        _store.verify(newest)
    with pytest.warns(UserWarning, match="step=00000006.ckpt"):
        assert DynamicCheckpoint.find_latest(d) == str(d / "step=00000004.ckpt")
    # a checkpoint without its completion marker (interrupted commit) is not a candidate
    (d / "step=00000004.ckpt.complete").unlink()
    with pytest.warns(UserWarning):
        assert DynamicCheckpoint.find_latest(d) == str(d / "step=00000002.ckpt")


def test_checksum_catches_same_size_corruption(tmp_path):
    d = tmp_path / "ck"
    _fit(tmp_path, 4, DynamicCheckpoint(dirpath=str(d), phase_fractions=(), intervals=(2,), checksum=True))
    newest = d / "step=00000004.ckpt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptedError, match="step=00000004.ckpt is corrupted"):
        _store.verify(newest)
    with pytest.warns(UserWarning):
        assert DynamicCheckpoint.find_latest(d) == str(d / "step=00000002.ckpt")


def test_directory_checkpoints_are_committed_whole(tmp_path):
    """Sharded strategies write directories: completeness covers every file inside."""
    src = tmp_path / "tmpdir"
    (src / "shards").mkdir(parents=True)
    (src / "shards" / "0.distcp").write_bytes(b"x" * 10)
    (src / ".metadata").write_bytes(b"y" * 3)
    final = _store.commit(src, tmp_path / "step=00000007.ckpt", {"step": 7})
    assert not src.exists() and final.is_dir()
    # sizes and CRC32s by default (checksum=False: sizes only)
    crc = {name: f"{zlib.crc32(data):08x}" for name, data in (("shards/0.distcp", b"x" * 10), (".metadata", b"y" * 3))}
    assert _store.verify(final)["files"] == {".metadata": {"size": 3, "crc32": crc[".metadata"]},
                                             "shards/0.distcp": {"size": 10, "crc32": crc["shards/0.distcp"]}}
    other = tmp_path / "other"
    other.mkdir()
    (tmp_path / "sizes_only").mkdir()
    (other / "a").write_bytes(b"z")
    unchecked = _store.commit(other, tmp_path / "sizes_only" / "step=00000008.ckpt", {"step": 8}, checksum=False)
    assert _store.verify(unchecked)["files"] == {"a": {"size": 1}}
    (final / "shards" / "0.distcp").write_bytes(b"x" * 4)
    with pytest.raises(CheckpointCorruptedError, match="0.distcp"):
        _store.verify(final)
    assert _store.latest_complete(tmp_path) is None


def test_async_save_commits_after_the_write(tmp_path):
    d = tmp_path / "ck"
    model, trainer = _fit(tmp_path, 6, DynamicCheckpoint(dirpath=str(d), phase_fractions=(), intervals=(2,), async_save=True,
                                                        keep_last_k=None))
    assert [i.step for i in _store.list_complete(d)] == [2, 4, 6]
    ckpt = torch.load(d / "step=00000006.ckpt", weights_only=False)
    saved = torch.cat([v.flatten() for v in ckpt["state_dict"].values()])
    torch.testing.assert_close(saved, flat_params(model), rtol=0, atol=0)
    assert not [p for p in d.iterdir() if p.name.startswith(".tmp-")]
