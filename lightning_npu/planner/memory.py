"""Bytes per rank of a layout: model states by ZeRO stage, saved activations, communication buffers.

Model states follow the ZeRO paper (Rajbhandari et al. 2020): per parameter a rank holds the weights, the
gradients and K bytes of optimizer state (fp32 master copy + Adam's two moments = 4 + 8 = 12 under 16-bit
weights); stage 1 shards the optimizer state over dp, stage 2 the gradients too, stage 3 the weights too.
What each precision keeps (lightning-npu's `HybridPrecision`):

=============  =======  =========  =================  ===========
precision      weights  gradients  fp32 master copy   activations
=============  =======  =========  =================  ===========
32-true        4        4          -                  4
bf16-mixed     4        4          -                  2 (autocast)
bf16-true      2        2          4                  2
=============  =======  =========  =================  ===========

``bf16-true``/``16-true`` is the paper's "mixed precision" (2 + 2 + K=12 = 16 bytes per parameter);
``bf16-mixed`` keeps fp32 weights under autocast (4 + 4 + 8 = 16 bytes, split differently).

Activations count the tensors autograd saves for backward in a pre-norm decoder block, per token (h hidden,
f MLP width, a heads, s sequence, t tensor-parallel size): the two norm inputs and the two norm outputs (2h + 2h,
both split by t under sequence parallelism, as in Korthikanti et al. 2022), q/k/v ((h + 2 kv)/t), the attention
output (h/t), the MLP's inner tensors (2f/t for GELU, 4f/t for SwiGLU), the softmax probabilities (a s / t) unless
attention is fused (flash), and the norms' fp32 statistics. Dropout masks are not counted (dropout 0). With
dropout 0 this is Korthikanti et al.'s s b h (10 + 24/t + 5 a s / h t) (and s b h / t (34 + 5 a s / h) under
sequence parallelism) less their dropout terms. Full recomputation keeps only each block's input, plus one
block's activations while it is recomputed. Selective recomputation is op-level (torch's selective activation
checkpointing, as torchtitan's op-level SAC and `lightning_npu.parallel.recompute` do): matmul and attention
outputs are kept (q/k/v, the attention output, both output projections, the MLP's up/gate projections; the scores
under eager attention), norms and activation functions are replayed. torchtitan's op-level policy
(``"selective_alternate"``) also drops every second matmul output (k, the attention's output projection, and the
gate, or GELU's down projection) and replays them. The last stage adds the final norm and the
fp32 log-probabilities of the loss (4 V / t bytes per token). A pipeline stage i keeps min(P - i, M)
micro-batches in flight under 1F1B and M under GPipe (interleaved 1F1B: see `in_flight_micro_batches`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

from lightning_npu.planner.spec import ALTERNATE, Layout, ModelSpec

# precision -> (weight, gradient, fp32 master, activation) bytes per element
PRECISION_BYTES = {
    "32-true": (4, 4, 0, 4),
    "bf16-mixed": (4, 4, 0, 2),
    "16-mixed": (4, 4, 0, 2),
    "bf16-true": (2, 2, 4, 2),
    "16-true": (2, 2, 4, 2),
}
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 4}  # fp32 state per stepped parameter (moments / momentum)
GB = 1e9  # the ZeRO paper's GB


def model_state_bytes(params: float, dp: int, zero_stage: int, precision: str = "bf16-true",
                      optimizer: str = "adam", accounting: str = "paper") -> dict[str, float]:
    """Bytes per rank of weights, gradients and optimizer state (master copies included) for `params`
    parameters replicated over `dp` ranks, at one ZeRO stage.

    ``accounting="paper"`` (or ``"deepspeed"``) is the ZeRO paper's, DeepSpeed's: a full gradient buffer at stage 1.
    ``"lightning-npu"`` differs at stage 1 only, where our distributed optimizer reduce-scatters the gradients into
    fp32 slices bucket by bucket during backward (the model's gradients are freed as their bucket is reduced: the
    buckets are counted as buffers), and steps fp32 master slices even for fp32 weights. ``"megatron"`` is
    Megatron-LM's (its docs' distributed-optimizer table): 16-bit weights keep a full fp32 gradient buffer
    (``main_grad``), 18 bytes per parameter without the distributed optimizer and 6 + 12/dp with it (bf16), 20 and
    4 + 16/dp for fp16 (fp16 gradients, an fp32 copy sharded with the optimizer), 16 and 8 + 8/dp for fp32.
    """
    w, g, master, _ = PRECISION_BYTES[precision]
    k = master + OPTIMIZER_BYTES[optimizer]
    if accounting == "lightning-npu-gloo" and zero_stage == 1 and dp > 1:  # the in-place bucket buffer: whole
        return {"parameters": params * w, "gradients": params * 4,
                "optimizer": params * (4 + OPTIMIZER_BYTES[optimizer]) / dp}
    if accounting.startswith("lightning-npu") and zero_stage == 1 and dp > 1:
        return {"parameters": params * w, "gradients": params * 4 / dp,
                "optimizer": params * (4 + OPTIMIZER_BYTES[optimizer]) / dp}
    if accounting == "megatron" and zero_stage <= 1:
        shard = dp if zero_stage == 1 else 1
        if precision in ("16-true", "16-mixed"):  # fp16 gradients; their fp32 copy goes with the optimizer state
            return {"parameters": params * 2, "gradients": params * 2, "optimizer": params * (4 + k) / shard}
        if w == 2:  # bf16 weights, fp32 main_grad buffer
            return {"parameters": params * 2, "gradients": params * 4, "optimizer": params * k / shard}
        return {"parameters": params * 4, "gradients": params * 4, "optimizer": params * k / shard}
    return {
        "parameters": params * w / (dp if zero_stage >= 3 else 1),
        "gradients": params * g / (dp if zero_stage >= 2 else 1),
        "optimizer": params * k / (dp if zero_stage >= 1 else 1),
    }


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage's bytes per rank, by component."""

    stage: int
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers

    def as_gb(self) -> dict[str, float]:
        keys = ("parameters", "gradients", "optimizer", "activations", "buffers")
        out = {k: getattr(self, k) / GB for k in keys}
        out["total"] = self.total / GB
        return out


