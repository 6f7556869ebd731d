"""Activation checkpointing and MemoryMonitor on the example GPT: step time and saved-activation bytes.

    python benchmarks/memory.py [--accelerator cpu|auto] [--repeats 3] [--out benchmarks/results/memory.json]

One process, the example GPT (8 blocks by default), alternating runs. Step time is the interval between consecutive
``on_train_batch_start`` calls (every callback's work included), median over steps after warm-up, then median over
repeats. Saved bytes are MemoryMonitor's ``activations_peak`` of the last step. Ratios are against the run with no
recompute and no monitor (``MemoryMonitor(activations=False)`` gives the activation-free monitor's cost).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402

from benchmarks import _env  # noqa: E402
from examples.gpt.data import TextDataModule  # noqa: E402
from examples.gpt.model import GPTModule  # noqa: E402
from lightning_npu import NPUHybridStrategy  # noqa: E402
from lightning_npu import device as dev  # noqa: E402
from lightning_npu.callbacks import MemoryMonitor  # noqa: E402


class StepInterval(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._t = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        dev.synchronize(pl_module.device)
        now = time.perf_counter()
        if self._t is not None:
            self.times.append(now - self._t)
        self._t = now


CASES = {
    "none": (None, None),
    "monitor_no_activations": (None, False),
    "monitor": (None, True),
    "ac_every_4": (4, True),
    "ac_every_2": (2, True),
    "ac_selective": ("selective", True),
    "ac_full": ("full", True),
}


def run(args, policy, monitor) -> dict:
    L.seed_everything(0, verbose=False)
    model = GPTModule(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
    data = TextDataModule(block_size=args.block_size, batch_size=args.batch_size, shuffle=False)
    timer = StepInterval()
    mem = MemoryMonitor(activations=monitor) if monitor is not None else None
    with tempfile.TemporaryDirectory() as root:
        L.Trainer(accelerator=args.accelerator, devices=1, max_steps=args.steps, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                  limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=root,
                  strategy=NPUHybridStrategy(zero_stage=0, activation_checkpointing=policy),
                  callbacks=[timer, *([mem] if mem else [])]).fit(model, data)
    out = {"step_s": statistics.median(timer.times[args.warmup:])}
    if mem is not None and "activations_peak" in mem.last:
        out["activations_bytes"] = mem.last["activations_peak"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/memory.json")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in CASES}
    for _ in range(args.repeats):  # alternate the cases within each repeat
        for name, (policy, monitor) in CASES.items():
            runs[name].append(run(args, policy, monitor))
    base = statistics.median(r["step_s"] for r in runs["none"])
    base_bytes = statistics.median(r["activations_bytes"] for r in runs["monitor"])
    results = {}
    for name, rs in runs.items():
        step = statistics.median(r["step_s"] for r in rs)
        row = {"median_step_s": step, "step_time_ratio_vs_none": step / base}
        if "activations_bytes" in rs[0]:
            saved = statistics.median(r["activations_bytes"] for r in rs)
            row.update(activations_mib=saved / 2**20, activations_ratio_vs_none=saved / base_bytes)
        results[name] = row
        print(f"{name:24s} step {step * 1e3:7.1f} ms  x{step / base:.3f}"
              + (f"  saved {row['activations_mib']:7.2f} MiB  x{row['activations_ratio_vs_none']:.3f}"
                 if "activations_mib" in row else ""))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    _env.write_json(args.out, {"config": vars(args), "results": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
