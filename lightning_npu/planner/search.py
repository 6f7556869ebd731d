"""Enumerate tp x pp x dp x ZeRO stage x micro-batch size x recomputation (x sequence parallelism, x interleave
depth v, x expert parallelism for MoE models), reject the layouts that cannot run or do not fit (saying why), and rank the rest by estimated tokens
per second."""

from __future__ import annotations

from typing import Optional

from lightning_npu.planner.branches.search import plan_branched
from lightning_npu.planner.branches.model import BranchedModel
from lightning_npu.planner.memory import GB, peak_memory
from lightning_npu.planner.read import model_from_config
from lightning_npu.planner.result import Estimate, Plan
from lightning_npu.planner.spec import (
    ACCOUNTINGS,
    ALTERNATE,
    OPTIMIZERS,
    PRECISIONS,
    RECOMPUTE,
    SCHEDULES,
    ClusterSpec,
    Layout,
    ModelSpec,
    PlannerError,
)
from lightning_npu.planner.timing import step_time
from lightning_npu.validate import check_choice


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _structural_reason(model: ModelSpec, cluster: ClusterSpec, tp: int, pp: int, dp: int) -> Optional[str]:
    if model.heads % tp or model.n_kv_heads % tp:
        return f"tp does not divide the attention heads ({model.heads} query, {model.n_kv_heads} key/value)"
    if tp > model.hidden // 4:
        return "tp > hidden/4 (each rank would hold slivers of every matrix)"
    if cluster.devices > cluster.devices_per_node and cluster.devices_per_node % tp:
        return f"tp straddles nodes (tp does not divide devices_per_node={cluster.devices_per_node})"
    if pp > model.layers:
        return f"pp > layers={model.layers}"
    if model.global_batch % dp:
        return f"dp does not divide global_batch={model.global_batch}"
    return None


