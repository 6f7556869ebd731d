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

1-bit Adam on a tower (its compression with ``frozen_variance``) is costed after its warm-up, as the other modes are:
each rank's momentum in place of its gradient, the same payload of the same mode per step (the dense warm-up steps
are left out); it needs the tower's and the top level's ZeRO 0 (the strategy refuses the rest).

A tower at its own ZeRO-1 (`BranchChoice.zero_stage` 1: ZeRO-1's optimizer over fdp = top-level dp x d_i ranks)
keeps its weights and its fp32 gradients whole until they are reduce-scattered (the gradient buffer of its buckets),
and its fp32 masters and optimizer state are sharded over fdp (`memory.model_state_bytes`, accounting
"lightning-npu-gloo", the whole-buffer form); one reduce-scatter of its fp32 gradients over fdp per step replaces its
branch-dp sum and the top-level dp reduction (exposed beyond the last micro-batch's backward of the tower, as at
ZeRO 2/3), and the stepped weights are all-gathered over fdp once per step, counted whole (as `timing` counts ZeRO-1's
gather).

A tower at its own ZeRO stage z = 2 or 3 (`BranchChoice.zero_stage`: FSDP2 over fdp = top-level dp x d_i ranks) is
costed with the single-tower ZeRO-2/3 terms (`memory.model_state_bytes`, `memory.buffer_bytes`, `timing`'s rings):

- its states are sharded over fdp at stage z (optimizer and gradients; the parameters too at 3), plus FSDP2's two
  gathered blocks in flight (in the gather dtype, `memory.gather_bytes`);
- one reduce-scatter over fdp of its fp32 gradients per step replaces the branch-dp sum and the top-level dp
  reduction for the tower, exposed beyond the last micro-batch's backward of the tower (as `timing`'s ZeRO-2
  reduction); a compressed tower is not costed at 2/3 (the search keeps it at 0);
- its parameters are all-gathered over fdp in every micro-batch's forward, and again in its backward at 3 (2 at
  ZeRO-2 keeps them from forward to backward: one gather), overlapping the tower's compute as `timing`'s ZeRO-3
  gathers overlap a micro-batch's; only what exceeds that compute counts.

