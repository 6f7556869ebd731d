"""One command for the whole picture: `benchmarks/report.md` plus PNG plots, on 2 CPU processes in under 10 minutes.

    python benchmarks/report.py [--steps 12] [--warmup 3] [--repeats 2] [--only ddp,zero1,...] [--out benchmarks]

Every case trains the example GPT on the same 2 real processes, one case after the other (global batch fixed) and records tokens/s (median step time
after warm-up, slowest rank), per-rank memory by kind (`MemoryMonitor`: parameters, gradients, optimizer state,
peak saved activations; rank 0) and the loss curve. Lightning's `"ddp"` and `ModelParallelStrategy` (hand-written
DTensor plan, as in `benchmarks/tensor_parallel.py`) run in the same run, so the ratios compare like with like.
Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402

from benchmarks._common import StepTimer, environment  # noqa: E402
from lightning_npu.launch import spawn  # noqa: E402

MODEL = dict(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=256, bias=False, dropout=0.0)
GLOBAL_BATCH = 16
WORLD = 2

# name -> (strategy kwargs for NPUHybridStrategy, or a Lightning strategy name; precision)
CASES: dict[str, tuple[Any, str]] = {
    "ddp": ("ddp", "32-true"),
    "model_parallel_tp2": ("model_parallel", "32-true"),
    "zero0": ({"zero_stage": 0}, "32-true"),
    "zero1": ({"zero_stage": 1}, "32-true"),
    "zero2": ({"zero_stage": 2}, "32-true"),
    "zero3": ({"zero_stage": 3}, "32-true"),
    "tp2": ({"tensor_parallel_size": 2, "zero_stage": 0}, "32-true"),
    "pp2": ({"pipeline_parallel_size": 2, "zero_stage": 0, "micro_batches": 4}, "32-true"),
    "zero1_ac2": ({"zero_stage": 1, "activation_checkpointing": 2}, "32-true"),
    "zero1_ac_selective": ({"zero_stage": 1, "activation_checkpointing": "selective"}, "32-true"),
    "zero1_ac_full": ({"zero_stage": 1, "activation_checkpointing": "full"}, "32-true"),
    "zero1_bf16": ({"zero_stage": 1}, "bf16-mixed"),
    "zero1_bf16_fused": ({"zero_stage": 1, "fuse_ops": True}, "bf16-mixed"),
}


class LossCurve(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def worker(name: str, steps: int, warmup: int) -> dict[str, Any]:
    from examples.gpt.data import TextDataModule
    from examples.gpt.model import GPTModule
    from lightning_npu import NPUHybridStrategy
    from lightning_npu.callbacks import MemoryMonitor

    spec, precision = CASES[name]
    L.seed_everything(0, verbose=False)
    dp = WORLD
    if spec == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        from benchmarks.tensor_parallel import _hand_tp_module

        strategy: Any = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=WORLD)
        model = _hand_tp_module()(**MODEL)
        dp = 1
    else:
        strategy = spec if isinstance(spec, str) else NPUHybridStrategy(**spec)
        model = GPTModule(**MODEL)
        if isinstance(spec, dict):
            dp = WORLD // spec.get("tensor_parallel_size", 1) // spec.get("pipeline_parallel_size", 1)
    data = TextDataModule(block_size=MODEL["block_size"], batch_size=GLOBAL_BATCH // dp, shuffle=False)
    timer, curve, memory = StepTimer(warmup), LossCurve(), MemoryMonitor()
    L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, precision=precision, max_steps=steps + warmup,
              limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[timer, curve, memory]).fit(model, datamodule=data)
    return {"step_times": timer.times, "losses": curve.losses, "memory": dict(memory.last)}


def run_cases(names: list[str], steps: int, warmup: int, repeats: int) -> dict[str, list[dict]]:
    """All cases in the same 2 processes, one after the other (a launch costs more than a case here); each repeat
    starts one case later in the list, so no case always runs first or last."""
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(worker(name, steps, warmup))
    return runs


def summarise(name: str, ranks: list[list[dict]]) -> dict[str, Any]:
    """`ranks[rank][repeat]`: the median over repeats of each repeat's median step (the slowest rank ends a step)."""
    step = statistics.median(
        statistics.median(max(ts) for ts in zip(*(r[i]["step_times"] for r in ranks))) for i in range(len(ranks[0])))
    ranks = [r[0] for r in ranks]
    mem = ranks[0]["memory"]
    kinds = ("parameters", "gradients", "optimizer_state", "activations_peak")
    return {"tokens_per_s": GLOBAL_BATCH * MODEL["block_size"] / step, "step_time_s": step,
            "memory_mib": {k: mem.get(k, 0.0) / 2**20 for k in kinds}, "peak_rss_mib": mem.get("peak_rss", 0) / 2**20,
            "losses": ranks[0]["losses"], "precision": CASES[name][1]}


