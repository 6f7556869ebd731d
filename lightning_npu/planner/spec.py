"""What the planner is asked about: a decoder-only transformer, a cluster, and one layout.

Plain dataclasses that validate themselves, so that a bad size fails here, naming the argument and
the fix, before any arithmetic. `model_from_config` reads the ``model:`` block of a LightningCLI config
(the example GPT's and Llama's argument names, or Hugging Face's) so that ``--model config.yaml`` works.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lightning_npu.validate import check_choice, check_number

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
OPTIMIZERS = ("adamw", "adam", "sgd")
ATTENTIONS = ("eager", "flash")
MLPS = ("gelu", "swiglu")
RECOMPUTE = (None, "selective", "full")  # what the search proposes (the strategy's activation_checkpointing)
# costed by step_time and memory_by_stage but never proposed, since the strategy does not run it: torchtitan's op-level
# selective checkpointing, which also replays every second matmul of a block (to check its published runs)
ALTERNATE = "selective_alternate"
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
VIRTUAL_STAGES = 2  # stages per rank under interleaved_1f1b (the strategy's default pipeline_layout)
# how the optimizer and its gradients are held (memory.model_state_bytes): ours, DeepSpeed's (the ZeRO paper's)
# or Megatron-LM's (its distributed optimizer at stage 1); "lightning-npu-gloo": ours on CPU/gloo, where ZeRO-1 keeps
# the whole gradient in its in-place buckets (each reduce-scattered in place by one all_to_all_single), pipeline
# stages included
ACCOUNTINGS = ("lightning-npu", "lightning-npu-gloo", "paper", "deepspeed", "megatron")


class PlannerError(ValueError):
    """A size or option the planner cannot use; the message names the argument and the fix."""


@dataclass(frozen=True)
class ModelSpec:
    """A pre-norm decoder: `layers` blocks of attention (`heads`, `kv_heads` for GQA) and an MLP of width `ffn`.

    ``mlp="gelu"`` is GPT's two-matrix MLP, ``"swiglu"`` Llama's three. ``attention="eager"`` keeps the
    softmax probabilities (heads x seq per token) for backward, ``"flash"`` does not. `seq` is the training
    sequence length and `global_batch` the sequences per optimizer step. `sequence_parallel_ok=False` keeps
    sequence-parallel layouts out of the search.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    global_batch: int
    ffn: Optional[int] = None
    kv_heads: Optional[int] = None
    mlp: str = "gelu"
    attention: str = "flash"
    bias: bool = False
    norm: str = "layernorm"
    tied_embeddings: bool = False
    learned_positions: bool = False
    sequence_parallel_ok: bool = True  # False for `transformers` models, which the strategy refuses to sequence-shard
    experts: int = 0  # routed experts of every MoE layer (0: a dense MLP); each token goes to `experts_per_token`
    experts_per_token: int = 2
    expert_ffn: Optional[int] = None  # one expert's MLP width (default `ffn`)
    # an encoder tower (CLIP's vision or text model): no output layer (no logits, no head FLOPs); `input_params` are
    # its input parameters that tensor parallelism keeps whole (a patch projection, a class token, a pre-norm)
    lm_head: bool = True
    input_params: int = 0

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "global_batch"):
            check_number(name, getattr(self, name), above=0, integral=True, example=8, error=PlannerError)
        check_number("vocab", self.vocab, above=0 if self.lm_head else None, at_least=None if self.lm_head else 0,
                     integral=True, example=32000, error=PlannerError)
        check_number("input_params", self.input_params, at_least=0, integral=True, example=0, error=PlannerError)
        if self.ffn is not None:
            check_number("ffn", self.ffn, above=0, integral=True, example=8, error=PlannerError)
        if self.kv_heads is not None:
            check_number("kv_heads", self.kv_heads, above=0, integral=True, example=8, error=PlannerError)
        if self.hidden % self.heads:
            raise PlannerError(
                f"`heads={self.heads}` does not divide `hidden={self.hidden}`; every head needs hidden/heads "
                "features: pick heads among the divisors of hidden (e.g. hidden/64 or hidden/128)."
            )
        if self.heads % self.n_kv_heads:
            raise PlannerError(
                f"`kv_heads={self.kv_heads}` does not divide `heads={self.heads}`; grouped-query attention shares "
                "each key/value head among heads/kv_heads query heads: pick a divisor of heads."
            )
        check_choice("mlp", self.mlp, MLPS, error=PlannerError)
        check_number("experts", self.experts, above=-1, integral=True, example=8, error=PlannerError)
        if self.experts:
            check_number("experts_per_token", self.experts_per_token, above=0, integral=True, example=2,
                         error=PlannerError)
            if self.experts_per_token > self.experts:
                raise PlannerError(f"`experts_per_token={self.experts_per_token}` exceeds `experts={self.experts}`: "
                                   "a token is routed to at most every expert; pass e.g. 2.")
            if self.expert_ffn is not None:
                check_number("expert_ffn", self.expert_ffn, above=0, integral=True, example=1408, error=PlannerError)
        check_choice("attention", self.attention, ATTENTIONS, error=PlannerError)
        check_choice("norm", self.norm, ("layernorm", "rmsnorm"), error=PlannerError)

    @property
    def n_ffn(self) -> int:
        return int(self.ffn) if self.ffn is not None else 4 * self.hidden

    @property
    def n_kv_heads(self) -> int:
        return int(self.kv_heads) if self.kv_heads is not None else self.heads

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.n_kv_heads

    # ---- parameter counts (elements) -------------------------------------------------------
    def layer_matrix_params(self) -> int:
        """Elements of one block's weight matrices (and their biases) outside the experts: what tensor parallelism
        splits and every token multiplies (a MoE layer's router in place of its MLP)."""
        h, f, kv = self.hidden, self.n_ffn, self.kv_dim
        attn = h * (h + 2 * kv) + h * h
        mlp = h * self.experts if self.experts else self._mlp_params(f)
        biases = (h + 2 * kv) + h + (0 if self.experts else (2 * f if self.mlp == "swiglu" else f) + h) \
            if self.bias else 0
        return attn + mlp + biases

    def row_parallel_biases(self) -> int:
        """Bias elements of a block's row-parallel layers (the attention output, the dense MLP's down projection):
        tensor parallelism keeps them whole on every rank."""
        return (self.hidden + (0 if self.experts else self.hidden)) if self.bias else 0

    def _mlp_params(self, width: int) -> int:
        return (3 if self.mlp == "swiglu" else 2) * self.hidden * width

    @property
    def n_expert_ffn(self) -> int:
        return int(self.expert_ffn) if self.expert_ffn is not None else self.n_ffn

    def layer_expert_params(self) -> int:
        """Elements of one block's experts (0 for a dense block): what expert parallelism splits."""
        return self.experts * self._mlp_params(self.n_expert_ffn)

    def layer_active_params(self) -> int:
        """Elements one token multiplies in a block: the matrices plus the experts it is routed to."""
        if not self.experts:
            return self.layer_matrix_params()
        return self.layer_matrix_params() + self.experts_per_token * self._mlp_params(self.n_expert_ffn)

    def norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" and self.bias else 1)

    def layer_params(self) -> int:
        return self.layer_matrix_params() + self.layer_expert_params() + 2 * self.norm_params()

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + (self.seq * self.hidden if self.learned_positions else 0) + self.input_params

    def head_params(self) -> int:
        return (0 if self.tied_embeddings or not self.lm_head else self.vocab * self.hidden) + self.norm_params()

    def num_params(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params() + self.head_params()


@dataclass(frozen=True)
class ClusterSpec:
    """`devices` accelerators, `devices_per_node` per node, each with `device_memory_gb` (10^9 bytes) and a dense 16-bit
    peak of `peak_tflops`. Links: `intra_node_GBps` (GB/s per device, e.g. HCCS or NVLink) and `inter_node_Gbps`
    (Gbit/s per device, e.g. one 200 Gb/s RoCE or InfiniBand NIC per device), with per-hop latencies
    `intra_latency_us` (NVLink/HCCS: about 2 us) and `latency_us` (between nodes). `gemm_efficiency` is the fraction
    of peak that the matrix products reach on one device; `memory_headroom` the fraction of device memory left for
    the allocator, workspace and fragmentation; `memory_GBps` the device memory bandwidth (GB/s), which the
    element-wise ops that selective recomputation replays are bound by; `memory_overhead` multiplies the estimated
    bytes per device (1: none; `--calibrate` fits it to a measured run)."""

    devices: int
    devices_per_node: int = 8
    device_memory_gb: float = 64.0
    peak_tflops: float = 280.0
    intra_node_GBps: float = 392.0
    inter_node_Gbps: float = 200.0
    gemm_efficiency: float = 0.5
    latency_us: float = 10.0
    memory_headroom: float = 0.1
    memory_GBps: float = 1600.0
    memory_overhead: float = 1.0
    intra_latency_us: float = 2.0

    def __post_init__(self) -> None:
        for name in ("devices", "devices_per_node"):
            check_number(name, getattr(self, name), above=0, integral=True, example=8, error=PlannerError)
        for name in ("device_memory_gb", "peak_tflops", "intra_node_GBps", "inter_node_Gbps", "gemm_efficiency",
                     "memory_GBps", "memory_overhead"):
            check_number(name, getattr(self, name), above=0, example=8, error=PlannerError)
        if self.gemm_efficiency > 1:
            raise PlannerError(f"`gemm_efficiency={self.gemm_efficiency}` is a fraction of peak: pass e.g. 0.5.")
        if not (0 <= self.memory_headroom < 1) or not (self.latency_us >= 0 and self.intra_latency_us >= 0):
            raise PlannerError("`memory_headroom` must be in [0, 1) and `latency_us` >= 0, e.g. 0.1 and 10.")
        if self.devices > self.devices_per_node and self.devices % self.devices_per_node:
            raise PlannerError(
                f"`devices={self.devices}` is not a whole number of nodes of `devices_per_node="
                f"{self.devices_per_node}`; pass a multiple of devices_per_node."
            )

    @property
    def usable_bytes(self) -> float:
        return self.device_memory_gb * 1e9 * (1 - self.memory_headroom)


@dataclass(frozen=True)
class BranchChoice:
    """One tower's layout inside each top-level tp group (the strategy's ``branch_layouts`` entry): its own tp size,
    the rest of the group as its branch dp, the compression of its branch-dp gradient sum (the user's, not
    searched: it changes the numerics), and its own ZeRO stage: 0, 1 (ZeRO-1's optimizer state over fdp = top-level
    dp x branch dp) or 2/3 (FSDP2 over fdp)."""

    glob: str
    tp: int
    compression: Any = None  # as `branch_layouts[glob]["gradient_compression"]` takes it
    zero_stage: int = 0  # as `branch_layouts[glob]["zero_stage"]` takes it

    def strategy_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"tensor_parallel_size": self.tp}
        if self.compression is not None:
            entry["gradient_compression"] = self.compression
        if self.zero_stage:
            entry["zero_stage"] = self.zero_stage
        return entry