def stage_layers(model: ModelSpec, pp: int) -> list[int]:
    """Blocks per pipeline stage, the earlier stages taking the remainder (as `torch.distributed.pipelining`
    splits are usually balanced by count)."""
    base, rest = divmod(model.layers, pp)
    return [base + (1 if i < rest else 0) for i in range(pp)]


def stage_params(model: ModelSpec, layout: Layout, stage: int) -> float:
    """Parameters one rank of `stage` holds before ZeRO: its blocks' matrices and vocabulary split over tp (the
    row-parallel biases whole), its experts split over ep x tp (`stage_expert_params`)."""
    t = layout.tp
    n = stage_layers(model, layout.pp)[stage]
    whole = model.row_parallel_biases()  # a row-parallel layer adds its bias once, after the all-reduce: replicated
    params = n * ((model.layer_matrix_params() - whole) / t + whole + 2 * model.norm_params())
    params += stage_expert_params(model, layout, stage)
    if stage == 0:
        params += model.vocab * model.hidden / t + (model.seq * model.hidden if model.learned_positions else 0)
        params += model.input_params
    if stage == layout.pp - 1:
        params += (0 if model.tied_embeddings or not model.lm_head else model.vocab * model.hidden / t)
        params += model.norm_params()
    return params


def stage_expert_params(model: ModelSpec, layout: Layout, stage: int) -> float:
    """The experts one rank of `stage` holds: 1/ep of each MoE layer's, each split over tp. ZeRO shards them over
    the dp / ep ranks holding the same experts."""
    return stage_layers(model, layout.pp)[stage] * model.layer_expert_params() / (layout.tp * layout.ep)


def layer_activation_bytes(model: ModelSpec, layout: Layout, act_bytes: int, recompute: str | None) -> float:
    """Bytes one block saves for backward per token (see the module docstring)."""
    h, f, t, s = model.hidden, model.n_ffn, layout.tp, model.seq
    split = t if layout.sequence_parallel else 1  # what sequence parallelism shards: the h-wide tensors
    gated = model.mlp == "swiglu"
    scores = model.heads * s / t if model.attention == "eager" else 0.0
    if recompute == "full":
        return act_bytes * h / split
    qkv_out = (h + 2 * model.kv_dim) / t + h / t
    inner, kept = (4 if gated else 2) * f / t, (2 if gated else 1) * f / t  # the MLP's saved / matmul outputs
    if model.experts:  # each token's k experts keep theirs, plus the dispatched and combined copies
        k, fe = model.experts_per_token, model.n_expert_ffn
        inner, kept = k * (4 if gated else 2) * fe / t + 2 * k * h, k * (2 if gated else 1) * fe / t + 2 * k * h
    if recompute in ("selective", ALTERNATE):  # block input, matmul/attention outputs; norms and activations replayed
        width = model.experts_per_token * model.n_expert_ffn if model.experts else f  # the gate a token uses
        dropped = (model.kv_dim / t + h / split + (width / t if gated else h / split)) if recompute == ALTERNATE else 0
        return act_bytes * (h / split + qkv_out + 2 * h / split + kept + scores - dropped)
    elements = 4 * h / split + qkv_out + inner + scores
    stats = 2 * (2 if model.norm == "layernorm" else 1) * 4 / split
    return act_bytes * elements + stats


