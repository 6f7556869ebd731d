"""tokens/s and peak RSS of the example GPT under 32-true, bf16-mixed and bf16-true (HybridPrecision).

    python benchmarks/precision.py [--steps 20] [--warmup 3] [--out benchmarks/results/precision.json]

Each mode trains in its own fresh process (so peak RSS is its own), one rank on CPU, same model,
data and seed; Lightning's own ``bf16-mixed`` (strategy "auto", MixedPrecision) runs alongside as
the reference for the plugin's overhead (fp32 islands, function mode, loss scaling and its
overflow check). Reported per mode: the median over interleaved rounds of each run's median
step time -> tokens/s, and of its peak RSS.

On CPU bf16 is usually *slower* than fp32 (no bf16 matrix units on most CPUs, plus casts); the
numbers here measure overheads and memory, not the speed-up a bf16 NPU/GPU gives.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = dict(n_layer=4, n_head=4, n_embd=128, block_size=128, bias=True, learning_rate=1e-3)
PER_RANK_BATCH = 8
MODES = [
    ("32-true", "npu_hybrid"),
    ("bf16-mixed", "npu_hybrid"),
    ("bf16-true", "npu_hybrid"),
    ("bf16-mixed", "lightning"),
]


def _worker(precision: str, impl: str, steps: int, warmup: int) -> dict:
    from benchmarks._common import median, run_gpt
    from lightning_npu import NPUHybridStrategy

    strategy = NPUHybridStrategy() if impl == "npu_hybrid" else "auto"
    out = run_gpt(strategy, 1, steps, warmup, PER_RANK_BATCH, MODEL, precision=precision)
    step = median(out["step_times"])
    return {
        "precision": precision,
        "implementation": impl,
        "median_step_s": step,
        "tokens_per_s": PER_RANK_BATCH * MODEL["block_size"] / step,
        "peak_rss_mb": out["peak_rss_bytes"] / 2**20,
        "final_loss": out["final_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="modes run interleaved, this many times each")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from benchmarks._common import environment, median, write_json
    from lightning_npu.launch import spawn

    runs: dict[tuple[str, str], list[dict]] = {mode: [] for mode in MODES}
    for r in range(args.rounds):  # interleaved, so a busy moment on a shared machine hits every mode
        for precision, impl in MODES:
            row = spawn(_worker, 1, precision, impl, args.steps, args.warmup)[0]
            runs[(precision, impl)].append(row)
            print(f"round {r}: {precision:>10} {impl:>10}: {row['tokens_per_s']:9.0f} tokens/s  "
                  f"peak RSS {row['peak_rss_mb']:7.1f} MB  loss {row['final_loss']:.4f}", flush=True)
    rows = []
    for (precision, impl), rs in runs.items():
        rows.append({
            "precision": precision,
            "implementation": impl,
            "tokens_per_s_median": median([x["tokens_per_s"] for x in rs]),
            "peak_rss_mb_median": median([x["peak_rss_mb"] for x in rs]),
            "final_loss": rs[0]["final_loss"],
            "rounds": rs,
        })
        print(f"median {precision:>10} {impl:>10}: {rows[-1]['tokens_per_s_median']:9.0f} tokens/s  "
              f"peak RSS {rows[-1]['peak_rss_mb_median']:7.1f} MB")
    payload = {
        "benchmark": "precision",
        "model": MODEL,
        "per_rank_batch": PER_RANK_BATCH,
        "devices": 1,
        "accelerator": "cpu",
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "note": "CPU, one rank, on a shared 2-core machine: medians over interleaved rounds; bf16 on CPU measures "
        "overheads and memory, not the bf16 speed-up of an NPU/GPU",
        "environment": environment(),
        "results": rows,
    }
    path = Path(args.out) if args.out else None
    if path is None:
        path = write_json("precision.json", payload)
    else:
        from benchmarks import _env

        _env.write_json(path, payload)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
