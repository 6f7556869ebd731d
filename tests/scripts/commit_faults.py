"""Faults around the commit of npu_hybrid checkpoints, in real processes (tests/test_checkpoint_trust.py).

``--mode async_kill``: 2 ranks (Lightning's own launcher), ``NPUHybridStrategy(async_save=True)`` with
DynamicCheckpoint every 2 steps. During step 3, rank 0 records whether the step-2 checkpoint became
visible (it must, before the step-4 save), and rank 1 is SIGKILLed once its part of that write is done;
rank 0 then fails on its next collective. The step-2 checkpoint must survive.

``--mode overwrite_crash``: 1 rank, resumes from ``--ckpt-path`` and SIGKILLs itself inside the commit of
the step-4 checkpoint that overwrites an existing one: after the old copy was set aside, before the
rename of the new one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_npu import NPUHybridStrategy  # noqa: E402
from lightning_npu.callbacks import DynamicCheckpoint  # noqa: E402
from lightning_npu.parallel.checkpoint import commit  # noqa: E402
from tests._callbacks_helpers import StepSeeded, trainer_kwargs  # noqa: E402


def _wait(cond, timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


class AsyncProbe(StepSeeded):
    def __init__(self, ckdir: str, root: str) -> None:
        super().__init__()
        self.ckdir, self.root = Path(ckdir), Path(root)

    def training_step(self, batch, batch_idx):
        if self.global_step == 3:
            marker = self.ckdir / "step=00000002.ckpt.complete"
            if self.global_rank == 0:
                t0 = time.monotonic()
                visible = _wait(lambda: DynamicCheckpoint.find_latest(self.ckdir) == str(self.ckdir / "step=00000002.ckpt"))
                (self.root / "visible.json").write_text(json.dumps({"visible": visible, "waited_s": time.monotonic() - t0}))
            else:
                writer = getattr(self.trainer.strategy, "_ckpt_writer", None)
                pending = getattr(writer, "_pending", None)
                if pending is not None:
                    pending[1].wait(60)  # this rank's part of the step-2 write is done
                _wait(marker.exists)
                os.kill(os.getpid(), signal.SIGKILL)
        return super().training_step(batch, batch_idx)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--mode", choices=["async_kill", "overwrite_crash", "plain"], required=True)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--ckpt-path")
    args = p.parse_args()
    torch.set_num_threads(1)
    ckdir = Path(args.root) / "ck"
    dyn = DynamicCheckpoint(dirpath=str(ckdir), phase_fractions=(), intervals=(2,), keep_last_k=None,
                            save_on_train_end=False)
    if args.mode == "async_kill":
        model = AsyncProbe(str(ckdir), args.root)
        strategy = NPUHybridStrategy(async_save=True)
        devices = 2
    else:
        model, strategy, devices = StepSeeded(), NPUHybridStrategy(), 1
    if args.mode == "overwrite_crash":
        move = commit._move

        def crashing_move(src: Path, dst: Path) -> None:
            if src.name.startswith(".tmp-step=00000004.ckpt") and any(ckdir.glob(".old-step=00000004.ckpt-*")):
                os.kill(os.getpid(), signal.SIGKILL)  # the old copy is aside, the new one not yet renamed
            move(src, dst)

        commit._move = crashing_move
    trainer = L.Trainer(callbacks=[dyn], strategy=strategy,
                        **trainer_kwargs(args.root, args.max_steps, devices=devices))
    trainer.fit(model, ckpt_path=args.ckpt_path)


if __name__ == "__main__":
    main()
