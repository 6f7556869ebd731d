"""Memory and step time of a multi-branch layout: each tower at its own tp, the rest of the top-level tp group as its
branch dp (what `lightning_npu.parallel.branch` builds).

Per tower i at tp t_i inside a top-level tp group of T ranks (branch dp d_i = T / t_i), on a micro-batch of b samples
per top-level dp rank:

- it runs on b / d_i samples (its slice of the batch): its activations and compute are the single-tower model's
  (`memory.stage_activation_bytes`, `timing.flops_per_token`) on that slice at tp t_i, its 4 tensor-parallel
  all-reduces per block likewise;
- its outputs (last hidden state and pooled output: b s_i h_i + b h_i values) are all-gathered over d_i in the forward
  (the backward is a slice: no traffic), and held once gathered (counted as a buffer);
- its parameters are 1/t_i of its matrices (the text embedding vocab-sharded, the vision patch projection, class token,
  positions and norms whole), replicated over d_i: their gradients are summed over d_i once per optimizer step, an fp32
  ring all-reduce (2 (d - 1)/d x 4 bytes per value), or with the branch's compression its payload (bf16: a bf16
  all-reduce; int8, topk, onebit: an all-gather of d payloads, the bytes `parallel.data_parallel.compression` sends);
  synchronous, so not overlapped;
- the model states follow the top-level ZeRO stage (0 or 1) over the top-level dp, as the strategy holds them.

The towers run one after another, so their compute and communication add; the top-level dp reduction covers every
parameter on the rank and overlaps the last micro-batch's backward (as in `timing`). The trunk (CLIP's projections
and logit scale) is replicated; its FLOPs and the contrastive logits are left out (under 0.1% of a step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_npu.planner.branches.model import BranchedModel, Tower, compression_spec
from lightning_npu.planner.memory import (
    PRECISION_BYTES,
    StageMemory,
    buffer_bytes,
    model_state_bytes,
    stage_activation_bytes,
    stage_params,
)
from lightning_npu.planner.spec import BranchChoice, ClusterSpec, Layout, PlannerError
from lightning_npu.planner.timing import StepTime, _links, _ring, flops_per_token, model_flops_per_token

CHUNK = 256  # values per int8/onebit scale (`compression.CHUNK`)


@dataclass(frozen=True)
class BranchCost:
    """One tower's share of a rank's memory (bytes) and of a step (seconds)."""

    glob: str
    tp: int
    bdp: int
    samples_per_micro_batch: float  # this rank's slice
    params: float  # on this rank, before ZeRO
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    gathered_output: float  # bytes of the all-gathered outputs (0 at bdp 1)
    compute_s: float  # per step (every micro-batch)
    tp_comm_s: float
    gather_s: float
    grad_sum_s: float  # once per step
    grad_sum_bytes: float  # this rank's payload for the branch-dp sum per step (`BranchGradientSync.sent_bytes`)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def tower_layout(layout: Layout, tp: int, samples: int) -> Layout:
    """The single-tower `Layout` a tower runs: its tp, the top level's dp, ZeRO and micro-batches, its slice."""
    return Layout(tp, 1, layout.dp, layout.zero_stage, layout.micro_batches, samples, layout.recompute)


