"""Faults around the commit of npu_hybrid checkpoints, in real processes (tests/test_checkpoint_trust.py).

``--mode async_kill``: 2 ranks (Lightning's own launcher), ``NPUHybridStrategy(async_save=True)`` with
DynamicCheckpoint every 2 steps. During step 3, rank 0 records whether the step-2 checkpoint became
visible (it must, before the step-4 save), and rank 1 is SIGKILLed once its part of that write is done;
rank 0 then fails on its next collective. The step-2 checkpoint must survive.

``--mode overwrite_crash``: 1 rank, resumes from ``--ckpt-path`` and SIGKILLs itself inside the commit of
the step-4 checkpoint that overwrites an existing one: after the old copy was set aside, before the
rename of the new one.

``--mode rename_crash`` / ``prune_crash``: 1 rank, sharded directories; SIGKILLs itself after the step-4
checkpoint was renamed into place, before its marker; or half way through pruning step 2 (keep_last_k=1),
after its marker went and one of its files.

``--mode marker_full``: 2 ranks (Lightning's launcher), sharded directories; rank 0's marker write of the step-4
save fails (disk full). Both ranks must raise the same `CheckpointSaveError`; each records, in ``exit<rank>.json``,
the error and how long its exit took after it (the process groups' shutdown must not wait out a timeout).
"""

from __future__ import annotations

import argparse
import atexit
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
    p.add_argument("--mode", choices=["async_kill", "overwrite_crash", "plain", "rename_crash", "prune_crash",
                                      "marker_full"], required=True)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--ckpt-path")
    args = p.parse_args()
    torch.set_num_threads(1)
    ckdir = Path(args.root) / "ck"
    dyn = DynamicCheckpoint(dirpath=str(ckdir), phase_fractions=(), intervals=(2,),
                            keep_last_k=1 if args.mode == "prune_crash" else None, save_on_train_end=False)
    if args.mode == "async_kill":
        model = AsyncProbe(str(ckdir), args.root)
        strategy = NPUHybridStrategy(async_save=True)
        devices = 2
    elif args.mode in ("rename_crash", "prune_crash", "marker_full"):
        model, strategy = StepSeeded(), NPUHybridStrategy(save_distributed_checkpoint=True)
        devices = 2 if args.mode == "marker_full" else 1
    else:
        model, strategy, devices = StepSeeded(), NPUHybridStrategy(), 1
    write_marker, remove = commit._write_json_atomic, commit.remove_path
    if args.mode == "rename_crash":
        def crashing_marker(path: Path, payload: dict) -> None:
            if path.name == "step=00000004.ckpt.complete":
                os.kill(os.getpid(), signal.SIGKILL)  # renamed into place, not marked
            write_marker(path, payload)

        commit._write_json_atomic = crashing_marker
    if args.mode == "prune_crash":
        def crashing_remove(path: Path) -> None:
            if Path(path).name == "step=00000002.ckpt" and Path(path).is_dir():
                next(f for f in sorted(Path(path).iterdir()) if f.is_file()).unlink()
                os.kill(os.getpid(), signal.SIGKILL)  # unmarked, one file gone
            remove(path)

        commit.remove_path = crashing_remove
    if args.mode == "marker_full":
        failed: dict = {}
        rank = int(os.environ.get("LOCAL_RANK", "0"))

        def full_disk(path: Path, payload: dict) -> None:
            if path.name == "step=00000004.ckpt.complete":
                raise OSError(28, "No space left on device (injected)")
            write_marker(path, payload)

        commit._write_json_atomic = full_disk

        def record_exit() -> None:  # registered first, so it runs last: after the process groups' shutdown
            if failed:
                failed["exit_s"] = time.monotonic() - failed.pop("t")
                (Path(args.root) / f"exit{rank}.json").write_text(json.dumps(failed))

        atexit.register(record_exit)
    if args.mode == "overwrite_crash":
        move = commit._move

        def crashing_move(src: Path, dst: Path) -> None:
            if src.name.startswith(".tmp-step=00000004.ckpt") and any(ckdir.glob(".old-step=00000004.ckpt-*")):
                os.kill(os.getpid(), signal.SIGKILL)  # the old copy is aside, the new one not yet renamed
            move(src, dst)

        commit._move = crashing_move
    trainer = L.Trainer(callbacks=[dyn], strategy=strategy,
                        **trainer_kwargs(args.root, args.max_steps, devices=devices))
    try:
        trainer.fit(model, ckpt_path=args.ckpt_path)
    except Exception as err:
        if args.mode != "marker_full":
            raise
        failed.update(t=time.monotonic(), error=f"{type(err).__name__}: {err}")
        raise


if __name__ == "__main__":
    main()