@dataclass(frozen=True)
class Layout:
    """One candidate: tp x pp x dp ranks, a ZeRO stage, `micro_batches` per step per dp rank of
    `micro_batch_size` sequences, activation recomputation and sequence parallelism; under interleaved 1F1B,
    `virtual_stages` (v) model chunks per rank (None: the strategy's default, 2). `branches`: every tower's
    `BranchChoice` for a multi-branch model (`planner.branches`), tp then being the largest of theirs."""

    tp: int
    pp: int
    dp: int
    zero_stage: int
    micro_batches: int
    micro_batch_size: int
    recompute: Optional[str] = None
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: Optional[int] = None
    ep: int = 1  # expert parallelism: each MoE layer's experts split over ep of the dp ranks
    cp: int = 1  # context parallelism: each sequence split over cp ranks (between dp and tp in the mesh)
    branches: tuple[BranchChoice, ...] = ()

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights, which gradients are reduced (and ZeRO shards) over: dp x cp."""
        return self.dp * self.cp

    @property
    def v(self) -> int:
        """Model chunks per rank: 1 unless the schedule is interleaved (then `virtual_stages`, default 2)."""
        if self.schedule != "interleaved_1f1b" or self.pp == 1:
            return 1
        return self.virtual_stages or VIRTUAL_STAGES

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def describe(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}", f"zero{self.zero_stage}",
                 f"M{self.micro_batches}x{self.micro_batch_size}"]
        if self.pp > 1 and self.schedule != "1f1b":
            parts.append(self.schedule + (f" v{self.v}" if self.v > 1 else ""))
        if self.ep > 1:
            parts.insert(3, f"ep{self.ep}")
        if self.cp > 1:
            parts.insert(3, f"cp{self.cp}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.recompute:
            parts.append(f"ac-{self.recompute}")
        for b in self.branches:
            compressed = b.compression is not None and b.tp < self.tp
            parts.append(f"{b.glob.rsplit('.', 1)[-1]}:tp{b.tp}" + (f"+{_mode(b.compression)}" if compressed else "")
                         + (f"+zero{b.zero_stage}" if b.zero_stage else ""))
        return " ".join(parts)

    def strategy_init_args(self) -> dict[str, Any]:
        """The `NPUHybridStrategy` arguments of this layout (LightningCLI's ``init_args``)."""
        args: dict[str, Any] = {
            "tensor_parallel_size": self.tp,
            "pipeline_parallel_size": self.pp,
            "data_parallel_size": self.dp,
            "zero_stage": self.zero_stage,
        }
        if self.pp > 1:
            args["micro_batches"] = self.micro_batches
            args["pipeline_schedule"] = self.schedule
        if self.ep > 1:
            args["expert_parallel_size"] = self.ep
        if self.cp > 1:
            args["context_parallel_size"] = self.cp
        if self.sequence_parallel:
            args["sequence_parallel"] = True
        if self.recompute:
            args["activation_checkpointing"] = self.recompute
        if self.branches:  # a tower at the top-level tp has no branch dp: no entry (and nothing to compress), unless
            # it shards itself (its own ZeRO 2/3 over fdp = the top-level dp)
            entries = {b.glob: b.strategy_entry() for b in self.branches if b.tp < self.tp or b.zero_stage}
            if entries:
                args["branch_layouts"] = entries
        return args


def _mode(compression: Any) -> str:
    """A branch compression's short name; 1-bit Adam (``frozen_variance``) as ``<mode>-adam``."""
    if not isinstance(compression, dict):
        return str(compression)
    return str(compression.get("mode")) + ("-adam" if compression.get("frozen_variance") else "")


# ---- a model from a LightningCLI config ------------------------------------------------------
_KEYS = {  # ModelSpec field -> accepted names in a config's model init_args (ours, then Hugging Face's)
    "layers": ("n_layer", "num_hidden_layers", "num_layers"),
    "hidden": ("n_embd", "hidden_size", "d_model"),
    "heads": ("n_head", "num_attention_heads"),
    "kv_heads": ("num_key_value_heads", "n_kv_head"),
    "ffn": ("intermediate_size", "ffn_hidden_size", "n_inner"),
    "vocab": ("vocab_size",),
    "seq": ("block_size", "max_position_embeddings", "seq_len"),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "experts_per_token": ("num_experts_per_tok",),
    "expert_ffn": ("moe_intermediate_size",),
}
# defaults of the example modules, for arguments a config leaves out
_EXAMPLE_DEFAULTS = {
    "GPTModule": dict(layers=4, hidden=128, heads=4, vocab=256, seq=128, bias=True),
    "LlamaModule": dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=256, seq=128),
}


