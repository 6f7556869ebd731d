"""Example GPT throughput: `npu_hybrid` (dp=2) vs Lightning's `"ddp"`, side by side in one run.

Runs each configuration `--repeats` times, alternating, each in 2 fresh real processes; reports the
median tokens/s over all timed steps, median step time, peak RSS per rank, and ours/DDP ratios.

    python benchmarks/throughput.py [--steps 30] [--warmup 5] [--repeats 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import environment, median, run_gpt, write_json  # noqa: E402
from lightning_npu.launch import spawn  # noqa: E402

MODEL = dict(n_layer=4, n_head=4, n_embd=128, block_size=128)
PER_RANK_BATCH = 8
WORLD = 2


def worker(strategy_name: str, steps: int, warmup: int) -> dict:
    from lightning_npu import NPUHybridStrategy

    strategies = {
        "ddp": "ddp",
        "npu_hybrid_zero0": NPUHybridStrategy(zero_stage=0),
        "npu_hybrid_zero1": NPUHybridStrategy(zero_stage=1),
    }
    return run_gpt(strategies[strategy_name], WORLD, steps, warmup, PER_RANK_BATCH, MODEL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    names = ["ddp", "npu_hybrid_zero0", "npu_hybrid_zero1"]
    raw: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for name in names:
            raw[name].extend(spawn(worker, WORLD, name, args.steps, args.warmup))

    tokens_per_step = PER_RANK_BATCH * MODEL["block_size"] * WORLD
    results = {}
    for name, ranks in raw.items():
        # a step ends when the slowest rank ends it: take the per-step max over ranks of each repeat
        step_times = [max(ts) for i in range(0, len(ranks), WORLD) for ts in zip(*(r["step_times"] for r in ranks[i:i + WORLD]))]
        results[name] = {
            "tokens_per_s_median": tokens_per_step / median(step_times),
            "step_time_s_median": median(step_times),
            "timed_steps": len(step_times),
            "peak_rss_mib_per_rank": [r["peak_rss_bytes"] / 2**20 for r in ranks[:WORLD]],
            "final_loss": ranks[0]["final_loss"],
        }
    base = results["ddp"]["tokens_per_s_median"]
    for name in names:
        results[name]["ratio_vs_ddp"] = results[name]["tokens_per_s_median"] / base
    payload = {
        "benchmark": "throughput",
        "model": MODEL,
        "per_rank_batch": PER_RANK_BATCH,
        "world_size": WORLD,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "environment": environment(),
        "results": results,
    }
    path = write_json("throughput.json", payload)
    print(f"{'config':<20}{'tokens/s':>12}{'step ms':>10}{'ratio/ddp':>11}{'peak RSS MiB (r0,r1)':>24}")
    for name, r in results.items():
        rss = ", ".join(f"{x:.0f}" for x in r["peak_rss_mib_per_rank"])
        print(f"{name:<20}{r['tokens_per_s_median']:>12.0f}{r['step_time_s_median'] * 1e3:>10.1f}"
              f"{r['ratio_vs_ddp']:>11.3f}{rss:>24}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