def in_flight_micro_batches(layout: Layout, stage: int) -> float:
    """Micro-batches whose activations `stage` holds at its peak: M under GPipe, min(P - i, M) under 1F1B; under
    interleaved 1F1B with v chunks per rank, ((P - i - 1) * 2 + (v - 1) * P + 1) chunks of 1/v of the stage."""
    p, m, v = layout.pp, layout.micro_batches, layout.v
    if layout.schedule == "gpipe":
        return m
    if v > 1:
        return min(m, ((p - stage - 1) * 2 + (v - 1) * p + 1) / v)
    return min(p - stage, m)


def stage_activation_bytes(model: ModelSpec, layout: Layout, stage: int, act_bytes: int) -> float:
    tokens = layout.micro_batch_size * model.seq / layout.cp  # a cp rank keeps 1/cp of each sequence
    n = stage_layers(model, layout.pp)[stage]
    in_flight = in_flight_micro_batches(layout, stage)
    per_mb = n * layer_activation_bytes(model, layout, act_bytes, layout.recompute)
    if stage == 0:
        per_mb += 8  # token ids the embedding keeps
    if stage == layout.pp - 1:
        per_mb += act_bytes * 2 * model.hidden + ((4 * model.vocab / layout.tp + 8) if model.lm_head else 0)
    total = in_flight * tokens * per_mb
    if layout.recompute == "full" and n:  # one block's full activations while it is recomputed
        total += tokens * layer_activation_bytes(model, layout, act_bytes, None)
    return total


def gather_bytes(precision: str) -> int:
    """Bytes per element of ZeRO-2/3's gathered weights: FSDP2 gathers in the compute dtype (bf16 under
    bf16-mixed, `MixedPrecisionPolicy(param_dtype)`), the stored dtype otherwise."""
    w, _, _, act = PRECISION_BYTES[precision]
    return act if precision.endswith("-mixed") else w


def buffer_bytes(model: ModelSpec, layout: Layout, weight_bytes: int, act_bytes: int,
                 bucket_size_mb: float = 25.0) -> float:
    """Communication buffers: dp gradient buckets (ZeRO 0/1), FSDP's gathered block (ZeRO 2/3, two in flight
    with prefetch, `weight_bytes` each: see `gather_bytes`), pipeline send/receive buffers."""
    out = 0.0
    if layout.replicas > 1:
        if layout.zero_stage <= 1:
            out += 2 * bucket_size_mb * 2**20
        else:
            out += 2 * model.layer_matrix_params() / layout.tp * weight_bytes
    if layout.pp > 1:
        out += 2 * layout.micro_batch_size * model.seq * model.hidden * act_bytes
    return out


def memory_by_stage(model: ModelSpec, layout: Layout, precision: str = "bf16-mixed",
                    optimizer: str = "adamw", stages: Optional[Iterable[int]] = None,
                    accounting: str = "lightning-npu") -> list[StageMemory]:
    """Bytes per rank of every pipeline stage, or of `stages` (ranks of one stage hold the same); `accounting`
    as in `model_state_bytes` (another framework's, to check its published runs)."""
    _, _, _, act = PRECISION_BYTES[precision]
    out = []
    for stage in range(layout.pp) if stages is None else sorted(set(stages)):
        experts = stage_expert_params(model, layout, stage)
        states = model_state_bytes(stage_params(model, layout, stage) - experts, layout.replicas, layout.zero_stage,
                                   precision, optimizer, accounting=accounting)
        if experts:  # sharded by ZeRO over the ranks that hold the same experts
            held = model_state_bytes(experts, layout.dp // layout.ep, layout.zero_stage, precision, optimizer,
                                     accounting=accounting)
            states = {k: states[k] + held[k] for k in states}
        out.append(StageMemory(stage, states["parameters"], states["gradients"], states["optimizer"],
                               stage_activation_bytes(model, layout, stage, act),
                               buffer_bytes(model, layout, gather_bytes(precision), act)))
    return out


def peak_memory(model: ModelSpec, layout: Layout, precision: str = "bf16-mixed",
                optimizer: str = "adamw", accounting: str = "lightning-npu") -> StageMemory:
    """The stage whose ranks need the most memory: what must fit on a device. The first stage (most
    micro-batches in flight, the embedding, the most blocks) or the last (the loss's log-probabilities)."""
    return max(memory_by_stage(model, layout, precision, optimizer, (0, layout.pp - 1), accounting),
               key=lambda m: m.total)


def round_gb(value_bytes: float, digits: int = 1) -> float:
    """GB (10^9 bytes), rounded half up as the paper's table is (1.875 -> 1.9)."""
    scale = 10**digits
    return math.floor(value_bytes / GB * scale + 0.5) / scale
