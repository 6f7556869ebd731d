"""The `lightning-npu` command line: the README's main job (2 CPU processes, shortened), help texts,
`--ckpt_path latest`."""

import inspect
import os
import subprocess
import sys
import time
from pathlib import Path

import docstring_parser
import pytest

from lightning_npu import NPUHybridStrategy, cli
from tests._callbacks_helpers import clean_env
from tests._faults import Payload, plant_in_shard

ROOT = Path(__file__).resolve().parents[1]


def test_cli_fit_trains_logs_and_checkpoints(tmp_path):
    cli = Path(sys.executable).with_name("lightning-npu")
    cmd = [str(cli)] if cli.exists() else [sys.executable, "-m", "lightning_npu.cli"]
    cmd += [
        "fit",
        "--config", str(ROOT / "examples/gpt/config.yaml"),
        "--trainer.max_steps", "12",
        "--trainer.val_check_interval", "6",
        "--trainer.limit_val_batches", "2",
        "--trainer.default_root_dir", str(tmp_path),
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        "--trainer.callbacks.dirpath", str(tmp_path / "ckpt"),
        "--trainer.callbacks.every_n_train_steps", "6",
        "--model.init_args.n_layer", "2",
        "--model.init_args.n_embd", "32",
        "--data.init_args.block_size", "32",
        "--model.init_args.block_size", "32",
    ]
    env = clean_env()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Starting with 2 processes" in out
    assert "`Trainer.fit` stopped: `max_steps=12` reached." in out
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt")), out[-2000:]
    assert "not recommended to provide both args and command line arguments" not in out


def _run(args, tmp_path, timeout=300):
    cli = Path(sys.executable).with_name("lightning-npu")
    cmd = ([str(cli)] if cli.exists() else [sys.executable, "-m", "lightning_npu.cli"]) + args
    env = clean_env()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def test_help_lists_every_subcommand_without_lightnings_args_warning(tmp_path):
    # run as the console script runs (sys.argv holds the arguments): the warning came from passing them twice
    rc, out = _run(["--help"], tmp_path)
    assert rc == 0, out
    listing = out[out.index("Available subcommands"):]
    for name in ("fit", "validate", "test", "predict", *cli.COMMANDS):
        assert f"\n    {name} " in listing, (name, listing)
    assert out.startswith("usage: lightning-npu")
    assert "not recommended to provide both args and command line arguments" not in out


@pytest.mark.parametrize("name", ["npu_hybrid", "NPUHybridStrategy", "lightning_npu.NPUHybridStrategy"])
def test_strategy_help_describes_every_argument(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["fit", "--trainer.strategy.help", name])
    out = capsys.readouterr().out
    assert exit_.value.code == 0, out
    assert "Help for --trainer.strategy.help=lightning_npu.NPUHybridStrategy" in out
    documented = {p.arg_name: p.description for p in docstring_parser.parse(NPUHybridStrategy.__doc__).params}
    arguments = [a for a in inspect.signature(NPUHybridStrategy.__init__).parameters if a != "self"]
    assert sorted(documented) == sorted(arguments)  # every argument has an Args: entry, and nothing else
    flat = " ".join(out.split())
    for arg in arguments:
        assert f"--trainer.strategy.{arg} " in out, arg
        first_words = " ".join(documented[arg].split()[:4])
        assert first_words in flat, (arg, first_words)  # jsonargparse shows the description
    assert "ARCHITECTURE" not in NPUHybridStrategy.__doc__


def test_version(capsys):
    import lightning
    import torch

    import lightning_npu

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == (
        f"lightning-npu {lightning_npu.__version__} (lightning {lightning.__version__}, torch {torch.__version__})")


def test_fit_help_documents_ckpt_path_latest(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["fit", "--help"])
    flat = " ".join(capsys.readouterr().out.split())
    assert exit_.value.code == 0
    assert '--ckpt_path CKPT_PATH "latest" (lightning-npu): the newest complete checkpoint' in flat
    assert '"last" (Lightning): the newest of DynamicCheckpoint\'s checkpoints' in flat


def _commit_dynamic(dirpath, step):
    from lightning_npu.callbacks import _store

    tmp = dirpath / f".staging-{step}"
    tmp.mkdir(parents=True)
    (tmp / "meta.pt").write_bytes(b"x")
    return _store.commit(tmp, dirpath / _store.checkpoint_name(step), {"step": step, "run": "r"})


def _age(path, seconds_ago):
    t = time.time() - seconds_ago
    os.utime(path, (t, t))