def plot(results: dict[str, dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    files = []
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(names, [results[n]["tokens_per_s"] for n in names], color="tab:blue")
    ax.set_ylabel("tokens/s (2 CPU processes)")
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    fig.tight_layout()
    fig.savefig(out / "report_throughput.png", dpi=100)
    files.append("report_throughput.png")
    fig, ax = plt.subplots(figsize=(9, 4))
    bottom = [0.0] * len(names)
    for kind in ("parameters", "gradients", "optimizer_state", "activations_peak"):
        values = [results[n]["memory_mib"][kind] for n in names]
        ax.bar(names, values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("MiB per rank (rank 0)")
    ax.legend()
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    fig.tight_layout()
    fig.savefig(out / "report_memory.png", dpi=100)
    files.append("report_memory.png")
    fig, ax = plt.subplots(figsize=(9, 4))
    for n in names:
        ax.plot(range(1, len(results[n]["losses"]) + 1), results[n]["losses"], label=n)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "report_loss.png", dpi=100)
    files.append("report_loss.png")
    plt.close("all")
    return files


def markdown(results: dict[str, dict], args: argparse.Namespace, images: list[str]) -> str:
    ref = results.get("ddp", next(iter(results.values())))["tokens_per_s"]
    lines = [
        "# Benchmark report",
        "",
        f"`python benchmarks/report.py --steps {args.steps} --warmup {args.warmup} --repeats {args.repeats}`: the example GPT "
        f"({MODEL['n_layer']} layers, d={MODEL['n_embd']}, T={MODEL['block_size']}, global batch {GLOBAL_BATCH}) "
        f"on {WORLD} CPU processes, one run; torch {environment()['torch']}, lightning {environment()['lightning']}. "
        "Step time is the median after warm-up (slowest rank), then the median over repeats (each repeat starts one "
        "case later in the list); memory is rank 0's at the last step "
        "(`MemoryMonitor`). CPU timings on a shared machine move by about ±10% between runs.",
        "",
        "| case | precision | tokens/s | vs ddp | params MiB | grads MiB | optimizer MiB | activations MiB | final loss |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        m = r["memory_mib"]
        lines.append(f"| {name} | {r['precision']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / ref:.2f} | "
                     f"{m['parameters']:.2f} | {m['gradients']:.2f} | {m['optimizer_state']:.2f} | "
                     f"{m['activations_peak']:.2f} | {r['losses'][-1]:.4f} |")
    lines += ["", *[f"![{img}]({img})" for img in images], ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--only", default=",".join(CASES), help="comma-separated case names")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent))
    args = p.parse_args()
    names = args.only.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        p.error(f"--only: unknown case(s) {unknown}; choose from {list(CASES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ranks = spawn(run_cases, WORLD, names, args.steps, args.warmup, args.repeats)
    results = {name: summarise(name, [r[name] for r in ranks]) for name in names}
    for name, r in results.items():
        print(f"{name:22s} {r['tokens_per_s']:9.0f} tokens/s", flush=True)
    images = plot(results, out)
    (out / "report.md").write_text(markdown(results, args, images))
    (out / "results").mkdir(exist_ok=True)
    (out / "results" / "report.json").write_text(json.dumps({"config": vars(args), "results": results}, indent=2))
    print(f"wrote {out / 'report.md'}")


if __name__ == "__main__":
    main()
