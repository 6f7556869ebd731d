"""Train `StepSeeded` with the stability callbacks; used by the fault-injection tests.

Run as a plain process (1 device) or under torchrun (2 ranks, "ddp"). Rank 0 writes the final
parameters and the losses it saw to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_npu.callbacks import DynamicCheckpoint, GradientHealthGuard, PreemptionCheckpoint, TrainingGuard  # noqa: E402
from tests._callbacks_helpers import KillingCheckpointIO, StepSeeded, flat_params, trainer_kwargs  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--interval", type=int, default=2)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--kill-at", type=int)
    p.add_argument("--kill-flag")
    p.add_argument("--signal-at", type=int)
    p.add_argument("--crash-in-save-at", type=int)
    p.add_argument("--preemption", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)

    model = StepSeeded(kill_at=args.kill_at, kill_rank=1, kill_flag=args.kill_flag, signal_at=args.signal_at)
    dyn = DynamicCheckpoint(dirpath=str(Path(args.root) / "ck"), phase_fractions=(), intervals=(args.interval,),
                            keep_last_k=None)
    guard = TrainingGuard(max_restarts=2)
    callbacks = [dyn, GradientHealthGuard(), guard] + ([PreemptionCheckpoint()] if args.preemption else [])
    plugins = [KillingCheckpointIO(args.crash_in_save_at)] if args.crash_in_save_at is not None else None
    trainer = L.Trainer(callbacks=callbacks, plugins=plugins,
                        **trainer_kwargs(args.root, args.max_steps, devices=args.devices, strategy=args.strategy))
    if args.strategy == "ddp":
        # Lightning's ddp never destroys its process groups; without this, ~1 run in 8 aborts in gloo at exit
        from lightning_npu.strategy import _destroy_process_groups_at_exit

        _destroy_process_groups_at_exit()
    guard.fit(trainer, model)
    if trainer.global_rank == 0:
        torch.save({"params": flat_params(model), "losses": model.losses, "global_step": trainer.global_step,
                    "events": guard.events, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))},
                   args.out)
        print(json.dumps({"global_step": trainer.global_step}))


if __name__ == "__main__":
    main()