def grad_sum_payload(values: float, compression: Any) -> tuple[float, int]:
    """(bytes this rank sends, ring factor: 2 all-reduce, 1 all-gather of bdp payloads) for summing `values`
    gradients over the branch dp."""
    spec = compression_spec(compression)
    if spec is None:
        return values * 4, 2
    chunks = math.ceil(values / CHUNK)
    if spec.mode == "bf16":
        return values * 2, 2
    if spec.mode == "int8":
        return chunks * (CHUNK + 4), 1
    if spec.mode == "topk":
        return math.ceil(spec.ratio * values) * 8, 1
    return chunks * (CHUNK // 8 + 4), 1  # onebit: packed signs + a fp32 scale per chunk


def tower_cost(tower: Tower, choice: BranchChoice, layout: Layout, cluster: ClusterSpec, precision: str,
               optimizer: str, accounting: str) -> BranchCost:
    """One tower's costs at `choice` (its tp and compression) inside `layout` (see the module docstring)."""
    m, choice_tp = tower.model, choice.tp
    bdp = layout.tp // choice_tp
    if layout.tp % choice_tp or layout.micro_batch_size % bdp:
        raise PlannerError(f"tower {tower.glob!r} at tp {choice_tp}: its branch dp ({layout.tp} // {choice_tp}) must "
                           f"divide the micro-batch of {layout.micro_batch_size} and its tp the top-level tp "
                           f"{layout.tp}; choose a divisor of both.")
    samples = layout.micro_batch_size // bdp
    lay = tower_layout(layout, choice_tp, samples)
    _, _, _, act = PRECISION_BYTES[precision]
    params = stage_params(m, lay, 0)
    states = model_state_bytes(params, layout.dp, layout.zero_stage, precision, optimizer, accounting=accounting)
    activations = stage_activation_bytes(m, lay, 0, act)
    gathered = layout.micro_batch_size * (m.seq + 1) * m.hidden * act if bdp > 1 else 0.0

    intra, _ = _links(cluster)  # the top-level tp group, and so every branch group, lies inside a node
    rate = cluster.peak_tflops * 1e12 * cluster.gemm_efficiency
    tokens = samples * m.seq
    block, head = flops_per_token(m, layout.recompute)
    compute = (m.layers * block + head) * tokens / choice_tp / rate
    n_allreduce = 4 + (2 if layout.recompute == "full" else 0)
    tp_comm = m.layers * n_allreduce * _ring(tokens * m.hidden * act, choice_tp, *intra)
    gather = _ring(gathered, bdp, *intra, 1)
    sent, factor = grad_sum_payload(params, choice.compression)
    grad_sum = _ring(sent * (bdp if factor == 1 else 1), bdp, *intra, factor) if bdp > 1 else 0.0
    mb = layout.micro_batches
    return BranchCost(tower.glob, choice_tp, bdp, samples, params, states["parameters"], states["gradients"],
                      states["optimizer"], activations, gathered, mb * compute, mb * tp_comm, mb * gather, grad_sum,
                      sent if bdp > 1 else 0.0)


def branch_costs(model: BranchedModel, cluster: ClusterSpec, layout: Layout, precision: str = "bf16-mixed",
                 optimizer: str = "adamw", accounting: str = "lightning-npu") -> list[BranchCost]:
    """Every tower's costs at the `BranchChoice` `layout` gives it."""
    choices = {b.glob: b for b in layout.branches}
    missing = [t.glob for t in model.towers if t.glob not in choices]
    if missing:
        raise PlannerError(f"the layout gives no BranchChoice for the towers {missing}; give every tower one.")
    return [tower_cost(t, choices[t.glob], layout, cluster, precision, optimizer, accounting) for t in model.towers]


def branched_memory(model: BranchedModel, layout: Layout, costs: list[BranchCost], precision: str = "bf16-mixed",
                    optimizer: str = "adamw", accounting: str = "lightning-npu") -> StageMemory:
    """A rank's bytes: every tower's share, the trunk's states, the dp buckets and the gathered outputs."""
    trunk = model_state_bytes(model.trunk_params, layout.dp, layout.zero_stage, precision, optimizer,
                              accounting=accounting)
    _, _, _, act = PRECISION_BYTES[precision]
    buckets = buffer_bytes(model.towers[0].model, Layout(layout.tp, 1, layout.dp, layout.zero_stage, 1, 1), 0, act)
    return StageMemory(0, sum(c.parameters for c in costs) + trunk["parameters"],
                       sum(c.gradients for c in costs) + trunk["gradients"],
                       sum(c.optimizer for c in costs) + trunk["optimizer"],
                       sum(c.activations for c in costs), buckets + sum(c.gathered_output for c in costs))


def branched_step_time(model: BranchedModel, cluster: ClusterSpec, layout: Layout, costs: list[BranchCost],
                       precision: str = "bf16-mixed") -> StepTime:
    """The towers' compute, tp traffic, output gathers and branch-dp sums, plus the top-level dp reduction of every
    parameter on the rank (fp32; ZeRO-1 adds the weights' all-gather), exposed beyond the last backward."""
    intra, inter = _links(cluster)
    w_bytes, g_bytes, _, _ = PRECISION_BYTES[precision]
    compute = sum(c.compute_s for c in costs)
    tp_comm = sum(c.tp_comm_s for c in costs)
    branch = sum(c.gather_s + c.grad_sum_s for c in costs)
    params = sum(c.params for c in costs) + model.trunk_params
    dp_link = intra if layout.tp * layout.dp <= cluster.devices_per_node else inter
    reduce = _ring(params * max(g_bytes, 4), layout.dp, *dp_link, 2 if layout.zero_stage == 0 else 1)
    gather = _ring(params * w_bytes, layout.dp, *dp_link, 1) if layout.zero_stage >= 1 else 0.0
    backward_window = compute / layout.micro_batches * 2 / 3
    dp_exposed = max(0.0, reduce - backward_window) + gather
    step = compute + tp_comm + branch + dp_exposed
    hardware = 0.0
    for t in model.towers:
        block, head = flops_per_token(t.model, layout.recompute)
        hardware += (t.model.layers * block + head) * model.global_batch * t.model.seq
    useful = sum(model_flops_per_token(t.model) * model.global_batch * t.model.seq for t in model.towers)
    return StepTime(compute, tp_comm, 0.0, dp_exposed, step, hardware, useful, branch_comm_s=branch)