def test_latest_checkpoint_is_the_newest_complete_one_of_either_callback(tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_npu.callbacks import DynamicCheckpoint

    dyn_dir, mc_dir = tmp_path / "dyn", tmp_path / "mc"
    trainer = Trainer(default_root_dir=tmp_path, logger=False, accelerator="cpu", devices=1,
                      callbacks=[DynamicCheckpoint(dirpath=str(dyn_dir)), ModelCheckpoint(dirpath=str(mc_dir))])
    assert cli.find_latest_checkpoint(trainer) == (None, [dyn_dir, mc_dir])
    dyn = _commit_dynamic(dyn_dir, 4)
    _age(dyn, 30)
    mc_dir.mkdir()
    mc = mc_dir / "epoch=0-step=6.ckpt"
    mc.write_bytes(b"x")
    _age(mc, 20)
    # newer, but not complete checkpoints: a write in progress, an aside copy, a directory without meta.pt,
    # a DynamicCheckpoint folder entry without its marker
    for name in (".tmp-last.ckpt-1-abcdef01", ".old-last.ckpt-1-abcdef01"):
        (mc_dir / name).write_bytes(b"x")
    (mc_dir / "epoch=0-step=8.ckpt").mkdir()
    (dyn_dir / "step=00000009.ckpt").mkdir()
    assert cli.find_latest_checkpoint(trainer)[0] == str(mc)
    _age(dyn, 0)
    assert cli.find_latest_checkpoint(trainer)[0] == str(dyn)


def test_latest_checkpoint_of_a_model_checkpoint_without_dirpath_searches_every_logger_version(tmp_path):
    # Lightning's default ModelCheckpoint folder is <save_dir>/<name>/<version>/checkpoints, and a new run gets a
    # new version: the checkpoint to resume is in an earlier one
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    old = tmp_path / "logs" / "version_0" / "checkpoints"
    old.mkdir(parents=True)
    (old / "epoch=0-step=3.ckpt").write_bytes(b"x")
    trainer = Trainer(default_root_dir=tmp_path, logger=CSVLogger(tmp_path, name="logs"), accelerator="cpu",
                      devices=1, callbacks=[ModelCheckpoint()])
    assert cli.find_latest_checkpoint(trainer) == (str(old / "epoch=0-step=3.ckpt"), [old])


def test_ckpt_path_latest_starts_fresh_then_resumes(tmp_path):
    base = [
        "fit",
        "--config", "examples/gpt/config.yaml",
        "--trainer.default_root_dir", str(tmp_path),
        "--trainer.limit_val_batches", "0",
        "--trainer.enable_progress_bar", "false",
        "--model.init_args.n_layer", "2",
        "--model.init_args.n_embd", "32",
        "--data.init_args.block_size", "32",
        "--model.init_args.block_size", "32",
        "--ckpt_path", "latest",
    ]
    rc, out = _run(base + ["--trainer.max_steps", "3"], tmp_path)
    assert rc == 0, out[-4000:]
    assert f"--ckpt_path latest: no complete checkpoint in {tmp_path / 'checkpoints'}; starting fresh." in out
    assert "Restoring states" not in out
    first = tmp_path / "checkpoints" / "step=00000003.ckpt"
    assert first.is_dir(), out[-3000:]
    # the end of fit says where the checkpoints are and how to resume
    assert f"DynamicCheckpoint: {tmp_path / 'checkpoints'} (newest: step=00000003.ckpt)" in out
    assert "Resume this run with:\n  lightning-npu fit --config examples/gpt/config.yaml" in out
    assert out.count("--ckpt_path latest\n") == 1  # the old --ckpt_path is replaced, not repeated

    # Lightning's own keyword resumes too (DynamicCheckpoint is a ModelCheckpoint to `ckpt_path="last"`)
    rc, out = _run([a if a != "latest" else "last" for a in base] + ["--trainer.max_steps", "5"], tmp_path)
    assert rc == 0, out[-4000:]
    assert f"Restoring states from the checkpoint path at {first}" in out
    assert "`Trainer.fit` stopped: `max_steps=5` reached." in out
    assert (tmp_path / "checkpoints" / "step=00000005.ckpt").is_dir()
    assert "not recommended to provide both args and command line arguments" not in out

    # a pickle planted in a shard's non-tensor entry is refused on both ranks, and runs on neither
    flag = tmp_path / "payload-ran"
    shard, key = plant_in_shard(tmp_path / "checkpoints" / "step=00000005.ckpt", Payload(str(flag)))
    rc, out = _run(base + ["--trainer.max_steps", "7"], tmp_path)
    assert f"--ckpt_path latest: resuming from {shard.parent}" in out, out[-4000:]
    assert rc != 0 and f"Refused to load '{shard}' (its entry '{key}')" in out, out[-4000:]
    assert not flag.exists()
