"""Rank the layouts of a multi-branch model: top-level tp x dp, every tower's own tp (a divisor of the top-level tp,
the largest tower tp being the top level's) and its own ZeRO stage (0; 1: ZeRO-1's optimizer state over fdp =
top-level dp x branch dp; 2/3: FSDP2 over fdp), the micro-batch size and the top-level ZeRO stage.

Only what the strategy builds with `branch_layouts` is searched (`parallel.branch.spec`): no pp, ep, cp or sequence
parallelism; a branch ZeRO of 0 to 3 (1-3 where `zero_stages` has them and fdp > 1, on an uncompressed tower: its
compressed reduce-scatter is not costed); the top-level ZeRO 0/1 under any branch stages, 2/3 only with every tower at
2/3 (the strategy refuses a ZeRO-0 or ZeRO-1 branch under them), and 0 only where a tower with branch dp runs 1-bit
Adam (``frozen_variance``: the strategy refuses it beside any ZeRO); no activation recomputation (untested with
branches). A tower's tp must divide its heads and its branch dp the micro-batch, as the strategy checks.
"""

from __future__ import annotations

from itertools import product
from typing import Optional

from lightning_npu.planner.branches.cost import branch_costs, branched_memory, branched_step_time
from lightning_npu.planner.branches.model import BranchedModel, one_bit_adam
from lightning_npu.planner.memory import GB
from lightning_npu.planner.result import Estimate, Plan
from lightning_npu.planner.spec import BranchChoice, ClusterSpec, Layout, PlannerError


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tower_tps(model: BranchedModel, cluster: ClusterSpec, top_tp: int) -> list[list[int]]:
    """Each tower's usable tp sizes inside a top-level tp group of `top_tp` ranks."""
    return [[t for t in _divisors(top_tp) if tw.model.heads % t == 0 and t <= max(1, tw.model.hidden // 4)]
            for tw in model.towers]


def max_top_tp(model: BranchedModel, cluster: ClusterSpec) -> int:
    """The largest tp any tower can take inside a node: the top-level tp's bound."""
    return max(t for tw in model.towers for t in _divisors(cluster.devices_per_node)
               if tw.model.heads % t == 0 and t <= max(1, tw.model.hidden // 4))


def plan_branched(model: BranchedModel, cluster: ClusterSpec, *, precision: str, optimizer: str,
                  zero_stages: tuple[int, ...], micro_batch_sizes: Optional[tuple[int, ...]],
                  max_micro_batch_size: int, accounting: str, result: Plan) -> Plan:
    """Fill `result` (the caller's `Plan`) with every buildable layout of `model` that fits, and count the rest by
    reason."""
    usable = max_top_tp(model, cluster) * model.global_batch
    if cluster.devices > usable:
        raise PlannerError(
            f"`devices={cluster.devices}` is more than a multi-branch layout can use: at most tp x dp = {usable} "
            f"(tp within a node and dividing a tower's heads, dp <= global_batch={model.global_batch}); lower "
            "--devices or raise --global-batch.")
    budget = cluster.usable_bytes / cluster.memory_overhead
    samples = model.global_batch
    for top in _divisors(cluster.devices):
        dp = cluster.devices // top
        reason = None
        if top > cluster.devices_per_node or (cluster.devices > cluster.devices_per_node
                                              and cluster.devices_per_node % top):
            reason = f"tp straddles nodes (tp does not divide devices_per_node={cluster.devices_per_node})"
        elif model.global_batch % dp:
            reason = f"dp does not divide global_batch={model.global_batch}"
        if reason:
            result.rejected[reason] += 1
            result.considered += 1
            continue
        per_dp = model.global_batch // dp
        sizes = [b for b in (micro_batch_sizes or [d for d in _divisors(per_dp) if d <= max_micro_batch_size])
                 if per_dp % b == 0]
        options = tower_tps(model, cluster, top)
        for tps in product(*options):
            if max(tps) != top:
                continue  # a top-level tp no tower uses only replicates the trunk: that is a smaller tp with more dp
            for b in sizes:
                if any(b % (top // t) for t in tps):
                    result.rejected["a tower's branch dp does not divide the micro-batch"] += 1
                    result.considered += 1
                    continue
                towers_zero = [[0] + [z for z in (1, 2, 3) if z in zero_stages and tw.compression is None
                                      and dp * top // t > 1]
                               for tw, t in zip(model.towers, tps)]
                for zero, zs in product(zero_stages, product(*towers_zero)):
                    if (zero and dp == 1) or (zero > 1 and min(zs) < 2):
                        continue  # nothing to shard at dp 1; a ZeRO-0/1 branch under a top-level ZeRO 2/3: refused
                    result.considered += 1
                    if zero and any(one_bit_adam(tw.compression) and t < top for tw, t in zip(model.towers, tps)):
                        result.rejected["1-bit Adam (frozen_variance) on a tower needs the top-level zero_stage 0"] += 1
                        continue
                    choices = tuple(BranchChoice(tw.glob, t, tw.compression, z)
                                    for tw, t, z in zip(model.towers, tps, zs))
                    layout = Layout(top, 1, dp, zero, per_dp // b, b, branches=choices)
                    costs = branch_costs(model, cluster, layout, precision, optimizer, accounting)
                    memory = branched_memory(model, layout, costs, precision, optimizer, accounting)
                    if memory.total > budget:
                        result.rejected[f"does not fit in {cluster.usable_bytes / GB:.1f} GB usable per device"] += 1
                        continue
                    t = branched_step_time(model, cluster, layout, costs, precision)
                    tokens = sum(samples * tw.model.seq for tw in model.towers)
                    result.ranked.append(Estimate(layout, memory, t, tokens / t.step_s, tuple(costs)))
    return result
