"""One command for the whole picture: `benchmarks/report.md` plus PNG plots, on 2 CPU processes.

    python benchmarks/report.py [--steps 12] [--warmup 3] [--repeats 2] [--only ddp,zero1,...] [--out benchmarks]

Every case trains the example GPT on the same 2 real processes, one case after the other (global batch fixed) and
records tokens/s (median step time after warm-up, slowest rank; the error bars are the steps' interquartile range),
per-rank memory by kind (`MemoryMonitor`: parameters, gradients, optimizer state, peak saved activations; rank 0) and
the loss curve, plotted as each case's difference from ``ddp``. Lightning's `"ddp"` and `ModelParallelStrategy`
(hand-written DTensor plan, as in `benchmarks/tensor_parallel.py`) run in the same run, so the ratios compare like
with like. Fused vs unfused uses the GPT with explicit attention, whose causal softmax the CPU kernels fuse; it runs
only where the kernels are already built (`lightning-npu build-ops`, or ``--build-ops`` here), and the report says
what it measured (the patterns rewritten) or that it measured nothing. The report and its JSON carry the date, the
commit, the CPU, the thread count, the machine's load and the run's own wall time (`benchmarks/_env.py`).
Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402

from benchmarks import _env  # noqa: E402
from benchmarks._common import StepTimer  # noqa: E402
from lightning_npu.launch import spawn  # noqa: E402

MODEL = dict(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=256, bias=False, dropout=0.0)
GLOBAL_BATCH = 16
WORLD = 2
EXPLICIT = {"attention": "explicit"}  # T x T scores + a softmax module: the pattern the CPU kernels fuse
FUSED = "zero1_bf16_explicit_fused"

# name -> (strategy kwargs for NPUHybridStrategy, or a Lightning strategy name; precision; model overrides)
CASES: dict[str, tuple[Any, str, dict[str, Any]]] = {
    "ddp": ("ddp", "32-true", {}),
    "model_parallel_tp2": ("model_parallel", "32-true", {}),
    "zero0": ({"zero_stage": 0}, "32-true", {}),
    "zero1": ({"zero_stage": 1}, "32-true", {}),
    "zero2": ({"zero_stage": 2}, "32-true", {}),
    "zero3": ({"zero_stage": 3}, "32-true", {}),
    "tp2": ({"tensor_parallel_size": 2, "zero_stage": 0}, "32-true", {}),
    "pp2": ({"pipeline_parallel_size": 2, "zero_stage": 0, "micro_batches": 4}, "32-true", {}),
    "zero1_ac2": ({"zero_stage": 1, "activation_checkpointing": 2}, "32-true", {}),
    "zero1_ac_selective": ({"zero_stage": 1, "activation_checkpointing": "selective"}, "32-true", {}),
    "zero1_ac_full": ({"zero_stage": 1, "activation_checkpointing": "full"}, "32-true", {}),
    "zero1_bf16": ({"zero_stage": 1}, "bf16-mixed", {}),
    "zero1_bf16_explicit": ({"zero_stage": 1}, "bf16-mixed", EXPLICIT),
    FUSED: ({"zero_stage": 1, "fuse_ops": True}, "bf16-mixed", EXPLICIT),
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

    spec, precision, overrides = CASES[name]
    L.seed_everything(0, verbose=False)
    dp = WORLD
    if spec == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        from benchmarks.tensor_parallel import _hand_tp_module

        strategy: Any = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=WORLD)
        model = _hand_tp_module()(**MODEL, **overrides)
        dp = 1
    else:
        strategy = spec if isinstance(spec, str) else NPUHybridStrategy(**spec)
        model = GPTModule(**MODEL, **overrides)
        if isinstance(spec, dict):
            dp = WORLD // spec.get("tensor_parallel_size", 1) // spec.get("pipeline_parallel_size", 1)
    data = TextDataModule(block_size=MODEL["block_size"], batch_size=GLOBAL_BATCH // dp, shuffle=False)
    timer, curve, memory = StepTimer(warmup), LossCurve(), MemoryMonitor()
    L.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, precision=precision, max_steps=steps + warmup,
              limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[timer, curve, memory]).fit(model, datamodule=data)
    report = getattr(strategy, "fusion_report", None)
    fused = None if report is None else {"counts": report.counts(), "skipped": len(report.skipped)}
    return {"step_times": timer.times, "losses": curve.losses, "memory": dict(memory.last), "fused": fused}


def run_cases(names: list[str], steps: int, warmup: int, repeats: int) -> dict[str, list[dict]]:
    """All cases in the same 2 processes, one after the other (a launch costs more than a case here); each repeat
    starts one case later in the list, so no case always runs first or last."""
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(worker(name, steps, warmup))
    return runs


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def summarise(name: str, ranks: list[list[dict]]) -> dict[str, Any]:
    """`ranks[rank][repeat]`: the median over repeats of each repeat's median step (the slowest rank ends a step);
    the spread is the interquartile range of every timed step of every repeat."""
    per_repeat = [[max(ts) for ts in zip(*(r[i]["step_times"] for r in ranks))] for i in range(len(ranks[0]))]
    step = statistics.median(statistics.median(steps) for steps in per_repeat)
    pooled = [t for steps in per_repeat for t in steps]
    tokens = GLOBAL_BATCH * MODEL["block_size"]
    first = ranks[0][0]
    mem = first["memory"]
    kinds = ("parameters", "gradients", "optimizer_state", "activations_peak")
    return {"tokens_per_s": tokens / step, "step_time_s": step,
            "tokens_per_s_p25_p75": [tokens / _quantile(pooled, 0.75), tokens / _quantile(pooled, 0.25)],
            "timed_steps": len(pooled),
            "memory_mib": {k: mem.get(k, 0.0) / 2**20 for k in kinds}, "peak_rss_mib": mem.get("peak_rss", 0) / 2**20,
            "losses": first["losses"], "precision": CASES[name][1], "model": {**MODEL, **CASES[name][2]},
            "fused": first["fused"]}


def _reference(results: dict[str, dict]) -> str:
    return "ddp" if "ddp" in results else next(iter(results))


def _styles(n: int) -> list[dict[str, Any]]:
    import matplotlib

    colours = matplotlib.colormaps["tab20"].colors
    dashes = ("-", "--", "-.", ":")
    return [{"color": colours[i % len(colours)], "linestyle": dashes[(i // len(colours)) % len(dashes)],
             "marker": "os^vD<>p*hX"[i % 11], "markersize": 3} for i in range(n)]


def plot(results: dict[str, dict], out: Path, subtitle: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, ref = list(results), _reference(results)
    files = []

    fig, ax = plt.subplots(figsize=(10, 4.5))
    tps = [results[n]["tokens_per_s"] for n in names]
    lo = [t - results[n]["tokens_per_s_p25_p75"][0] for n, t in zip(names, tps)]
    hi = [results[n]["tokens_per_s_p25_p75"][1] - t for n, t in zip(names, tps)]
    ax.bar(names, tps, yerr=[lo, hi], capsize=3, color="tab:blue", ecolor="black")
    ax.axhline(results[ref]["tokens_per_s"], color="tab:red", linestyle="--", label=f"{ref} (reference)")
    ax.set_ylabel(f"tokens/s ({WORLD} CPU processes)")
    ax.set_title(f"Throughput: median step, error bars = interquartile range of the steps\n{subtitle}", fontsize=9)
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    fig.tight_layout()
    fig.savefig(out / "report_throughput.png", dpi=100)
    files.append("report_throughput.png")

    fig, ax = plt.subplots(figsize=(10, 4.5))
    bottom = [0.0] * len(names)
    for kind in ("parameters", "gradients", "optimizer_state", "activations_peak"):
        values = [results[n]["memory_mib"][kind] for n in names]
        ax.bar(names, values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.axhline(sum(results[ref]["memory_mib"].values()), color="tab:red", linestyle="--",
               label=f"{ref} total (reference)")
    ax.set_ylabel("MiB per rank (rank 0)")
    ax.set_title(f"Memory per rank by kind (MemoryMonitor, last step)\n{subtitle}", fontsize=9)
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    fig.tight_layout()
    fig.savefig(out / "report_memory.png", dpi=100)
    files.append("report_memory.png")

    fig, ax = plt.subplots(figsize=(10, 4.5))
    base = results[ref]["losses"]
    others = [n for n in names if n != ref]
    for n, style in zip(others, _styles(len(others))):
        diffs = [a - b for a, b in zip(results[n]["losses"], base)]
        ax.plot(range(1, len(diffs) + 1), diffs, label=n, **style)
    ax.axhline(0.0, color="black", linewidth=1, label=f"{ref} (reference)")
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(f"train loss - {ref} train loss")
    ax.set_title(f"Loss difference from {ref} (symmetric log scale, linear within ±1e-6)\n{subtitle}", fontsize=9)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(out / "report_loss.png", dpi=100)
    files.append("report_loss.png")
    plt.close("all")
    return files


def fusion_note(results: dict[str, dict], skipped: Optional[str]) -> str:
    """What "fused vs unfused" measured, in one sentence: a ratio with the patterns rewritten, or why nothing."""
    if skipped:
        return f"Fused vs unfused: not measured. {skipped}"
    if FUSED not in results:
        return "Fused vs unfused: not measured (the fused case was not selected)."
    fused = results[FUSED].get("fused") or {}
    counts = fused.get("counts") or {}
    if not counts:
        return ("Fused vs unfused: measured nothing. The rewrite pass replaced no module on this device "
                f"({fused.get('skipped', 0)} patterns kept eager), so both cases ran the same program.")
    base = results.get("zero1_bf16_explicit")
    ratio = f" {results[FUSED]['tokens_per_s'] / base['tokens_per_s']:.2f}x the unfused tokens/s" if base else ""
    patterns = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
    return f"Fused vs unfused (explicit attention, bf16):{ratio}; rewritten: {patterns}."


def markdown(results: dict[str, dict], args: argparse.Namespace, images: list[str], meta: dict[str, Any],
             wall_s: float, fusion: str) -> str:
    ref = _reference(results)
    ref_tps, base = results[ref]["tokens_per_s"], results[ref]["losses"]
    load = meta.get("load_average_1_5_15min")
    loaded = bool(load) and max(load) > 0.5 * (meta.get("cpu_count") or 1)
    command = (f"python benchmarks/report.py --steps {args.steps} --warmup {args.warmup} --repeats {args.repeats}"
               + (f" --only {args.only}" if args.only != ",".join(CASES) else ""))
    lines = [
        "# Benchmark report",
        "",
        f"- **Run**: {_env.describe(meta)}.",
        f"- **Load at the end**: {'/'.join(f'{x:g}' for x in meta.get('load_average_end') or []) or 'n/a'} "
        f"(1/5/15 min); wall time {wall_s:.0f} s.",
        f"- **Command**: `{command}`: the example GPT ({MODEL['n_layer']} layers, d={MODEL['n_embd']}, "
        f"T={MODEL['block_size']}, global batch {GLOBAL_BATCH}) on {WORLD} CPU processes, one run.",
    ]
    timed = min(r["timed_steps"] for r in results.values())
    if timed < 5:
        lines.append(f"- **Smoke-test settings**: {timed} timed step(s) per case, so the tokens/s are not a "
                     "measurement (one step carries first-run effects and no spread); the memory and loss columns "
                     "are. Run with the defaults for timings.")
    if loaded:
        lines.append("- **These numbers come from a loaded machine** (load average above half the CPU count): other "
                     "work shared the cores, so the timings are slower and noisier than on an idle machine; the "
                     "memory and loss columns do not depend on load.")
    lines += [
        "",
        "Step time is the median after warm-up (slowest rank), then the median over repeats (each repeat starts one "
        "case later in the list); the tokens/s range is the interquartile range of every timed step. Memory is rank "
        "0's at the last step (`MemoryMonitor`). Max |loss - ddp| is over every step. CPU timings on a shared "
        "machine move by about ±10% between runs even when idle.",
        "",
        f"{fusion}",
        "",
        f"| case | precision | tokens/s | p25-p75 | vs {ref} | params MiB | grads MiB | optimizer MiB | activations MiB "
        f"| final loss | max abs(loss - {ref}) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        m = r["memory_mib"]
        lo, hi = r["tokens_per_s_p25_p75"]
        diff = max((abs(a - b) for a, b in zip(r["losses"], base)), default=0.0)
        lines.append(f"| {name} | {r['precision']} | {r['tokens_per_s']:.0f} | {lo:.0f}-{hi:.0f} | "
                     f"{r['tokens_per_s'] / ref_tps:.2f} | {m['parameters']:.2f} | {m['gradients']:.2f} | "
                     f"{m['optimizer_state']:.2f} | {m['activations_peak']:.2f} | {r['losses'][-1]:.4f} | {diff:.2g} |")
    lines += ["", *[f"![{img}]({img})" for img in images], ""]
    return "\n".join(lines)


def _fused_case_blocker(build: bool) -> Optional[str]:
    """Why the fused case cannot run here without compiling in the training job (None: it can)."""
    from lightning_npu.ops import extension

    status = extension.status()
    if status.problem:
        return f"The fused kernels cannot be built here: {status.problem}."
    if not status.built:
        if build:
            extension.build()
            return None
        return ("The fused kernels are not built for this torch, CPU and checkout (a cold build takes minutes); "
                "run `lightning-npu build-ops` once, or pass `--build-ops`, and rerun.")
    return None


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--only", default=",".join(CASES), help="comma-separated case names")
    p.add_argument("--build-ops", action="store_true", help="build the fused kernels first if they are not built")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent))
    args = p.parse_args(argv)
    names = args.only.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        p.error(f"--only: unknown case(s) {unknown}; choose from {list(CASES)}")
    started, meta = time.perf_counter(), _env.metadata()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skipped = _fused_case_blocker(args.build_ops) if FUSED in names else None
    if skipped:
        names.remove(FUSED)
        print(f"skipping {FUSED}: {skipped}", flush=True)
    ranks = spawn(run_cases, WORLD, names, args.steps, args.warmup, args.repeats)
    results = {name: summarise(name, [r[name] for r in ranks]) for name in names}
    for name, r in results.items():
        print(f"{name:26s} {r['tokens_per_s']:9.0f} tokens/s", flush=True)
    wall_s = time.perf_counter() - started
    meta["load_average_end"] = _env.load_average()
    subtitle = f"{meta['date'][:10]}, commit {(meta.get('commit') or '?')[:8]}, {meta['cpu_model']}, load " + (
        "/".join(f"{x:g}" for x in meta["load_average_1_5_15min"] or []) or "n/a")
    images = plot(results, out, subtitle)
    fusion = fusion_note(results, skipped)
    (out / "report.md").write_text(markdown(results, args, images, meta, wall_s, fusion))
    payload = {"config": vars(args), "wall_s": wall_s, "fusion": fusion, "results": results, "environment": meta}
    _env.write_json(out / "results" / "report.json", payload)
    print(f"wrote {out / 'report.md'} in {wall_s:.0f} s")
    return payload


if __name__ == "__main__":
    main()
