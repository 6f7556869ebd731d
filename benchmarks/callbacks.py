"""Overhead of GradientHealthGuard on the example GPT step, and DynamicCheckpoint save time sync vs async.

    python benchmarks/callbacks.py [--accelerator cpu|auto] [--out benchmarks/results/callbacks.json]
                                   [--only all|guard|checkpoint] [--ckpt-mb 100]

Step time = on_train_batch_start -> on_train_batch_end (forward, backward, guard, optimizer),
median over steps after warm-up, runs alternating with/without the guard. Save time = time the
training thread is blocked in `DynamicCheckpoint.save` (sync: the whole write + commit; async: the
tensor snapshot + hand-off, the write overlaps the following steps).

``checkpoint_blocking``: the time training is blocked by a save of a ~``--ckpt-mb`` MB checkpoint
(weights + AdamW state of an MLP), sync vs async, under npu_hybrid (DCP directory, committed by the
strategy) and Lightning's default strategy (one file). Blocked = all time spent in DynamicCheckpoint's
batch-end hook at a saving step (the save) and at the other steps (commit polls), medians over saves;
the final flush at train end is reported apart. ``--only`` runs one part and merges it into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from benchmarks import _env  # noqa: E402
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


class MLP(L.LightningModule):
    """Weights + AdamW state = 12 bytes/parameter: `mb` MB of checkpoint, cheap steps."""

    def __init__(self, mb: float, width: int = 1024) -> None:
        super().__init__()
        depth = max(1, round(mb * 2**20 / 12 / (width * width + width)))
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
        self.width = width

    def training_step(self, batch, batch_idx):
        x = torch.randn(4, self.width, generator=torch.Generator().manual_seed(self.global_step))
        return self.net(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(10_000, 1)), batch_size=1)


class HookTimedCheckpoint(DynamicCheckpoint):
    """Times the batch-end hook (save + commit polls) and the train-end flush: what training waits for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.save_step_s: list[float] = []
        self.other_step_s: list[float] = []
        self.train_end_s = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        t = time.perf_counter()
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        dt = time.perf_counter() - t
        (self.save_step_s if self._last_saved_step == step and self.should_save(step, self._total_steps(trainer))
         else self.other_step_s).append(dt)

    def on_train_end(self, trainer, pl_module):
        t = time.perf_counter()
        super().on_train_end(trainer, pl_module)
        self.train_end_s = time.perf_counter() - t


def checkpoint_blocking(args, strategy_name: str, async_save: bool) -> dict:
    from lightning_npu import NPUHybridStrategy

    L.seed_everything(0, verbose=False)
    model = MLP(args.ckpt_mb)
    with tempfile.TemporaryDirectory() as root:
        ck = HookTimedCheckpoint(dirpath=root + "/ck", phase_fractions=(), intervals=(args.ckpt_every,),
                                 async_save=async_save and strategy_name == "auto", save_on_train_end=False,
                                 keep_last_k=2)
        strategy = NPUHybridStrategy(async_save=async_save) if strategy_name == "npu_hybrid" else "auto"
        L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=args.ckpt_steps, logger=False,
                  enable_progress_bar=False, enable_model_summary=False,
                  default_root_dir=root, callbacks=[ck]).fit(model)
        latest = Path(DynamicCheckpoint.find_latest(root + "/ck"))
        size = sum(f.stat().st_size for f in ([latest] if latest.is_file() else latest.rglob("*")) if f.is_file())
    return {"checkpoint_mb": size / 2**20, "saves": len(ck.save_step_s),
            "median_blocked_at_save_step_s": statistics.median(ck.save_step_s),
            "median_blocked_at_other_steps_s": statistics.median(ck.other_step_s),
            "blocked_at_save_steps_s": ck.save_step_s, "train_end_flush_s": ck.train_end_s}


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
    p.add_argument("--ckpt-mb", type=float, default=100.0)
    p.add_argument("--ckpt-every", type=int, default=4)
    p.add_argument("--ckpt-steps", type=int, default=21)
    p.add_argument("--only", choices=["all", "guard", "checkpoint"], default="all")
    p.add_argument("--out", default="benchmarks/results/callbacks.json")
    args = p.parse_args()
    out = Path(args.out)
    result = json.loads(out.read_text()) if args.only != "all" and out.is_file() else {}
    summary: dict = {}
    if args.only in ("all", "guard"):
        result.update(guard_and_small_saves(args))
        summary.update({"guard_overhead_pct": result["step_time"]["guard_overhead_pct"],
                        "step_s": [result["step_time"]["median_s_without_guard"],
                                   result["step_time"]["median_s_with_guard"]],
                        "save_blocking_s_sync_async": [result["checkpoint_save"]["sync"]["median_blocking_s"],
                                                       result["checkpoint_save"]["async"]["median_blocking_s"]],
                        "checkpoint_mb": result["checkpoint_save"]["sync"]["checkpoint_mb"]})
    if args.only in ("all", "checkpoint"):
        blocking = {f"{name}_{mode}": checkpoint_blocking(args, name, mode == "async")
                    for name in ("npu_hybrid", "auto") for mode in ("sync", "async")}
        result["checkpoint_blocking"] = {
            "config": {k: getattr(args, k) for k in ("ckpt_mb", "ckpt_every", "ckpt_steps")}
            | {"torch": torch.__version__, "lightning": L.__version__, "threads": torch.get_num_threads(),
               "load_average": list(os.getloadavg())},
            **blocking,
        }
        summary["checkpoint_blocking_median_s"] = {
            k: {"mb": round(v["checkpoint_mb"], 1), "at_save_step": round(v["median_blocked_at_save_step_s"], 4),
                "at_other_steps": round(v["median_blocked_at_other_steps_s"], 4),
                "train_end_flush": round(v["train_end_flush_s"], 4)}
            for k, v in blocking.items()
        }
    out.parent.mkdir(parents=True, exist_ok=True)
    _env.write_json(out, result, indent=1)
    print(json.dumps(summary, indent=1))


def guard_and_small_saves(args) -> dict:
    sync, asyn = save_times(args, async_save=False), save_times(args, async_save=True)
    runs = {"without_guard": [], "with_guard": []}
    for _ in range(args.repeats):  # alternate so that machine noise hits both alike
        runs["without_guard"].append(statistics.median(step_time(args, guard=False)))
        runs["with_guard"].append(statistics.median(step_time(args, guard=True)))
    base, guarded = statistics.median(runs["without_guard"]), statistics.median(runs["with_guard"])
    return {
        "config": {**vars(args), "torch": torch.__version__, "lightning": L.__version__,
                   "device": str(torch.accelerator.current_accelerator() if args.accelerator != "cpu" else "cpu"),
                   "threads": torch.get_num_threads(), "load_average": list(os.getloadavg())},
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

if __name__ == "__main__":
    main()
