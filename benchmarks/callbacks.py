"""Overhead of GradientHealthGuard on the example GPT step, and DynamicCheckpoint save time sync vs async.

    python benchmarks/callbacks.py [--accelerator cpu|auto] [--out benchmarks/results/callbacks.json]

Step time = on_train_batch_start -> on_train_batch_end (forward, backward, guard, optimizer),
median over steps after warm-up, runs alternating with/without the guard. Save time = time the
training thread is blocked in `DynamicCheckpoint.save` (sync: the whole write + commit; async: the
tensor snapshot + hand-off, the write overlaps the following steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from examples.gpt.data import TextDataModule  # noqa: E402
from examples.gpt.model import GPTModule  # noqa: E402
from lightning_npu import device as dev  # noqa: E402
from lightning_npu.callbacks import DynamicCheckpoint, GradientHealthGuard  # noqa: E402


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        dev.synchronize(pl_module.device)
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        dev.synchronize(pl_module.device)
        self.times.append(time.perf_counter() - self._t)


class TimedCheckpoint(DynamicCheckpoint):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.save_times: list[float] = []

    def save(self, trainer, reason="manual"):
        t = time.perf_counter()
        out = super().save(trainer, reason)
        self.save_times.append(time.perf_counter() - t)
        return out


def model_and_data(args):
    model = GPTModule(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
    data = TextDataModule(block_size=args.block_size, batch_size=args.batch_size, shuffle=False)
    return model, data


def trainer(args, callbacks, root, steps):
    return L.Trainer(accelerator=args.accelerator, devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, limit_val_batches=0,
                     num_sanity_val_steps=0, default_root_dir=root, callbacks=callbacks)


def step_time(args, guard: bool) -> list[float]:
    L.seed_everything(0, verbose=False)
    model, data = model_and_data(args)
    timer = StepTimer()
    cbs = [timer] + ([GradientHealthGuard()] if guard else [])
    with tempfile.TemporaryDirectory() as root:
        trainer(args, cbs, root, args.steps).fit(model, data)
    return timer.times[args.warmup:]


def save_times(args, async_save: bool) -> dict:
    L.seed_everything(0, verbose=False)
    model, data = model_and_data(args)
    with tempfile.TemporaryDirectory() as root:
        ck = TimedCheckpoint(dirpath=root + "/ck", phase_fractions=(), intervals=(args.save_every,),
                             async_save=async_save, save_on_train_end=False, keep_last_k=2)
        timer = StepTimer()
        trainer(args, [timer, ck], root, args.save_steps).fit(model, data)
        size = sum(f.stat().st_size for f in Path(root, "ck").rglob("*.ckpt"))
        n_files = len(list(Path(root, "ck").glob("*.ckpt")))
    return {"blocking_s": ck.save_times, "median_blocking_s": statistics.median(ck.save_times),
            "median_step_s": statistics.median(timer.times), "checkpoint_mb": size / max(n_files, 1) / 2**20}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--save-steps", type=int, default=30)
    p.add_argument("--out", default="benchmarks/results/callbacks.json")
    args = p.parse_args()

    sync, asyn = save_times(args, async_save=False), save_times(args, async_save=True)
    runs = {"without_guard": [], "with_guard": []}
    for _ in range(args.repeats):  # alternate so that machine noise hits both alike
        runs["without_guard"].append(statistics.median(step_time(args, guard=False)))
        runs["with_guard"].append(statistics.median(step_time(args, guard=True)))
    base, guarded = statistics.median(runs["without_guard"]), statistics.median(runs["with_guard"])
    result = {
        "config": {**vars(args), "torch": torch.__version__, "lightning": L.__version__,
                   "device": str(torch.accelerator.current_accelerator() if args.accelerator != "cpu" else "cpu"),
                   "threads": torch.get_num_threads(), "load_average": list(__import__("os").getloadavg())},
        "step_time": {
            "median_s_without_guard": base,
            "median_s_with_guard": guarded,
            "per_repeat_medians_s": runs,
            "guard_overhead_pct": 100.0 * (guarded / base - 1.0),
        },
        "checkpoint_save": {
            "sync": sync,
            "async": asyn,
            "async_over_sync_blocking_ratio": asyn["median_blocking_s"] / sync["median_blocking_s"],
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({"guard_overhead_pct": result["step_time"]["guard_overhead_pct"],
                      "step_s": [base, guarded],
                      "save_blocking_s_sync_async": [sync["median_blocking_s"], asyn["median_blocking_s"]],
                      "checkpoint_mb": sync["checkpoint_mb"]}, indent=1))


if __name__ == "__main__":
    main()
