"""The README's main job: `lightning-npu fit --config examples/gpt/config.yaml` (2 CPU processes), shortened."""

import os
import subprocess
import sys
from pathlib import Path

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
        "--model.init_args.n_layer", "1",
        "--model.init_args.n_embd", "32",
        "--data.init_args.block_size", "32",
        "--model.init_args.block_size", "32",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Starting with 2 processes" in out
    assert "`Trainer.fit` stopped: `max_steps=12` reached." in out
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt")), out[-2000:]