def max_usable_devices(model: ModelSpec, cluster: ClusterSpec) -> int:
    tp = max(d for d in _divisors(model.heads) if model.n_kv_heads % d == 0 and d <= max(1, model.hidden // 4)
             and cluster.devices_per_node % d == 0)
    return tp * model.layers * model.global_batch


def _meshes(model: ModelSpec, devices: int, context_parallel: Optional[tuple[int, ...]]) -> list[tuple[int, int, int]]:
    """(tp, pp, cp) of every mesh of `devices` (dp takes the rest); cp > 1 only with SDPA attention and a sequence
    that splits into 2cp load-balanced chunks, as the strategy's context parallelism requires."""
    out = []
    for tp in _divisors(devices):
        for pp in _divisors(devices // tp):
            for cp in _divisors(devices // (tp * pp)):
                if cp > 1 and (model.attention == "eager" or model.seq % (2 * cp)):
                    continue
                if context_parallel is not None and cp not in context_parallel:
                    continue
                out.append((tp, pp, cp))
    return out


def _virtual_stages(model: ModelSpec, pp: int, micro_batches: int, schedule: str,
                    virtual_stages: Optional[tuple[int, ...]]) -> list[int]:
    """The interleave depths v to try: 1 unless interleaved; else 2 .. layers // pp (each chunk at least one
    block) for which torch's ScheduleInterleaved1F1B takes the micro-batches (a multiple of max(1, M // pp))."""
    if schedule != "interleaved_1f1b" or pp == 1:
        return [1]
    rounds = max(1, micro_batches // pp)
    if micro_batches % rounds:
        return []
    candidates = virtual_stages or tuple(range(2, model.layers // pp + 1))
    return [v for v in candidates if v >= 2 and pp * v <= model.layers]


def _zero_and_expert_sizes(model: ModelSpec, zero_stages: tuple[int, ...], pp: int, dp: int) -> list[tuple[int, int]]:
    """(ZeRO stage, expert-parallel size) pairs: ep divides dp and the experts; it composes with every ZeRO stage
    (the experts' states sharded over the dp / ep ranks that hold them, `memory.memory_by_stage`)."""
    eps = [e for e in _divisors(dp) if model.experts and model.experts % e == 0 and e > 1]
    out = []
    for zero in zero_stages:
        if dp == 1 and zero > 0:
            continue  # nothing to shard over
        out.append((zero, 1))
        out.extend((zero, e) for e in eps)
    return out


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
    virtual_stages: Optional[tuple[int, ...]] = None,
    micro_batch_sizes: Optional[tuple[int, ...]] = None,
    max_micro_batch_size: int = 8,
    accounting: str = "lightning-npu",
    context_parallel: Optional[tuple[int, ...]] = None,
    top: Optional[int] = None,
) -> Plan:
    """Rank every layout of `model` on `cluster` by estimated tokens/s.

    `model` is a `ModelSpec`, its fields as a dict, or the path of a LightningCLI config, or a multi-branch
    `BranchedModel` (CLIP's towers: ranked by `branches.search.plan_branched`, each tower at its own tp);
    `cluster` a
    `ClusterSpec` or its fields. Searched: tp x pp x dp, the ZeRO stages, the micro-batch sizes (the divisors of the
    per-dp batch up to `max_micro_batch_size`, or `micro_batch_sizes`), the recomputation policies, sequence
    parallelism, under ``schedule="interleaved_1f1b"``, the interleave depth v (`virtual_stages`, default every
    v with at least one block per chunk) and the context-parallel size cp (`context_parallel`, default every cp
    that splits the sequence into 2cp chunks, where the strategy composes it: without pp, ep, sequence parallelism
    or selective recomputation, with SDPA attention). `accounting` says whose optimizer memory to assume (ours; ``"paper"``/
    ``"deepspeed"``; ``"megatron"``: see `model_state_bytes`). Layouts that cannot run or do not fit in device
    memory are counted in ``Plan.rejected`` by reason. Pure arithmetic: nothing is allocated, no process group is
    created.
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
    check_choice("accounting", accounting, ACCOUNTINGS, error=PlannerError)
    for r in recompute:
        if r == ALTERNATE:
            raise PlannerError(
                f"`recompute={recompute!r}`: {ALTERNATE!r} (torchtitan's op-level policy) is costed by step_time and "
                f"memory_by_stage to check other frameworks' runs, but not searched: the strategy's "
                f"activation_checkpointing does not run it; choose from {list(RECOMPUTE)}.")
        check_choice("recompute", r, RECOMPUTE, error=PlannerError)
    for z in zero_stages:
        check_choice("zero_stage", z, (0, 1, 2, 3), error=PlannerError)
    if isinstance(model, BranchedModel):  # towers at their own tp (`branch_layouts`): `branches.search`
        asked = (recompute != RECOMPUTE and any(recompute)) or (sequence_parallel != (False, True)
                                                                and any(sequence_parallel))
        if schedule != "1f1b" or context_parallel not in (None, (1,)) or asked:
            raise PlannerError(
                f"a multi-branch model with schedule={schedule!r}, context_parallel={context_parallel!r}, "
                f"recompute={recompute!r} or sequence_parallel={sequence_parallel!r}: branch_layouts compose with "
                "tensor and data parallelism only (no pp, cp, recomputation or sequence parallelism are searched); "
                "leave those at their defaults.")
        result = Plan(model, cluster, precision, optimizer, ranked=[], accounting=accounting)
        plan_branched(model, cluster, precision=precision, optimizer=optimizer, zero_stages=zero_stages,
                      micro_batch_sizes=micro_batch_sizes, max_micro_batch_size=max_micro_batch_size,
                      accounting=accounting, result=result)
        result.ranked.sort(key=lambda e: (-e.tokens_per_s, e.memory.total))
        result.ranked = result.ranked[:top] if top is not None else result.ranked
        return result
    usable = max_usable_devices(model, cluster)
    if cluster.devices > usable:
        raise PlannerError(
            f"`devices={cluster.devices}` is more than any layout can use: at most tp x pp x dp = {usable} ranks "
            f"(tp <= the largest usable divisor of heads, pp <= layers={model.layers}, dp <= "
            f"global_batch={model.global_batch}); lower --devices or raise --global-batch."
        )

    result = Plan(model, cluster, precision, optimizer, ranked=[], accounting=accounting)
    budget = cluster.usable_bytes / cluster.memory_overhead
    tokens = model.global_batch * model.seq
    for tp, pp, cp in _meshes(model, cluster.devices, context_parallel):
        dp = cluster.devices // (tp * pp * cp)
        reason = _structural_reason(model, cluster, tp, pp, dp)
        if not reason and schedule == "interleaved_1f1b" and pp > 1 and pp * 2 > model.layers:
            reason = f"pp x 2 interleaved stages > layers={model.layers}"
        if reason:
            result.rejected[reason] += 1
            result.considered += 1
            continue
        per_dp = model.global_batch // dp
        sizes = micro_batch_sizes or [d for d in _divisors(per_dp) if d <= max_micro_batch_size]
        for b in [d for d in sizes if per_dp % d == 0]:
            m = per_dp // b
            if pp > 1 and schedule != "gpipe" and m < pp:
                result.rejected["micro_batches < pp (1F1B needs one per stage)"] += 1
                result.considered += 1
                continue
            depths = _virtual_stages(model, pp, m, schedule, virtual_stages)
            if not depths:
                result.rejected["interleaved 1F1B needs micro_batches a multiple of max(1, M // pp)"] += 1
                result.considered += 1
                continue
            for zero, ep in _zero_and_expert_sizes(model, zero_stages, pp, dp * cp):
                if cp > 1 and ep > 1:
                    continue
                for rc in recompute:
                    if cp > 1 and rc == "selective":
                        continue
                    for sp in sequence_parallel:
                        if sp and (tp == 1 or cp > 1 or not model.sequence_parallel_ok):
                            continue
                        for v in depths:
                            result.considered += 1
                            layout = Layout(tp, pp, dp, zero, m, b, rc, sp, schedule, v if v > 1 else None, ep,
                                            cp)
                            peak = peak_memory(model, layout, precision, optimizer, accounting)
                            if peak.total > budget:
                                result.rejected[f"does not fit in {cluster.usable_bytes / GB:.1f} GB usable "
                                                "per device"] += 1
                                continue
                            t = step_time(model, cluster, layout, precision)
                            result.ranked.append(Estimate(layout, peak, t, tokens / t.step_s))
    result.ranked.sort(key=lambda e: (-e.tokens_per_s, e.memory.total))
    if top is not None:
        result.ranked = result.ranked[:top]
    return result


def distinct_shapes(ranked: list[Estimate]) -> list[tuple[int, ...]]:
    """The (tp, pp, dp) shapes of `ranked` ((tp, pp, dp, cp) where cp > 1), best first, each once: what "among the
    top 3 shapes" counts."""
    out: list[tuple[int, ...]] = []
    for e in ranked:
        shape = (e.layout.tp, e.layout.pp, e.layout.dp) + ((e.layout.cp,) if e.layout.cp > 1 else ())
        if shape not in out:
            out.append(shape)
    return out