fdp lies in a node while the top-level tp x dp does (the top-level dp group's rule).

The towers run one after another, so their compute and communication add; the top-level dp reduction covers every
parameter on the rank and overlaps the last micro-batch's backward (as in `timing`). The trunk (CLIP's projections
and logit scale) is replicated; its FLOPs and the contrastive logits are left out (under 0.1% of a step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning_npu.planner.branches.model import BranchedModel, Tower, compression_spec, one_bit_adam
from lightning_npu.planner.memory import (
    PRECISION_BYTES,
    StageMemory,
    buffer_bytes,
    gather_bytes,
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
    zero_stage: int = 0  # the tower's own: 0, 1 (ZeRO-1 over fdp) or 2/3 (FSDP2 over fdp)
    fdp: int = 1  # ranks its ZeRO 1-3 shards over (top-level dp x bdp); 1 at zero_stage 0
    param_gather_s: float = 0.0  # exposed parameter all-gathers per step (ZeRO 1-3)
    fsdp_buffers: float = 0.0  # FSDP2's gathered blocks in flight (ZeRO 2/3; `memory.buffer_bytes`)

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
    zero, fdp = choice.zero_stage, layout.dp * bdp
    if zero not in (0, 1, 2, 3) or (zero and choice.compression is not None):
        raise PlannerError(f"tower {tower.glob!r} at zero_stage {zero}: the planner costs a branch zero_stage of 0, "
                           "1, 2 or 3, and 1-3 only uncompressed; pass one of those.")
    if one_bit_adam(choice.compression) and layout.zero_stage and bdp > 1:  # (at bdp 1 nothing is sent)
        raise PlannerError(f"tower {tower.glob!r} with frozen_variance=True (1-bit Adam) at the top-level zero_stage "
                           f"{layout.zero_stage}: the strategy builds it at the top-level zero_stage 0 only (ZeRO "
                           "shards the momentum it sends); pass zero_stage 0, or frozen_variance=False.")
    if zero == 1:  # ZeRO-1 over fdp: whole weights and fp32 gradient buffer, masters and state sharded
        states = model_state_bytes(params, fdp, 1, precision, optimizer, accounting="lightning-npu-gloo")
        blocks = 0.0
    elif zero:  # FSDP2 over fdp: the single-tower ZeRO-2/3 states and gathered blocks
        states = model_state_bytes(params, fdp, zero, precision, optimizer, accounting=accounting)
        blocks = buffer_bytes(m, Layout(choice_tp, 1, fdp, zero, 1, 1), gather_bytes(precision), act)
    else:
        states = model_state_bytes(params, layout.dp, layout.zero_stage, precision, optimizer, accounting=accounting)
        blocks = 0.0
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
    mb = layout.micro_batches
    if zero:
        link = intra if layout.tp * layout.dp <= cluster.devices_per_node else _links(cluster)[1]
        sent = params * 4  # fp32 gradients, reduce-scattered once per step
        reduce = _ring(sent, fdp, *link, 1)
        grad_sum = max(0.0, reduce - compute * 2 / 3)  # beyond the last micro-batch's backward of the tower
        if zero == 1:  # the stepped weights, once per step, not hidden
            param_gather = _ring(params * PRECISION_BYTES[precision][0], fdp, *link, 1)
        else:
            gathers = (2 if zero == 3 else 1) * _ring(params * gather_bytes(precision), fdp, *link, 1)
            param_gather = mb * max(0.0, gathers - compute)
        return BranchCost(tower.glob, choice_tp, bdp, samples, params, states["parameters"], states["gradients"],
                          states["optimizer"], activations, gathered, mb * compute, mb * tp_comm, mb * gather,
                          grad_sum, sent if fdp > 1 else 0.0, zero, fdp, param_gather, blocks)
    sent, factor = grad_sum_payload(params, choice.compression)
    grad_sum = _ring(sent * (bdp if factor == 1 else 1), bdp, *intra, factor) if bdp > 1 else 0.0
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
    """A rank's bytes: every tower's share, the trunk's states, the dp buckets, the gathered outputs and the ZeRO-2/3
    towers' gathered blocks (and the rest's fp32 masters where a ZeRO-1 tower brings ZeRO-1's optimizer)."""
    trunk = model_state_bytes(model.trunk_params, layout.dp, layout.zero_stage, precision, optimizer,
                              accounting=accounting)
    _, _, master, act = PRECISION_BYTES[precision]
    buckets = buffer_bytes(model.towers[0].model, Layout(layout.tp, 1, layout.dp, layout.zero_stage, 1, 1), 0, act)
    # a ZeRO-1 tower where the top level is not ZeRO-1 over dp > 1: ZeRO-1's optimizer steps the rest of the model
    # too, through whole fp32 masters that a plain optimizer of fp32 weights does without
    rest = model.trunk_params + sum(c.params for c in costs if not c.zero_stage)
    top_zero1 = layout.zero_stage == 1 and layout.dp > 1
    masters = rest * 4 if master == 0 and not top_zero1 and any(c.zero_stage == 1 for c in costs) else 0.0
    return StageMemory(0, sum(c.parameters for c in costs) + trunk["parameters"],
                       sum(c.gradients for c in costs) + trunk["gradients"],
                       sum(c.optimizer for c in costs) + trunk["optimizer"] + masters,
                       sum(c.activations for c in costs),
                       buckets + sum(c.gathered_output + c.fsdp_buffers for c in costs))


def branched_step_time(model: BranchedModel, cluster: ClusterSpec, layout: Layout, costs: list[BranchCost],
                       precision: str = "bf16-mixed") -> StepTime:
    """The towers' compute, tp traffic, output gathers and branch-dp sums, plus the top-level dp reduction of every
    parameter on the rank but the ZeRO 1-3 towers' (fp32; ZeRO-1 adds the weights' all-gather), exposed beyond the last
    backward; a ZeRO 1-3 tower's reduce-scatter and parameter gathers are its `grad_sum_s` and `param_gather_s`."""
    intra, inter = _links(cluster)
    w_bytes, g_bytes, _, _ = PRECISION_BYTES[precision]
    compute = sum(c.compute_s for c in costs)
    tp_comm = sum(c.tp_comm_s for c in costs)
    branch = sum(c.gather_s + c.grad_sum_s + c.param_gather_s for c in costs)
    params = sum(c.params for c in costs if not c.zero_stage) + model.trunk_params  # ZeRO 1-3 towers: their own
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
