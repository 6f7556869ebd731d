"""`lightning-npu plan --calibrate RUN_DIR`: fit the planner's efficiency and memory overhead to a measured run.

A run's log directory (LightningCLI's ``lightning_logs/version_N``, or any folder above it: the newest is taken) holds
``config.yaml`` (the model, the data's batch, the trainer's devices, precision and strategy) and ``metrics.csv``
(Lightning's CSVLogger, the default logger without TensorBoard): ``tokens_per_s`` (the example GPT and Llama log it
every step; ``samples_per_s`` for examples/clip, whose towers see different token counts) gives the measured step
time, ``MemoryMonitor``'s ``memory/*_bytes`` the measured peak. The step time is A / efficiency + B in the
efficiency (compute scales with it, communication does not), so two evaluations give A and B and the efficiency
that matches the median measured step; the memory overhead is measured / estimated peak: the allocator's
``max_allocated`` against the whole estimate on a device, or on CPU (no allocator statistics) the tensors
MemoryMonitor counts (weights, gradients, optimizer state, saved activations) against the same parts.
"""

from __future__ import annotations

import csv
import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_npu.config_file import ConfigFileError, read_config
from lightning_npu.planner.branches.cost import branch_costs, branched_memory, branched_step_time
from lightning_npu.planner.branches.model import BranchedModel
from lightning_npu.planner.memory import StageMemory, memory_by_stage
from lightning_npu.planner.read import model_from_config
from lightning_npu.planner.spec import BranchChoice, ClusterSpec, Layout, PlannerError
from lightning_npu.planner.timing import StepTime, step_time

_COUNTED = ("parameters", "gradients", "optimizer_state", "activations_peak")


@dataclass(frozen=True)
class Calibration:
    run_dir: Path
    model: Any  # a ModelSpec or a planner.branches.model.BranchedModel
    layout: Layout
    precision: str
    measured_step_s: float
    predicted_step_s: float  # with the fitted efficiency
    uncalibrated_step_s: float
    measured_peak_bytes: float
    estimated_peak_bytes: float  # before the overhead factor
    efficiency: float
    memory_overhead: float
    steps: int

    def cluster(self, cluster: ClusterSpec) -> ClusterSpec:
        """`cluster` with the fitted efficiency and memory overhead."""
        return dataclasses.replace(cluster, gemm_efficiency=self.efficiency, memory_overhead=self.memory_overhead)


def find_run(run_dir: str | Path) -> Path:
    """The folder of `run_dir` (or the newest below it) that holds a metrics.csv and a config.yaml."""
    root = Path(run_dir)
    if not root.is_dir():
        raise PlannerError(f"--calibrate {root}: no such directory; pass a run's log directory, e.g. "
                           "runs/gpt/lightning_logs/version_0 (or runs/gpt: the newest run below it).")
    found = [p.parent for p in root.rglob("metrics.csv") if (p.parent / "config.yaml").is_file()]
    if not found:
        raise PlannerError(f"--calibrate {root}: no metrics.csv beside a config.yaml below it; train with "
                           "`lightning-npu fit --config ...` (LightningCLI saves config.yaml, the CSV logger "
                           "metrics.csv).")
    return max(found, key=lambda p: (p / "metrics.csv").stat().st_mtime)


def _rows(path: Path) -> list[dict[str, float]]:
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            out.append({k: float(v) for k, v in row.items() if k and v not in ("", None)})
    return out