# `transformers` model types with a gated (SwiGLU) MLP, RMSNorm and rotary positions (Llama's family)
_HF_GATED = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "olmo2")
_HF_LEARNED_POSITIONS = ("gpt2", "opt", "gpt_neo", "gpt_bigcode")


def _is_hf_config(config: dict) -> bool:
    return "model" not in config and ("model_type" in config or "architectures" in config)


def _from_hf_config(path: Path, config: dict, overrides: dict[str, Any]) -> ModelSpec:
    """A `ModelSpec` from a `transformers` ``config.json`` (``save_pretrained``'s, or the Hub's): its sizes, and
    the MLP, norm, positions and tying its model type implies; seq defaults to ``max_position_embeddings``."""
    found: dict[str, Any] = {}
    for fld, names in {**_KEYS, "seq": ("max_position_embeddings", "n_positions", "seq_length")}.items():
        name = next((n for n in names if config.get(n) is not None), None)
        if name is not None:
            found[fld] = config[name]
    kind = str(config.get("model_type", ""))
    gated = kind in _HF_GATED or config.get("hidden_act") in ("silu", "swish")
    attention = config.get("_attn_implementation") or config.get("attn_implementation") or "sdpa"
    found.update(
        mlp="swiglu" if gated else "gelu", norm="rmsnorm" if "rms_norm_eps" in config else "layernorm",
        bias=bool(config.get("attention_bias", kind in _HF_LEARNED_POSITIONS)),
        tied_embeddings=bool(config.get("tie_word_embeddings", True)),  # transformers' default
        learned_positions=kind in _HF_LEARNED_POSITIONS, attention="eager" if attention == "eager" else "flash",
        sequence_parallel_ok=False)
    found.update({k: v for k, v in overrides.items() if v is not None})
    missing = [f for f in ("layers", "hidden", "heads", "vocab", "seq", "global_batch") if f not in found]
    if missing:
        flags = " ".join(f"--{f.replace('_', '-')} N" for f in missing)
        raise PlannerError(f"{path}: a transformers config.json does not give {', '.join(missing)} (the sequences "
                           f"per optimizer step are the training run's); pass {flags}.")
    try:
        return ModelSpec(**found)
    except TypeError as err:
        raise PlannerError(f"{path}: {err}") from None


