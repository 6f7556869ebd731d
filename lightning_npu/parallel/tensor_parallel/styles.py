"""Tensor-parallel styles (DTensor `ParallelStyle`s): column/row splits of linear and Conv1D layers, fused
projections, the vocab-parallel head, sequence-parallel boundaries; and the module names they apply to."""

from __future__ import annotations

from functools import partial
from typing import Any, Optional, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from lightning_npu.parallel.errors import ParallelConfigError
from lightning_npu.parallel.state import tensor_state
from lightning_npu.parallel.tensor_parallel.logits import VocabParallelLogits

# ---- module-name conventions the automatic plan recognises ---------------------------------
COLWISE_NAMES = {
    "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "c_fc", "fc1", "w1", "w3", "wq", "wk", "wv",
    "query", "key", "value", "fc_in", "dense_h_to_4h",
}
# part-major fused projections ([q | k | v], [gate | up]): how many parts (q/k/v sizes come from the config)
FUSED_NAMES = {"c_attn": 3, "qkv_proj": 3, "Wqkv": 3, "qkv": 3, "gate_up_proj": 2}
# per-head (GPT-NeoX, Falcon) or per-kv-group (Falcon's new architecture) interleaved q/k/v: plain column split,
# recognised only for these model types (another model's `query_key_value` may be laid out otherwise)
INTERLEAVED_QKV_NAMES = {"query_key_value"}
INTERLEAVED_QKV_MODEL_TYPES = {"gpt_neox", "falcon"}
ROWWISE_NAMES = {"o_proj", "out_proj", "down_proj", "c_proj", "fc2", "w2", "wo", "fc_out", "dense_4h_to_h"}
VOCAB_EMBEDDING_NAMES = {"wte", "embed_tokens", "word_embeddings", "tok_embeddings", "token_embedding", "embed_in"}
HEAD_NAMES = {"lm_head", "output"}
# small linear layers around the blocks that stay whole: classifiers, poolers, projections into a joint space
REPLICATED_LINEAR_NAMES = {"classifier", "score", "visual_projection", "text_projection", "project_in", "project_out",
                           "qa_outputs"}
REPLICATED_PARENT_NAMES = {"pooler", "transform"}  # BERT's pooler.dense, cls.predictions.transform.dense
HEAD_ATTRS = ("n_head", "num_heads", "num_attention_heads", "n_heads")
KV_HEAD_ATTRS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_kv_head")
# widths of all local heads together that some attention modules reshape by (GPT-2, BERT, OPT/CLIP before 5.x)
HEAD_WIDTH_ATTRS = ("split_size", "all_head_size", "embed_dim")
PER_HEAD_ATTRS = ("head_dim", "attention_head_size", "head_size")
# head counts an attention module may read from its config in forward (Phi-3's qkv split): localised on a copy
CONFIG_HEAD_ATTRS = ("num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_head")
Q_NAMES = {"q_proj", "wq", "query", "c_attn", "qkv_proj", "Wqkv", "qkv", "query_key_value"}
KV_NAMES = {"k_proj", "v_proj", "wk", "wv", "key", "value"}


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): a linear layer whose weight is stored ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or _is_conv1d(module)


