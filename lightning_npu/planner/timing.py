"""Seconds per optimizer step of a layout: compute, tensor-parallel all-reduces, the pipeline bubble and
p2p, and the data-parallel gradient reduction, every transfer in the alpha-beta model
(``latency + bytes / bandwidth``, ring collectives).

Compute is 6 FLOPs per parameter per token for the matrix products plus 12 l h s for attention scores
(forward and backward), 2 and 4 more with full recomputation (one more forward), at
``gemm_efficiency`` x peak: with full recomputation this is exactly Narayanan et al.'s
96 B s l h^2 (1 + s / 6h + V / 16 l h) per step. Selective (op-level) recomputation replays no matmul: its cost is
the element-wise ops it replays (norms, activation functions), bound by the device's memory bandwidth;
torchtitan's op-level policy (``"selective_alternate"``, costed, never proposed) also replays every second matmul. The
pipeline runs M + P - 1 slots of one micro-batch's forward and backward, so the bubble is (P - 1) / (M + P - 1) of
the step ((P - 1) / (v M + P - 1) with v interleaved stages per rank, at v times the p2p messages). Tensor-parallel
all-reduces (2 in the forward, 2 in the backward of each block, 2 more when recomputing) are not overlapped; tp
groups lie inside a node (the search refuses others). Ranks are placed as the strategy's mesh (pp, dp, tp) places
them, tp innermost: the dp group stays in a node while tp x dp fits one, and the p2p hops between stages cross
nodes as soon as the job spans more than one node (the slowest hop paces the pipeline). The dp gradient reduction
(all-reduce; reduce-scatter + all-gather under ZeRO, same bytes) overlaps the backward of the last micro-batch;
ZeRO-3's per-micro-batch gathers (in the compute dtype) overlap its compute.

Two FLOP counts come out (Korthikanti et al.'s definitions): model FLOPs, 6 N per token (N: the parameters that
multiply, so the embedding lookup is left out) plus the attention's 12 l h s, whatever is recomputed; and hardware
FLOPs, which add what recomputation runs again. MFU and HFU divide them by the step time and the peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_npu.planner.memory import (
    PRECISION_BYTES,
    gather_bytes,
    stage_expert_params,
    stage_layers,
    stage_params,
)
from lightning_npu.planner.spec import ALTERNATE, ClusterSpec, Layout, ModelSpec


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    tp_comm_s: float
    pipeline_s: float  # bubble + p2p
    dp_comm_s: float  # exposed (not overlapped) part
    step_s: float
    flops_per_step: float  # hardware FLOPs: recomputation included, as Megatron's 96 B s l h^2 (...) counts them
    model_flops_per_step: float = 0.0  # 6 N tokens + attention, recomputation not included
    branch_comm_s: float = 0.0  # multi-branch layouts: the towers' output gathers and branch-dp gradient sums

    def tflops_per_device(self, devices: int) -> float:
        """Hardware TFLOP/s per device (what Narayanan et al. 2021 report)."""
        return self.flops_per_step / self.step_s / devices / 1e12

    def model_tflops_per_device(self, devices: int) -> float:
        return self.model_flops_per_step / self.step_s / devices / 1e12

    def mfu(self, devices: int, peak_tflops: float) -> float:
        """Model FLOPs utilisation (what Llama 3 and PaLM report)."""
        return self.model_tflops_per_device(devices) / peak_tflops

    def hfu(self, devices: int, peak_tflops: float) -> float:
        return self.tflops_per_device(devices) / peak_tflops


def alternate_replayed_params(model: ModelSpec) -> int:
    """Weights of the matmuls torchtitan's op-level policy replays in a block: it saves every matmul output but every
    second one in forward order (q, k, v, o, then the MLP's up, gate, down), so k, o and the gate (GELU: the down
    projection), h (kv + h + f) in all (f: the MLP width a token uses)."""
    width = model.experts_per_token * model.n_expert_ffn if model.experts else model.n_ffn
    return model.hidden * (model.kv_dim + model.hidden + width)


def flops_per_token(model: ModelSpec, recompute: str | None) -> tuple[float, float]:
    """(FLOPs of one block, FLOPs of the output layer) per token, forward + backward (+ recomputation): hardware
    FLOPs. Selective recomputation replays no matmul (torchtitan's alternate policy: every second one)."""
    r = 1 if recompute == "full" else 0
    block = (6 + 2 * r) * model.layer_active_params() + (12 + 4 * r) * model.hidden * model.seq
    if recompute == ALTERNATE:
        block += 2 * alternate_replayed_params(model)
    return block, (6 * model.vocab * model.hidden if model.lm_head else 0)


def model_flops_per_token(model: ModelSpec) -> float:
    """6 N + 12 l h s: the model FLOPs of one token (forward and backward, no recomputation)."""
    block, head = flops_per_token(model, None)
    return model.layers * block + head


def _ring(bytes_: float, n: int, bandwidth: float, latency: float, factor: float = 2.0) -> float:
    """A ring all-reduce (factor 2) or reduce-scatter / all-gather (factor 1) of `bytes_` over `n` ranks."""
    if n <= 1 or bytes_ <= 0:
        return 0.0
    return factor * (n - 1) * latency + factor * (n - 1) / n * bytes_ / bandwidth


def _ring_share(n: int, dp: int) -> float:
    """A ring over `n` ranks moves (n - 1) / n of the bytes; as a share of the same ring over `dp` ranks."""
    return 0.0 if n <= 1 else ((n - 1) / n) / ((dp - 1) / dp)


def _expert_all_to_all_s(model: ModelSpec, cluster: ClusterSpec, layout: Layout, token_bytes: float) -> float:
    """Expert parallelism's all-to-alls of one MoE block per micro-batch: dispatch and combine in the forward, their
    transposes in the backward (two more under full recomputation). Each moves the k routed copies of the tokens,
    (ep - 1) / ep of them off the rank, one latency per peer; not overlapped. The ep group (ep consecutive dp ranks,
    tp x ep ranks apart in all) stays in a node while tp x ep fits one."""
    if not model.experts or layout.ep == 1:
        return 0.0
    intra, inter = _links(cluster)
    bandwidth, latency = intra if layout.tp * layout.ep <= cluster.devices_per_node else inter
    moved = token_bytes * model.experts_per_token * model.hidden * (layout.ep - 1) / layout.ep  # every tp rank's
    count = 4 + (2 if layout.recompute == "full" else 0)
    return count * ((layout.ep - 1) * latency + moved / bandwidth)


def _context_parallel_s(model: ModelSpec, cluster: ClusterSpec, layout: Layout, token_bytes: float) -> float:
    """Ring attention's point-to-point passes of one block per micro-batch: the K/V blocks around the cp ring in the
    forward (again in a full recompute), then in the backward the K/V blocks and their gradients' accumulators; each
    moves (cp - 1) / cp of the sequence's k and v (this rank's tp slice), one latency per hop, counted as not
    overlapped. The cp group (cp ranks tp apart) stays in a node while tp x cp fits one."""
    if layout.cp == 1:
        return 0.0
    intra, inter = _links(cluster)
    link = intra if layout.tp * layout.cp <= cluster.devices_per_node else inter
    whole = token_bytes * layout.cp * 2 * model.kv_dim / layout.tp  # the sequence's k and v
    count = 3 + (1 if layout.recompute == "full" else 0)
    return count * _ring(whole, layout.cp, *link, 1)


def _links(cluster: ClusterSpec) -> tuple[tuple[float, float], tuple[float, float]]:
    """(bytes/s, seconds of latency per hop) inside a node and between nodes."""
    return ((cluster.intra_node_GBps * 1e9, cluster.intra_latency_us * 1e-6),
            (cluster.inter_node_Gbps * 1e9 / 8, cluster.latency_us * 1e-6))


def _replay_s(model: ModelSpec, layout: Layout, act_bytes: int, tokens: float, cluster: ClusterSpec) -> float:
    """Selective recomputation's replayed element-wise ops on `tokens` of one block: two norms (read and write h)
    and the activation function (read and write f, or 2f for SwiGLU's SiLU and product), memory-bound."""
    split = layout.tp if layout.sequence_parallel else 1
    width = model.experts_per_token * model.n_expert_ffn if model.experts else model.n_ffn
    f = width * (2 if model.mlp == "swiglu" else 1) / layout.tp
    return tokens * act_bytes * 2 * (2 * model.hidden / split + f) / (cluster.memory_GBps * 1e9)


def step_time(model: ModelSpec, cluster: ClusterSpec, layout: Layout, precision: str = "bf16-mixed") -> StepTime:
    intra, inter = _links(cluster)
    w_bytes, g_bytes, _, act = PRECISION_BYTES[precision]
    rate = cluster.peak_tflops * 1e12 * cluster.gemm_efficiency
    tokens_mb = layout.micro_batch_size * model.seq / layout.cp  # this rank's tokens of one micro-batch
    block, head = flops_per_token(model, layout.recompute)
    layers = stage_layers(model, layout.pp)
    per_stage = [n * block + (head if i == layout.pp - 1 else 0) for i, n in enumerate(layers)]
    mb_compute = max(per_stage) * tokens_mb / layout.tp / rate  # one micro-batch on the slowest stage
    if layout.recompute in ("selective", ALTERNATE):
        mb_compute += max(layers) * _replay_s(model, layout, act, tokens_mb, cluster)

    # tensor parallel: all-reduces of b s h activations per block (reduce-scatter + all-gather with sp: same bytes)
    in_node = layout.tp <= cluster.devices_per_node and cluster.devices_per_node % layout.tp == 0
    tp_link = intra if in_node or cluster.devices <= cluster.devices_per_node else inter
    # replayed: both row-parallel outputs under full recomputation; the attention output's (and GELU's down
    # projection's) under the alternate policy
    n_allreduce = 4 + {"full": 2, ALTERNATE: 1 if model.mlp == "swiglu" else 2}.get(layout.recompute, 0)
    mb_tp = max(layers) * n_allreduce * _ring(tokens_mb * model.hidden * act, layout.tp, *tp_link)
    mb_tp += max(layers) * _expert_all_to_all_s(model, cluster, layout, tokens_mb * act)
    mb_tp += max(layers) * _context_parallel_s(model, cluster, layout, tokens_mb * act)

    # pipeline: M + P - 1 slots; p2p of the activations (and their gradients) between stages
    v = layout.v
    p2p = 0.0
    if layout.pp > 1:
        link = inter if cluster.devices > cluster.devices_per_node else intra
        sent = tokens_mb * model.hidden * act / (layout.tp if layout.sequence_parallel else 1)
        p2p = 2 * (link[1] + sent / link[0])
    compute = layout.micro_batches * mb_compute
    tp_comm = layout.micro_batches * mb_tp
    # bubble: P - 1 slots of one micro-batch's work (1/v of it when interleaved); p2p at every chunk boundary
    pipeline = (layout.pp - 1) * (mb_compute + mb_tp) / v + v * (layout.micro_batches + layout.pp - 1) * p2p

    # data parallel: the stage's gradients (fp32 reduction) over dp ranks; the group leaves the node when
    # tp x dp does not fit in one
    dp_link = intra if layout.tp * layout.replicas <= cluster.devices_per_node else inter
    replicas = layout.replicas  # gradients are reduced (and ZeRO shards) over dp x cp
    params = max(stage_params(model, layout, i) for i in range(layout.pp))
    grad_bytes = params * max(g_bytes, 4)
    experts = max(stage_expert_params(model, layout, i) for i in range(layout.pp))
    # the experts' gradients are reduced over the dp / ep ranks that hold them: their bytes count as
    # over a group ep times smaller (the same ring time per byte, fewer hops)
    grad_bytes -= experts * max(g_bytes, 4) * (1 - _ring_share(layout.dp // layout.ep, replicas))
    if layout.zero_stage == 3:
        # every micro-batch gathers the weights twice (forward, backward) and reduce-scatters gradients once
        gathered = params * gather_bytes(precision)
        per_mb = 2 * _ring(gathered, replicas, *dp_link, 1) + _ring(grad_bytes, replicas, *dp_link, 1)
        dp_exposed = layout.micro_batches * max(0.0, per_mb - mb_compute)
    else:
        reduce = _ring(grad_bytes, replicas, *dp_link, 2 if layout.zero_stage == 0 else 1)
        gathered = params * (gather_bytes(precision) if layout.zero_stage == 2 else w_bytes)
        gather = _ring(gathered, replicas, *dp_link, 1) if layout.zero_stage >= 1 else 0.0
        backward_window = mb_compute * 2 / 3  # the last micro-batch's backward
        dp_exposed = max(0.0, reduce - backward_window) + gather
    step = compute + tp_comm + pipeline + dp_exposed
    tokens = model.global_batch * model.seq
    flops = (model.layers * block + head) * tokens
    return StepTime(compute, tp_comm, pipeline, dp_exposed, step, flops, model_flops_per_token(model) * tokens)