def decoder_from_config(path: Path, config: dict, **overrides: Any) -> ModelSpec:
    """A `ModelSpec` from the ``model:`` block of a LightningCLI YAML config (``data.init_args.block_size`` and
    ``batch_size`` x devices give seq and global batch unless `overrides` set them), or from a `transformers`
    ``config.json``; `config` is the file `path` read (`planner.read.model_from_config` reads it)."""
    if _is_hf_config(config):
        return _from_hf_config(path, config, overrides)
    model = config.get("model") or {}
    if not isinstance(model, dict):
        raise PlannerError(f"{path}: `model:` must be a mapping with class_path and init_args.")
    args = dict(model.get("init_args") or {k: v for k, v in model.items() if k != "class_path"})
    cls = str(model.get("class_path", "")).rsplit(".", 1)[-1]
    llama = "llama" in cls.lower() or "num_hidden_layers" in args
    found: dict[str, Any] = dict(_EXAMPLE_DEFAULTS.get(cls, {}))
    for fld, names in _KEYS.items():
        for name in names:
            if name in args:
                found[fld] = args[name]
                break
    if "bias" in args:
        found["bias"] = bool(args["bias"])
    data = ((config.get("data") or {}).get("init_args") or {})
    trainer = config.get("trainer") or {}
    if "block_size" in data:
        found["seq"] = data["block_size"]
    devices = trainer.get("devices", 1)
    if "batch_size" in data and isinstance(devices, int):
        found["global_batch"] = int(data["batch_size"]) * devices
    if llama:  # a `transformers` model: SDPA unless the config asks for eager attention; no sequence parallelism
        found.setdefault("kv_heads", found.get("heads"))
        eager = args.get("attn_implementation", "sdpa") == "eager"
        found.update(mlp="swiglu", norm="rmsnorm", attention="eager" if eager else "flash", sequence_parallel_ok=False)
    else:  # the example GPT: SDPA unless attention="explicit"
        eager = args.get("attention", "sdpa") == "explicit"
        found.update(attention="eager" if eager else "flash", learned_positions=True, mlp="gelu")
    found.update({k: v for k, v in overrides.items() if v is not None})
    missing = [f for f in ("layers", "hidden", "heads", "vocab", "seq", "global_batch") if f not in found]
    if missing:
        raise PlannerError(
            f"{path}: the model block does not give {missing}; pass them as options (e.g. --layers 32 --hidden 4096)."
        )
    try:
        return ModelSpec(**found)
    except TypeError as err:
        raise PlannerError(f"{path}: {err}") from None