def _features(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a Linear or Conv1D."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.weight.shape[1]


Fused = Union[int, tuple[int, ...]]  # equal parts (their count), or the parts' sizes (Phi-3's q | k | v)


def part_sizes(fused: Fused, total: int) -> list[int]:
    """The sizes of a fused projection's parts along its output dim of `total` features."""
    if isinstance(fused, int):
        return [total // fused] * fused
    if sum(fused) != total:
        raise ValueError(f"fused parts {fused} do not add up to {total} features.")
    return list(fused)


def _is_fused(fused: Fused) -> bool:
    return (fused if isinstance(fused, int) else len(fused)) > 1


def _rank_major(t: torch.Tensor, dim: int, fused: Fused, tp: int) -> torch.Tensor:
    """Reorder ``[part0 | part1 | ...]`` along `dim` so that contiguous tp-chunks hold ``[p0_r | p1_r | ...]``."""
    if not _is_fused(fused):
        return t
    parts = [p.chunk(tp, dim) for p in t.split(part_sizes(fused, t.shape[dim]), dim)]
    return torch.cat([parts[j][r] for r in range(tp) for j in range(len(parts))], dim)


def _part_major(t: torch.Tensor, dim: int, fused: Fused, tp: int) -> torch.Tensor:
    """Inverse of :func:`_rank_major`."""
    if not _is_fused(fused):
        return t
    sizes = [n // tp for n in part_sizes(fused, t.shape[dim])]
    pieces = t.split(sizes * tp, dim)  # ordered (rank, part)
    return torch.cat([pieces[r * len(sizes) + j] for j in range(len(sizes)) for r in range(tp)], dim)


# ---- styles ----------------------------------------------------------------------------------
def _local_output(outputs: Any, output_layouts: Any, use_local_output: bool) -> Any:
    """A sharded layer's output in `output_layouts`, as a plain tensor when `use_local_output`.

    Under autograd that tensor is a copy, not ``to_local``'s view: model code adds into a layer's output in place
    (Falcon's ``mlp_output += attention_output``, 30-odd transformers models do so), which autograd forbids on a
    custom Function's view. One activation-sized copy per sharded layer; none without gradients."""
    if outputs.placements != output_layouts:
        outputs = outputs.redistribute(placements=output_layouts, async_op=True)
    if not use_local_output:
        return outputs
    local = outputs.to_local()
    return local.clone() if torch.is_grad_enabled() and local.requires_grad else local


class Colwise(ColwiseParallel):
    """DTensor's ColwiseParallel, extended to transformers' ``Conv1D`` and to fused projections.

    ``fused=3`` (q|k|v) or ``2`` (gate|up), or the parts' sizes (``(32, 16, 16)``: Phi-3's q|k|v with grouped kv
    heads), shards every part by columns and keeps each rank's parts together (see the module docstring); the
    parameter DTensor is ``Shard(out_dim)`` of the rank-major reordered weight, which `full_state.full_tensors`
    maps back to the original layout.
    """

    def __init__(self, *, fused: Fused = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fused = fused

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        out_dim = 1 if _is_conv1d(module) else 0
        for pname, param in list(module.named_parameters(recurse=False)):
            dim = out_dim if param.dim() == 2 else 0
            full = _rank_major(param.data, dim, self.fused, device_mesh.size())
            dist = nn.Parameter(
                distribute_tensor(full, device_mesh, [Shard(dim)], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            )
            tensor_state(dist).fused = (dim, self.fused)
            module.register_parameter(pname, dist)

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
                           device_mesh: DeviceMesh) -> Any:
        return _local_output(outputs, output_layouts, use_local_output)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Embedding) and not _is_fused(self.fused):
            return super()._apply(module, device_mesh)
        if not _is_linear(module):
            raise ParallelConfigError(
                f"column-wise sharding needs an nn.Linear, transformers Conv1D or nn.Embedding, got "
                f"{type(module).__name__}; pass a DTensor ParallelStyle object for it in `tp_plan`."
            )
        return distribute_module(
            module,
            device_mesh,
            self._partition_linear_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + (f", fused={self.fused})" if _is_fused(self.fused) else ")")


class Rowwise(RowwiseParallel):
    """DTensor's RowwiseParallel, extended to transformers' ``Conv1D`` (weight ``[in, out]``: Shard(0))."""

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
                           device_mesh: DeviceMesh) -> Any:
        return _local_output(outputs, output_layouts, use_local_output)

    def _partition_conv1d_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        module.register_parameter(
            "weight",
            nn.Parameter(
                distribute_tensor(module.weight, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank),
                requires_grad=module.weight.requires_grad,
            ),
        )
        if getattr(module, "bias", None) is not None:
            module.register_parameter(
                "bias",
                nn.Parameter(
                    distribute_tensor(module.bias, device_mesh, [Replicate()], src_data_rank=self.src_data_rank),
                    requires_grad=module.bias.requires_grad,
                ),
            )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not _is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module,
            device_mesh,
            self._partition_conv1d_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class VocabParallelHead(Colwise):
    """An LM head split along the vocabulary whose output is :class:`~lightning_npu.parallel.tensor_parallel.logits.VocabParallelLogits`:
    vocab-sharded for the vocab-parallel cross-entropy, and the full logits for any other use (torchmetrics,
    ``argmax``, ``generate``), gathered once on demand. A raw DTensor output broke such code."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"output_layouts": Shard(-1), "use_local_output": False, **kwargs})

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
                           device_mesh: DeviceMesh) -> Any:
        outputs = Colwise._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return VocabParallelLogits(outputs) if isinstance(outputs, DTensor) else outputs


class ReplicateSumGrad(ParallelStyle):
    """Parameters replicated over tp that each rank applies to its own heads only (transformers'
    ``replicated_with_grad_allreduce``: Gemma-3's and Qwen3's per-head ``q_norm``/``k_norm``).

    The forward runs on plain values; each rank's gradient then covers only its heads, a partial sum. The
    parameters are ``Replicate`` DTensors used through ``to_local(grad_placements=[Partial()])``, so DTensor
    all-reduces that gradient over tp in backward (under ZeRO 2/3 FSDP2 reduces the partial gradient as it does a
    sequence-parallel norm's).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param.data, device_mesh, [Replicate()]), requires_grad=param.requires_grad))
        swapped: dict[str, nn.Parameter] = {}

        def to_local(mod: nn.Module, args: Any) -> None:
            for pname, p in list(mod._parameters.items()):
                if isinstance(p, DTensor):
                    swapped[pname] = p  # type: ignore[assignment]
                    mod._parameters[pname] = p.to_local(grad_placements=[Partial()])  # type: ignore[assignment]

        def restore(mod: nn.Module, args: Any, output: Any) -> None:
            mod._parameters.update(swapped)
            swapped.clear()

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(restore, always_call=True)  # restored even when forward raises
        return module

    def __repr__(self) -> str:
        return "ReplicateSumGrad()"


class SharedRopeKeyProjection(ParallelStyle):
    """transformers' ``mla_kv_a_proj``: multi-head latent attention's ``kv_a_proj_with_mqa`` (DeepSeek-V2/V3), kept
    whole on every tp rank. Its output is the compressed K/V (into the column-parallel ``kv_b_proj``, whose backward
    already sums over tp) then the rotary key shared by all heads, which goes straight to this rank's heads: that
    last part's gradient is partial, so it is summed over tp in backward."""

    def __init__(self, fused: tuple[int, int]) -> None:
        super().__init__()
        self.fused = fused  # (latent, rope) output widths
        self.rope = fused[1]

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def after(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            latent, rope = output.split([output.shape[-1] - self.rope, self.rope], dim=-1)
            summed = DTensor.from_local(rope, device_mesh, [Replicate()], run_check=False)
            return torch.cat([latent, summed.to_local(grad_placements=[Partial()])], dim=-1)

        module.register_forward_hook(after)
        return module

    def __repr__(self) -> str:
        return f"SharedRopeKeyProjection(fused={self.fused})"


class ExpertsTensorParallel(ParallelStyle):
    """transformers' ``moe_tp_experts``: every expert split over tp, as Megatron's expert tensor parallelism.

    The experts module holds 3-D ``gate_up_proj`` ``[experts, 2 x inter, hidden]`` (column-split keeping each rank's
    gate and up halves together, rank-major as a fused projection) and ``down_proj`` ``[experts, hidden, inter]``
    (row-split). Each rank runs the model's own expert loop on the same tokens with its slices, which gives a partial
    sum of the output: it is all-reduced (reduce-scattered back to token shards under sequence parallelism, where the
    tokens are first gathered). The inputs' gradients are partial too and are reduced in backward.
    """

    PARAMS = ("gate_up_proj", "down_proj")

    def __init__(self, token_sharded: bool = False) -> None:
        super().__init__()
        self.token_sharded = token_sharded

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        gate_up, down = module.gate_up_proj, module.down_proj
        tp = device_mesh.size()
        up_dt = distribute_tensor(_rank_major(gate_up.data, 1, 2, tp), device_mesh, [Shard(1)])
        module.register_parameter("gate_up_proj", nn.Parameter(up_dt, requires_grad=gate_up.requires_grad))
        tensor_state(module.gate_up_proj).fused = (1, 2)
        module.register_parameter("down_proj", nn.Parameter(
            distribute_tensor(down.data, device_mesh, [Shard(2)]), requires_grad=down.requires_grad))
        tokens = Shard(0) if self.token_sharded else Replicate()
        swapped: dict[str, nn.Parameter] = {}

        def whole(t: Any) -> Any:  # the tokens every tp rank computes on; their gradient is summed over tp
            if not isinstance(t, torch.Tensor):
                return t
            dt = DTensor.from_local(t, device_mesh, [tokens], run_check=False).redistribute(device_mesh, [Replicate()])
            return dt.to_local(grad_placements=[Partial()]) if t.is_floating_point() else dt.to_local()

        def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            for pname in self.PARAMS:
                p = mod._parameters[pname]
                if isinstance(p, DTensor):
                    swapped[pname] = p  # type: ignore[assignment]
                    mod._parameters[pname] = p.to_local()  # type: ignore[assignment]
            return tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}

        def after(mod: nn.Module, args: Any, output: Any) -> Any:
            mod._parameters.update(swapped)
            swapped.clear()
            if not isinstance(output, torch.Tensor):
                return output
            dt = DTensor.from_local(output, device_mesh, [Partial()], run_check=False)
            return dt.redistribute(device_mesh, [tokens]).to_local()

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, always_call=True)
        return module

    def __repr__(self) -> str:
        return f"ExpertsTensorParallel(token_sharded={self.token_sharded})"


class _Replicate(ParallelStyle):
    """Leave the module replicated on every tp rank (norms, position embeddings)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return module

    def __repr__(self) -> str:
        return "Replicate()"


def _seq_gather(t: torch.Tensor, mesh: DeviceMesh, seq_dim: int) -> torch.Tensor:
    if not isinstance(t, DTensor):
        t = DTensor.from_local(t, mesh, [Shard(seq_dim)], run_check=False)
    return t.redistribute(mesh, [Replicate()]).to_local()


def _seq_shard(t: torch.Tensor, mesh: DeviceMesh, seq_dim: int) -> torch.Tensor:
    """This rank's sequence slice of a replicated tensor: no communication forward, all-gather backward."""
    dt = DTensor.from_local(t, mesh, [Replicate()], run_check=False)
    return dt.redistribute(mesh, [Shard(seq_dim)]).to_local()


def _input_hook(fn: Any, mesh: DeviceMesh, seq_dim: int) -> Any:
    """A forward pre-hook applying `fn` to a module's hidden-state input (first positional or ``hidden_states=``)."""
    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args and isinstance(args[0], torch.Tensor):
            args = (fn(args[0], mesh, seq_dim), *args[1:])
        elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
            kwargs = {**kwargs, "hidden_states": fn(kwargs["hidden_states"], mesh, seq_dim)}
        return args, kwargs
    return hook


def _output_hook(fn: Any, mesh: DeviceMesh, seq_dim: int) -> Any:
    """A forward hook applying `fn` to a module's hidden-state output (the tensor, or a tuple's first element)."""
    def hook(mod: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return fn(output, mesh, seq_dim)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (fn(output[0], mesh, seq_dim), *output[1:])
        return output
    return hook


class GatherSequence(ParallelStyle):
    """Sequence parallelism: all-gather the sequence-sharded hidden states entering a block (attention or MLP).

    Placed on the block rather than on its first projection, so a block that reads its input's shape
    (``b, t, _ = x.shape``) sees the whole sequence. The block's last projection (row-parallel with
    ``output_layouts=Shard(1)``) reduce-scatters back to sequence shards.
    """

    def __init__(self, seq_dim: int = 1) -> None:
        super().__init__()
        self.seq_dim = seq_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(_input_hook(_seq_gather, device_mesh, self.seq_dim), with_kwargs=True)
        return module


class SequenceShardedBlocks(ParallelStyle):
    """The ends of the sequence-sharded region of a transformers model: the first block's hidden-state input is
    split along the sequence, the last block's output gathered back. The parent model computes positions, masks and
    rotary embeddings from the whole sequence, and its final norm and head see it whole."""

    def __init__(self, shard_input: bool, gather_output: bool, seq_dim: int = 1) -> None:
        super().__init__()
        self.shard_input, self.gather_output, self.seq_dim = shard_input, gather_output, seq_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.shard_input:
            module.register_forward_pre_hook(_input_hook(_seq_shard, device_mesh, self.seq_dim), with_kwargs=True)
        if self.gather_output:
            module.register_forward_hook(_output_hook(_seq_gather, device_mesh, self.seq_dim))
        return module

    def __repr__(self) -> str:
        return f"SequenceShardedBlocks(shard_input={self.shard_input}, gather_output={self.gather_output})"


class FullSequence(ParallelStyle):
    """A module inside the sequence-sharded region that the plan leaves whole (transformers' DeepSeek-V3 attention,
    replicated MoE experts): it runs on the gathered sequence and its output is split again, so it computes what one
    process does (every tp rank the same: no gradient to sum)."""

    def __init__(self, seq_dim: int = -2) -> None:
        super().__init__()
        self.seq_dim = seq_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(_input_hook(_seq_gather, device_mesh, self.seq_dim), with_kwargs=True)
        module.register_forward_hook(_output_hook(_seq_shard, device_mesh, self.seq_dim))
        return module

    def __repr__(self) -> str:
        return "FullSequence()"


class ShardSequenceOutput(ParallelStyle):
    """Sequence parallelism for a replicated module (position embedding): keep this rank's sequence slice
    of its output (dim ``-2`` of ``[..., seq, hidden]``); no communication forward, all-gather backward."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            dt = DTensor.from_local(output, device_mesh, [Replicate()], run_check=False)
            return dt.redistribute(device_mesh, [Shard(output.dim() - 2)]).to_local()

        module.register_forward_hook(shard)
        return module


def _sequence_parallel_style(name: str, module: nn.Module, fused: Optional[Fused] = None,
                             gather_input: bool = False, seq_dim: int = 1) -> ParallelStyle:
    """The `name` style with activations sequence-sharded (dim `seq_dim`) between blocks (`gather_input`: a
    column-parallel projection that all-gathers its sequence-sharded input itself). transformers models use
    ``seq_dim=-2``, the token dim both of ``[batch, seq, hidden]`` and of the ``[tokens, hidden]`` some MLPs
    flatten to (OPT): norms and MLPs act on each token, so any split of the tokens gives the same result."""
    if gather_input:
        style = style_from_name(name, module, fused)
        style.input_layouts = (Shard(seq_dim),)
        return style
    if name == "rowwise_rep":
        return Rowwise(input_layouts=Replicate(), output_layouts=Shard(seq_dim))
    if name == "experts":  # the MoE block flattens its tokens: [tokens, hidden]
        return ExpertsTensorParallel(token_sharded=True)
    if name == "vocab" and isinstance(module, nn.Embedding):
        return Rowwise(input_layouts=Replicate(), output_layouts=Shard(seq_dim))
    if name == "vocab":
        return VocabParallelHead(input_layouts=Shard(seq_dim))
    if name == "rowwise":
        return Rowwise(output_layouts=Shard(seq_dim))
    if name == "position":
        return ShardSequenceOutput()
    if name == "norm":
        return SequenceParallel(sequence_dim=seq_dim, use_local_output=True)
    if name == "gather_seq":
        return GatherSequence(seq_dim)
    return style_from_name(name, module, fused)


def style_from_name(name: str, module: nn.Module, fused: Optional[Fused] = None) -> ParallelStyle:
    """The ParallelStyle a ``tp_plan`` style name means for `module`.

    colwise: column-parallel (output sharded); rowwise: row-parallel (input sharded, output all-reduced;
    on an Embedding: vocabulary split); vocab: embedding split along the vocabulary, or for a Linear an
    LM head whose logits stay vocab-sharded for the vocab-parallel cross-entropy; colwise_rep: column-parallel
    with the output gathered; rowwise_rep: row-parallel on a replicated input (each rank uses its slice; the pair
    colwise_rep + rowwise_rep keeps what lies between them whole); qkv / gate_up: fused column-parallel keeping
    each rank's parts together (`fused`: the parts' sizes where they differ); replicate_sum_grad: replicated,
    used on local heads, gradient summed over tp; experts: every MoE expert split over tp (`ExpertsTensorParallel`);
    shared_rope_key: MLA's kv_a_proj_with_mqa, replicated, its rotary-key output part's gradient summed over tp;
    sequence: norm/dropout on sequence shards; replicate: not sharded.
    """
    if name == "colwise":
        return Colwise()
    if name == "qkv":
        return Colwise(fused=fused or 3)
    if name == "gate_up":
        return Colwise(fused=fused or 2)
    if name == "rowwise":
        return Rowwise(input_layouts=Replicate()) if isinstance(module, nn.Embedding) else Rowwise()
    if name == "rowwise_rep":
        return Rowwise(input_layouts=Replicate())
    if name == "replicate_sum_grad":
        return ReplicateSumGrad()
    if name == "experts":
        return ExpertsTensorParallel()
    if name == "shared_rope_key":
        if not isinstance(fused, tuple) or len(fused) != 2:
            raise ParallelConfigError(f"tp_plan style 'shared_rope_key' for {type(module).__name__} needs the "
                                      "(latent, rope) output widths; it comes from transformers' 'mla_kv_a_proj'.")
        return SharedRopeKeyProjection(fused)
    if name == "vocab":
        if isinstance(module, nn.Embedding):
            return Rowwise(input_layouts=Replicate())
        return VocabParallelHead()
    if name == "colwise_rep":
        return Colwise(output_layouts=Replicate())
    if name == "sequence":
        return SequenceParallel()
    if name == "replicate":
        return _Replicate()
    raise ParallelConfigError(f"unknown tensor-parallel style {name!r}.")
