"""Enumerate tp x pp x dp x ZeRO stage x micro-batches x recomputation (x sequence parallelism), reject the
layouts that cannot run or do not fit (saying why), and rank the rest by estimated tokens per second."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_npu.planner.memory import GB, StageMemory, peak_memory
from lightning_npu.planner.spec import (
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE,
    SCHEDULES,
    VIRTUAL_STAGES,
    ClusterSpec,
    Layout,
    ModelSpec,
    PlannerError,
    model_from_config,
)
from lightning_npu.planner.timing import StepTime, step_time
from lightning_npu.validate import check_choice


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: StageMemory  # the stage that needs the most
    time: StepTime
    tokens_per_s: float

    def to_dict(self, devices: int) -> dict[str, Any]:
        lay = self.layout
        return {
            "layout": {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "zero_stage": lay.zero_stage,
                       "micro_batches": lay.micro_batches, "micro_batch_size": lay.micro_batch_size,
                       "activation_checkpointing": lay.recompute, "sequence_parallel": lay.sequence_parallel,
                       "pipeline_schedule": lay.schedule},
            "memory_gb": self.memory.as_gb(),
            "memory_stage": self.memory.stage,
            "step_time_s": self.time.step_s,
            "step_time_breakdown_s": {"compute": self.time.compute_s, "tensor_parallel": self.time.tp_comm_s,
                                      "pipeline_bubble_p2p": self.time.pipeline_s,
                                      "data_parallel_exposed": self.time.dp_comm_s},
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_device": self.time.tflops_per_device(devices),
            "strategy": lay.strategy_init_args(),
        }


@dataclass
class Plan:
    model: ModelSpec
    cluster: ClusterSpec
    precision: str
    optimizer: str
    ranked: list[Estimate]
    rejected: Counter = field(default_factory=Counter)  # reason -> number of layouts
    considered: int = 0

    @property
    def best(self) -> Optional[Estimate]:
        return self.ranked[0] if self.ranked else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _structural_reason(model: ModelSpec, cluster: ClusterSpec, tp: int, pp: int, dp: int) -> Optional[str]:
    if model.heads % tp or model.n_kv_heads % tp:
        return f"tp does not divide the attention heads ({model.heads} query, {model.n_kv_heads} key/value)"
    if tp > model.hidden // 4:
        return "tp > hidden/4 (each rank would hold slivers of every matrix)"
    if tp > cluster.devices_per_node:
        return f"tp crosses nodes (tp > devices_per_node={cluster.devices_per_node})"
    if pp > model.layers:
        return f"pp > layers={model.layers}"
    if model.global_batch % dp:
        return f"dp does not divide global_batch={model.global_batch}"
    return None


def max_usable_devices(model: ModelSpec, cluster: ClusterSpec) -> int:
    tp = max(d for d in _divisors(model.heads) if model.n_kv_heads % d == 0 and d <= max(1, model.hidden // 4)
             and d <= cluster.devices_per_node)
    return tp * model.layers * model.global_batch


def plan(
    model: ModelSpec | dict | str,
    cluster: ClusterSpec | dict,
    *,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    zero_stages: tuple[int, ...] = (0, 1, 2, 3),
    recompute: tuple[Optional[str], ...] = RECOMPUTE,
    sequence_parallel: tuple[bool, ...] = (False, True),
    schedule: str = "1f1b",
    max_micro_batch_size: int = 8,
    top: Optional[int] = None,
) -> Plan:
    """Rank every layout of `model` on `cluster` by estimated tokens/s.

    `model` is a `ModelSpec`, its fields as a dict, or the path of a LightningCLI config; `cluster` a
    `ClusterSpec` or its fields. Layouts that cannot run or do not fit in device memory are counted in
    ``Plan.rejected`` by reason. Pure arithmetic: nothing is allocated, no process group is created.
    """
    if isinstance(model, str):
        model = model_from_config(model)
    elif isinstance(model, dict):
        model = ModelSpec(**model)
    if isinstance(cluster, dict):
        cluster = ClusterSpec(**cluster)
    check_choice("precision", precision, PRECISIONS, error=PlannerError)
    check_choice("optimizer", optimizer, OPTIMIZERS, error=PlannerError)
    check_choice("schedule", schedule, SCHEDULES, error=PlannerError)
    for r in recompute:
        check_choice("recompute", r, RECOMPUTE, error=PlannerError)
    for z in zero_stages:
        check_choice("zero_stage", z, (0, 1, 2, 3), error=PlannerError)
    usable = max_usable_devices(model, cluster)
    if cluster.devices > usable:
        raise PlannerError(
            f"`devices={cluster.devices}` is more than any layout can use: at most tp x pp x dp = {usable} ranks "
            f"(tp <= the largest usable divisor of heads, pp <= layers={model.layers}, dp <= "
            f"global_batch={model.global_batch}); lower --devices or raise --global-batch."
        )

    result = Plan(model, cluster, precision, optimizer, ranked=[])
    budget = cluster.usable_bytes
    tokens = model.global_batch * model.seq
    for tp in _divisors(cluster.devices):
        for pp in _divisors(cluster.devices // tp):
            dp = cluster.devices // (tp * pp)
            reason = _structural_reason(model, cluster, tp, pp, dp)
            if not reason and schedule == "interleaved_1f1b" and pp > 1 and pp * VIRTUAL_STAGES > model.layers:
                reason = f"pp x {VIRTUAL_STAGES} interleaved stages > layers={model.layers}"
            if reason:
                result.rejected[reason] += 1
                result.considered += 1
                continue
            per_dp = model.global_batch // dp
            for b in [d for d in _divisors(per_dp) if d <= max_micro_batch_size]:
                m = per_dp // b
                if pp > 1 and schedule != "gpipe" and m < pp:
                    result.rejected["micro_batches < pp (1F1B needs one per stage)"] += 1
                    result.considered += 1
                    continue
                for zero in zero_stages:
                    if dp == 1 and zero > 0:
                        continue  # nothing to shard over
                    for rc in recompute:
                        for sp in sequence_parallel:
                            if sp and (tp == 1 or not model.sequence_parallel_ok):
                                continue
                            result.considered += 1
                            layout = Layout(tp, pp, dp, zero, m, b, rc, sp, schedule)
                            peak = peak_memory(model, layout, precision, optimizer)
                            if peak.total > budget:
                                result.rejected[f"does not fit in {budget / GB:.1f} GB usable per device"] += 1
                                continue
                            t = step_time(model, cluster, layout, precision)
                            result.ranked.append(Estimate(layout, peak, t, tokens / t.step_s))
    result.ranked.sort(key=lambda e: (-e.tokens_per_s, e.memory.total))
    if top is not None:
        result.ranked = result.ranked[:top]
    return result