def layout_from_config(config: dict[str, Any], model: Any) -> tuple[Layout, str, int]:
    """The layout, precision and world size a LightningCLI config ran."""
    trainer = config.get("trainer") or {}
    strategy = trainer.get("strategy") or {}
    args = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    devices = trainer.get("devices", 1)
    if not isinstance(devices, int):
        raise PlannerError(f"the run's trainer.devices is {devices!r}; --calibrate needs a number of devices.")
    world = devices * int(trainer.get("num_nodes", 1) or 1)
    tp, pp = int(args.get("tensor_parallel_size", 1)), int(args.get("pipeline_parallel_size", 1))
    dp = args.get("data_parallel_size", "auto")
    dp = world // (tp * pp) if dp in (None, "auto") else int(dp)
    per_dp = model.global_batch // dp
    m = int(args.get("micro_batches") or pp) if pp > 1 else int(trainer.get("accumulate_grad_batches", 1) or 1)
    recompute = args.get("activation_checkpointing")
    zero = int(args.get("zero_stage", 1 if dp > 1 else 0))
    layout = Layout(tp, pp, dp, zero, m, max(1, per_dp // m),
                    recompute if recompute in ("full", "selective") else None, bool(args.get("sequence_parallel")),
                    args.get("pipeline_schedule") or "1f1b", branches=_branches(model, args, tp, zero))
    return layout, str(trainer.get("precision", "32-true")), world


def _branches(model: Any, args: dict[str, Any], tp: int, zero: int) -> tuple[BranchChoice, ...]:
    """Every tower's `BranchChoice` from the run's ``branch_layouts`` (a tower it leaves out runs at the top-level
    tp; one without its own zero_stage under a top-level ZeRO 2/3 takes that stage, as the strategy does); none for
    a single-tower model."""
    if not isinstance(model, BranchedModel):
        return ()
    given = args.get("branch_layouts") or {}
    out = []
    for t in model.towers:
        entry = given.get(t.glob) or {}
        out.append(BranchChoice(t.glob, int(entry.get("tensor_parallel_size", tp)), t.compression,
                                int(entry.get("zero_stage", zero if zero in (2, 3) else 0))))
    return tuple(out)


def estimate(model: Any, cluster: ClusterSpec, layout: Layout, precision: str,
             optimizer: str = "adamw") -> tuple[StepTime, StageMemory]:
    """The step time and the first stage's bytes of `layout` (rank 0 logs: the first stage), for either kind of
    model."""
    if isinstance(model, BranchedModel):
        costs = branch_costs(model, cluster, layout, precision, optimizer)
        return (branched_step_time(model, cluster, layout, costs, precision),
                branched_memory(model, layout, costs, precision, optimizer))
    return (step_time(model, cluster, layout, precision),
            memory_by_stage(model, layout, precision, optimizer, (0,))[0])


def fit_efficiency(model: Any, cluster: ClusterSpec, layout: Layout, measured_step_s: float,
                   precision: str = "bf16-mixed", optimizer: str = "adamw") -> float:
    """The `gemm_efficiency` at which `layout`'s estimated step is `measured_step_s`: a step is A / efficiency + B
    (compute scales with it, communication does not), so two evaluations give A and B. Public so that a step time
    measured elsewhere (a published run's throughput) calibrates the same way as `--calibrate`."""
    e0 = cluster.gemm_efficiency
    s1 = estimate(model, cluster, layout, precision, optimizer)[0].step_s
    s2 = estimate(model, dataclasses.replace(cluster, gemm_efficiency=e0 / 2), layout, precision, optimizer)[0].step_s
    a = e0 * (s2 - s1)
    b = s1 - a / e0
    if measured_step_s <= b:
        raise PlannerError(f"the run's step ({measured_step_s:.3g} s) is shorter than the planner's communication "
                           f"alone ({b:.3g} s): raise --intra-node-gbps/--inter-node-gbps to this machine's.")
    efficiency = a / (measured_step_s - b)
    if efficiency > 1:
        raise PlannerError(f"the run is faster than --peak-tflops {cluster.peak_tflops:g} allows (fitted efficiency "
                           f"{efficiency:.2f} > 1): pass this device's peak.")
    return efficiency


def calibrate(run_dir: str | Path, cluster: ClusterSpec, optimizer: str = "adamw", skip: int = 2) -> Calibration:
    """Fit `cluster`'s efficiency and memory overhead to the run in `run_dir` (its first `skip` steps are left out:
    start-up, the pipeline's shape inference)."""
    run = find_run(run_dir)
    try:
        config = read_config(run / "config.yaml")
    except ConfigFileError as err:
        raise PlannerError(f"--calibrate {err}") from None
    model = model_from_config(run / "config.yaml")
    # one optimizer step's sequences: the data's batch on every dp rank (tp and pp peers share one), times the
    # accumulated batches at pp = 1 (under pp the pipeline splits each rank's batch into its micro-batches)
    layout, precision, world = layout_from_config(config, model)
    batch = int(((config.get("data") or {}).get("init_args") or {}).get("batch_size", model.global_batch // world))
    global_batch = batch * layout.dp * (layout.micro_batches if layout.pp == 1 else 1)
    model = (model.with_global_batch(global_batch) if isinstance(model, BranchedModel)
             else dataclasses.replace(model, global_batch=global_batch))
    layout, precision, world = layout_from_config(config, model)
    rows = _rows(run / "metrics.csv")
    by_step: dict[float, dict[str, float]] = {}
    for row in rows:
        if "step" in row:
            by_step.setdefault(row["step"], {}).update(row)
    # tokens_per_s (the GPT, Llama) or samples_per_s (CLIP) count one batch on every dp rank: a step is
    # micro_batches of them when accumulating at pp = 1
    key = next((k for k in ("tokens_per_s", "samples_per_s") if any(k in r for r in by_step.values())), "tokens_per_s")
    timed = [r[key] for s, r in sorted(by_step.items()) if s >= skip and r.get(key, 0) > 0]
    if not timed:
        raise PlannerError(f"{run / 'metrics.csv'}: no tokens_per_s or samples_per_s after step {skip}; log one every "
                           "step (the example modules do; --trainer.log_every_n_steps 1) and train a few more steps.")
    per_step = model.global_batch * (1 if key == "samples_per_s" else model.seq)
    measured = per_step / statistics.median(timed)
    cluster = dataclasses.replace(cluster, devices=world, memory_overhead=1.0)
    s1 = estimate(model, cluster, layout, precision, optimizer)[0].step_s
    efficiency = fit_efficiency(model, cluster, layout, measured, precision, optimizer)
    fitted = dataclasses.replace(cluster, gemm_efficiency=efficiency)
    predicted, stage0 = estimate(model, fitted, layout, precision, optimizer)
    predicted = predicted.step_s
    peaks = [r for r in by_step.values() if any(f"memory/{k}_bytes" in r for k in _COUNTED)]
    if any("memory/max_allocated_bytes" in r for r in peaks):
        measured_peak = max(r.get("memory/max_allocated_bytes", 0.0) for r in peaks)
        estimated_peak = stage0.total
    elif peaks:
        measured_peak = max(sum(r.get(f"memory/{k}_bytes", 0.0) for k in _COUNTED) for r in peaks)
        estimated_peak = stage0.total - stage0.buffers
    else:
        measured_peak = estimated_peak = stage0.total  # no MemoryMonitor: no overhead fitted
    return Calibration(run, model, layout, precision, measured, predicted, s1, measured_peak, estimated_peak,
                       efficiency, measured_peak / estimated_peak, len(timed))


def summary(c: Calibration) -> str:
    return "\n".join([
        f"calibrated on {c.run_dir} ({c.layout.describe()}, {c.precision}, {c.steps} timed steps):",
        f"  step time: measured {c.measured_step_s:.4g} s (median), estimated {c.uncalibrated_step_s:.4g} s before and "
        f"{c.predicted_step_s:.4g} s after; fitted efficiency {c.efficiency:.3g} of peak",
        f"  peak memory: measured {c.measured_peak_bytes / 1e6:.4g} MB, estimated "
        f"{c.estimated_peak_bytes / 1e6:.4g} MB; memory overhead x{c.memory_overhead:.3g}",
    ])
