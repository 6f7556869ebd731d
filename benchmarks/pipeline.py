"""Pipeline parallelism (pp=2) on the example GPT: step time against the bubble model, and peak
activation memory per stage for GPipe vs 1F1B.

For every schedule and micro-batch count M in {2, 4, 8} (same global batch), two real processes
train the example GPT with `NPUHybridStrategy(pipeline_parallel_size=2, micro_batches=M)` through
Lightning's loop. Per rank and timed step it measures:

* the step time, and the *busy* time: wall time inside the stage's `forward_one_chunk` /
  `backward_one_chunk` (compute; waiting for activations/gradients happens outside them). The
  measured idle fraction ``1 - busy / step`` of the busier rank is compared with the bubble model
  ``(P-1)/(M+P-1)``, and the model's step time ``busy * (M+P-1)/M`` with the measured one;
* the peak bytes of activations autograd holds for backward (saved tensors, parameters excluded,
  each storage counted once; `lightning_npu.memory.SavedActivations`) and the peak number of
  micro-batches in flight (forwarded, not yet backwarded) on the stage.

A 1-process run (P=1, same global batch, 1 thread like each pp rank) gives the non-pipelined step time.

    python benchmarks/pipeline.py [--steps 8] [--warmup 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402

from benchmarks._common import environment, median, run_gpt, write_json  # noqa: E402
from lightning_npu.launch import spawn  # noqa: E402
from lightning_npu.memory import SavedActivations, storage_keys  # noqa: E402
from lightning_npu.parallel.pipeline_parallel.runner import bubble_fraction  # noqa: E402

MODEL = dict(n_layer=4, n_head=4, n_embd=128, block_size=128, bias=False)
GLOBAL_BATCH = 16
PP = 2


class PipelineProbe(L.Callback):
    """Per timed step: busy (compute) time of this rank's stage, peak saved activations, peak in-flight."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.busy: list[float] = []
        self.peak_bytes: list[int] = []
        self.peak_in_flight: list[int] = []
        self._installed = False
        self._busy = 0.0
        self._in_flight = 0
        self._max_in_flight = 0
        self._meter: Any = None  # lightning_npu.memory.SavedActivations of the step

    def _install(self, runner: Any) -> None:
        for key, schedule in runner._schedules.items():
            if key[0] != "train":
                continue
            stages = getattr(schedule, "_stages", None) or [schedule._stage]
            for stage in stages:
                fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

                def timed_fwd(*args: Any, _f: Any = fwd, **kwargs: Any) -> Any:
                    t0 = time.perf_counter()
                    out = _f(*args, **kwargs)
                    self._busy += time.perf_counter() - t0
                    self._in_flight += 1
                    self._max_in_flight = max(self._max_in_flight, self._in_flight)
                    return out

                def timed_bwd(*args: Any, _f: Any = bwd, **kwargs: Any) -> Any:
                    t0 = time.perf_counter()
                    out = _f(*args, **kwargs)
                    self._busy += time.perf_counter() - t0
                    self._in_flight -= 1
                    return out

                stage.forward_one_chunk, stage.backward_one_chunk = timed_fwd, timed_bwd
        self._installed = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        runner = trainer.strategy._pipeline
        if trainer.global_step < self.warmup or runner is None:
            return
        if not self._installed:
            self._install(runner)
        self._busy, self._in_flight, self._max_in_flight = 0.0, 0, 0
        self._meter = SavedActivations(ignore=storage_keys(pl_module.parameters()))
        self._meter.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        meter, self._meter = self._meter, None
        if meter is None:
            return
        meter.stop()
        self.busy.append(self._busy)
        self.peak_bytes.append(meter.peak)
        self.peak_in_flight.append(self._max_in_flight)


def worker(schedule: str, micro_batches: int, steps: int, warmup: int) -> dict:
    from lightning_npu import NPUHybridStrategy

    world = PP if micro_batches else 1
    if micro_batches:
        strategy = NPUHybridStrategy(pipeline_parallel_size=PP, micro_batches=micro_batches, pipeline_schedule=schedule)
    else:
        strategy = NPUHybridStrategy(zero_stage=0)
    probe = PipelineProbe(warmup + 1)
    out = run_gpt(strategy, world, steps, warmup, GLOBAL_BATCH, MODEL, callbacks=[probe])
    out.update(busy=probe.busy, peak_saved_bytes=probe.peak_bytes, peak_in_flight=probe.peak_in_flight)
    return out


def summarize(ranks: list[dict], micro_batches: int) -> dict:
    step = max(median(r["step_times"]) for r in ranks)
    busy = [median(r["busy"]) for r in ranks]
    model_bubble = bubble_fraction(PP, micro_batches)
    return {
        "micro_batches": micro_batches,
        "micro_batch_size": GLOBAL_BATCH // micro_batches,
        "step_time_s": step,
        "busy_time_s_per_rank": busy,
        "measured_idle_fraction_per_rank": [1 - b / step for b in busy],
        "bubble_model": model_bubble,
        "model_step_time_s": max(busy) / (1 - model_bubble),
        "peak_saved_activation_mib_per_stage": [max(r["peak_saved_bytes"]) / 2**20 for r in ranks],
        "peak_micro_batches_in_flight_per_stage": [max(r["peak_in_flight"]) for r in ranks],
        "final_loss": ranks[0]["final_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    baseline = spawn(worker, 1, "none", 0, args.steps, args.warmup, threads=1)[0]
    results: dict[str, Any] = {
        "what": "pp=2 example GPT (4 blocks, n_embd=128, block 128), global batch 16, fp32, CPU/gloo, 1 thread per rank",
        "environment": environment(),
        "model": MODEL,
        "global_batch": GLOBAL_BATCH,
        "single_process_step_time_s": median(baseline["step_times"]),
        "schedules": {},
    }
    for schedule in ("1f1b", "gpipe"):
        rows = []
        for m in (2, 4, 8):
            ranks = spawn(worker, PP, schedule, m, args.steps, args.warmup, threads=1)
            rows.append(summarize(ranks, m))
            print(schedule, rows[-1], flush=True)
        results["schedules"][schedule] = rows
    path = write_json("pipeline.json", results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
