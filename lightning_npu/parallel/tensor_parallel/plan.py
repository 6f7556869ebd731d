"""Tensor parallelism over the mesh's ``tp`` dimension, built on DTensor.

An ordinary PyTorch model is sharded without rewriting its layers:

* :func:`plan_tensor_parallel` turns ``tp_plan`` ("auto", a dict of ``glob -> style name`` or
  ``glob -> ParallelStyle``, where the style ``"auto"`` is the automatic plan's choice so that
  ``{"*": "auto", "model.lm_head": "replicate"}`` overrides one module; the automatic plan is a transformers
  model's own tp plan where it ships one, else name rules: `auto`) into a per-module plan and
  validates it against the tp size
  (heads, kv-heads, hidden/FFN widths, vocabulary) **without any process group**, so a bad layout
  fails before ``init_process_group``;
* :func:`apply_tensor_parallel` runs DTensor's ``parallelize_module`` with those styles, re-ties
  tied weights, keeps sharded modules' buffers plain and gives attention modules their local head counts
  (on the module, or on a per-module copy of the config it reads them from);
* the vocab-split LM head (:class:`VocabParallelHead`) returns
  :class:`~lightning_npu.parallel.tensor_parallel.logits.VocabParallelLogits`: the full logits for ordinary code
  (torchmetrics, ``argmax``, ``generate``; gathered once on demand), the shard for the loss;
* :func:`vocab_parallel_cross_entropy` is a context in which ``F.cross_entropy`` on vocab-sharded
  logits runs DTensor's ``loss_parallel`` (max-subtracted log-softmax, never gathering the logits)
  and returns a plain tensor, so an unchanged ``training_step`` can ``self.log`` it;
* how the sharded parameters are then held (DTensors, or plain local shards under ZeRO 0/1) and
  translated to and from full tensors is `checkpoint.full_state`'s business alone.

Fused projections (GPT-2's ``c_attn`` = q|k|v, ``gate_up_proj`` = gate|up) are column-sharded so
that each rank holds *its* heads of every part: the output rows are reordered rank-major before
sharding (rank r holds ``[q_r, k_r, v_r]``), so the unchanged ``view(b, t, 3, heads, head_dim)``
of the model sees its local heads. The reordering is internal: `checkpoint.full_state` undoes it,
so checkpoints and ``state_dict`` keys and layouts are those of the unsharded model.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, loss_parallel, parallelize_module
from torch.overrides import TorchFunctionMode

from lightning_npu.parallel.errors import ParallelConfigError
from lightning_npu.parallel.pipeline_parallel.plan import find_blocks
from lightning_npu.parallel.tensor_parallel.auto import AutoPlan, auto_plan, qkv_parts
from lightning_npu.parallel.tensor_parallel.logits import unwrap_logits
from lightning_npu.parallel.tensor_parallel.styles import (
    CONFIG_HEAD_ATTRS,
    HEAD_ATTRS,
    HEAD_WIDTH_ATTRS,
    KV_HEAD_ATTRS,
    KV_NAMES,
    PER_HEAD_ATTRS,
    Q_NAMES,
    FullSequence,
    GatherSequence,
    SequenceShardedBlocks,
    ShardSequenceOutput,
    _features,
    _is_linear,
    _sequence_parallel_style,
    part_sizes,
    style_from_name,
)


# ---- planning and validation (no process group needed) ---------------------------------------
@dataclass
class TensorParallelPlan:
    """A resolved plan: module FQN -> (style name or "custom", ParallelStyle)."""

    tp_size: int
    styles: dict[str, tuple[str, ParallelStyle]] = field(default_factory=dict)
    local_heads: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    replicated: list[str] = field(default_factory=list)
    applied: bool = False
    sequence_parallel: bool = False
    sources: list[str] = field(default_factory=list)  # where the automatic choices came from

    @property
    def vocab_parallel_head(self) -> bool:
        return any(
            isinstance(s, ColwiseParallel) and not s.use_local_output and isinstance(s.output_layouts[0], Shard)
            for _, s in self.styles.values()
        )

    def report(self) -> str:
        sp = ", sequence parallel" if self.sequence_parallel else ""
        lines = [f"tensor parallel (tp={self.tp_size}{sp}): {len(self.styles)} module(s) in the plan"]
        lines += [f"  from {source}" for source in self.sources]
        lines += [f"  {fqn}: {name}" + (f" {style.fused}" if not isinstance(getattr(style, "fused", 1), int) else "")
                  for fqn, (name, style) in self.styles.items()]
        for fqn, attrs in self.local_heads.items():
            lines.append(f"  {fqn}: " + ", ".join(f"{a} {g} -> {l}" for a, (g, l) in attrs.items()))
        if self.replicated:
            lines.append(f"  replicated: {', '.join(self.replicated)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()


def _check_divides(tp: int, what: str, value: int, fqn: str, fix: str = "") -> None:
    if value % tp:
        raise ParallelConfigError(
            f"tensor_parallel_size={tp} does not divide {what}={value} (module {fqn}){fix}"
        )


def _int_attrs(obj: Any, names: tuple[str, ...]) -> dict[str, int]:
    found = {}
    for attr in names:
        value = getattr(obj, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            found[attr] = value
    return found


def _head_counts(module: nn.Module) -> dict[str, int]:
    """The head counts an attention module holds (``num_heads``) or reads from its config (``config.<name>``)."""
    found = _int_attrs(module, HEAD_ATTRS + KV_HEAD_ATTRS)
    config = getattr(module, "config", None)
    if config is not None:
        found.update({f"config.{a}": v for a, v in _int_attrs(config, CONFIG_HEAD_ATTRS).items()})
    return found


def _local_widths(module: nn.Module, counts: dict[str, int], tp: int) -> dict[str, tuple[int, int]]:
    """Widths of all heads together that the module reshapes by (GPT-2's ``split_size``, BERT's ``all_head_size``),
    where they are heads x head size."""
    heads = next((v for a, v in counts.items() if a in HEAD_ATTRS), None)
    per_head = next(iter(_int_attrs(module, PER_HEAD_ATTRS).values()), None)
    if heads is None or per_head is None:
        return {}
    return {a: (v, v // tp) for a, v in _int_attrs(module, HEAD_WIDTH_ATTRS).items() if v == heads * per_head}


def plan_tensor_parallel(
    model: nn.Module, tp_size: int, tp_plan: Any = "auto", sequence_parallel: bool = False
) -> TensorParallelPlan:
    """Resolve `tp_plan` for `model` and validate it against `tp_size`; raises ParallelConfigError.

    ``"auto"`` entries take the automatic plan's choice (`auto`: the model's own transformers tp plan where it has
    one, else name rules). No process group is needed: the strategy calls this before ``init_process_group``.
    """
    plan = TensorParallelPlan(tp_size)
    if tp_size == 1 or tp_plan is None:
        return plan
    sp_blocks = _check_sequence_parallel(model, tp_plan) if sequence_parallel else None
    modules = dict(model.named_modules())
    entries = {"*": "auto"} if tp_plan == "auto" else tp_plan
    automatic = auto_plan(model, modules)
    # the plan's entries in order, later ones winning: "auto" is the dict {"*": "auto"}
    assigned: dict[str, Any] = {}  # fqn -> style name, ParallelStyle, or None (auto found no layout)
    explicit: set[str] = set()
    for pattern, style in entries.items():
        matched = [f for f in modules if f and fnmatch.fnmatchcase(f, pattern)]
        if not matched:
            raise ParallelConfigError(f"`tp_plan[{pattern!r}]` matches no module of {type(model).__name__}.")
        for fqn in matched:
            if style != "auto":
                assigned[fqn] = style
                explicit.add(fqn)
            elif fqn in automatic.styles:
                assigned[fqn] = automatic.styles[fqn]
                explicit.discard(fqn)
    unknown = [fqn for fqn, style in assigned.items() if style is None]
    if unknown:
        raise ParallelConfigError(_cannot_shard(tp_plan, unknown, modules, automatic.reasons))
    for fqn in modules:  # module order, whatever the order of the entries
        style = assigned.get(fqn)
        if style is None:
            continue
        if isinstance(style, ParallelStyle):
            plan.styles[fqn] = ("custom", style)
        elif style == "replicate":
            plan.replicated.append(fqn)
        else:
            if fqn in explicit:
                _check_fused_layout(fqn, style, automatic.layouts.get(fqn))
            fused = _fused_parts(fqn, style, modules, automatic)
            plan.styles[fqn] = (style, style_from_name(style, modules[fqn], fused))
    if tp_plan == "auto" and not plan.styles:
        raise ParallelConfigError(
            f"tp_plan='auto' found nothing to shard in {type(model).__name__}; pass an explicit tp_plan dict."
        )
    plan.sources = [s for s in automatic.sources if any(v == "auto" for v in entries.values())]
    _validate(plan, modules)
    if sequence_parallel:
        _make_sequence_parallel(plan, modules, sp_blocks)
    return plan


def _cannot_shard(tp_plan: Any, unknown: list[str], modules: dict[str, nn.Module], reasons: dict[str, str]) -> str:
    where = "tp_plan='auto'" if tp_plan == "auto" else "the 'auto' entry of tp_plan"
    described = [f"{f} ({type(modules[f]).__name__}{': ' + reasons[f] if f in reasons else ''})" for f in unknown]
    more = (f" (and {len(unknown) - 1} more: {', '.join(unknown[1:4])}{'...' if len(unknown) > 4 else ''})"
            if len(unknown) > 1 else "")
    known = "" if unknown[0] in reasons else (
        ": its name/type matches no known transformer layout (nanoGPT/GPT-2 c_attn/c_proj/c_fc, "
        "Llama q_proj/k_proj/v_proj/o_proj/gate_proj/up_proj/down_proj, embed_tokens, lm_head, or a transformers "
        "model's own tp_plan)")
    return (f"{where} cannot shard module {described[0]}{more}{known}. Give it a style on top of the automatic plan, "
            "e.g. tp_plan={'*': 'auto', '<module glob>': 'colwise'|'rowwise'|'vocab'|'replicate'|...}; 'replicate' "
            f"keeps it whole on every rank: {{'*': 'auto', '{_glob(unknown[0])}': 'replicate'}}.")


def _glob(fqn: str) -> str:
    """A glob for `fqn` and its siblings in other blocks (layer numbers as ``*``)."""
    return re.sub(r"(^|\.)\d+(\.|$)", lambda m: m.group(1) + "*" + m.group(2), fqn)


def _check_fused_layout(fqn: str, style: str, auto: Optional[str]) -> None:
    """A column split must match how the model lays out a fused projection's output: 'colwise' on a part-major
    [q | k | v] (or [gate | up]) hands ranks whole parts, 'qkv' on a per-head interleaved one mixes heads; both
    train silently wrong."""
    fused = {"qkv", "gate_up"}
    if (style == "colwise" and auto in fused) or (style in fused and auto == "colwise"):
        raise ParallelConfigError(
            f"`tp_plan` style {style!r} for module {fqn} does not match its layout: it is "
            f"{'part-major, ' + repr(auto) if auto in fused else 'interleaved per head, ' + repr(auto)} splits it "
            f"(or keep its output whole with 'colwise_rep' and 'rowwise_rep' on the projection after it)."
        )


def _fused_parts(fqn: str, style: str, modules: dict[str, nn.Module], automatic: AutoPlan) -> Any:
    if style == "gate_up":
        return 2
    if style not in ("qkv", "shared_rope_key"):
        return None
    if fqn in automatic.fused:
        return automatic.fused[fqn]
    if style == "shared_rope_key":
        return None  # its (latent, rope) widths come from the model's plan and config only
    module = modules[fqn]
    return qkv_parts(modules.get(fqn.rpartition(".")[0]), _features(module)[1]) if _is_linear(module) else 3


def _check_sequence_parallel(model: nn.Module, tp_plan: Any) -> Optional[str]:
    """The block list whose inputs and outputs bound the sequence-sharded region, for models whose forward derives
    positions and masks from the embedding output's length (transformers models); None for nanoGPT-style models,
    which shard from the embedding on (positions from the input ids)."""
    if tp_plan != "auto" and not (isinstance(tp_plan, dict) and all(isinstance(v, str) for v in tp_plan.values())):
        raise ParallelConfigError(
            "`sequence_parallel=True` rewrites a plan of style names (tp_plan='auto', or a dict of names such as "
            "{'*': 'auto', '*.mlp.experts': 'replicate'}); with ParallelStyle objects in the plan leave "
            "sequence_parallel=False and put the layouts in the plan (DTensor SequenceParallel/PrepareModuleInput)."
        )
    transformers_model = any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers")
        for module in model.modules() for cls in type(module).__mro__)
    return find_blocks(model) if transformers_model else None


def _make_sequence_parallel(plan: TensorParallelPlan, modules: dict[str, nn.Module],
                            blocks: Optional[str] = None) -> None:
    """Rewrite a resolved auto plan so activations are sequence-sharded between blocks.

    `blocks` (transformers models): the sequence is split at the first block's input and gathered at the last
    block's output, so that everything the parent model computes from the embedding's output (positions, masks,
    rotary embeddings) sees the whole sequence; inside, norms and residuals run on sequence shards."""
    def in_blocks(fqn: str) -> bool:
        return blocks is None or fqn.startswith(blocks + ".")

    def is_block(fqn: str) -> bool:
        return blocks is not None and fqn.rpartition(".")[0] == blocks

    gathered = {"colwise", "qkv", "gate_up"} | ({"colwise_rep"} if blocks is not None else set())
    parents = {fqn.rpartition(".")[0] for fqn, (name, _) in plan.styles.items()
               if name in gathered and in_blocks(fqn)}
    seq_dim = 1 if blocks is None else -2
    styles: dict[str, tuple[str, ParallelStyle]] = {}
    if blocks is not None:
        n = len(modules[blocks])
        first, last = f"{blocks}.0", f"{blocks}.{n - 1}"
        styles[first] = ("shard_seq", SequenceShardedBlocks(shard_input=True, gather_output=n == 1, seq_dim=seq_dim))
        if n > 1:
            styles[last] = ("gather_seq_output", SequenceShardedBlocks(False, gather_output=True, seq_dim=seq_dim))
    for fqn in sorted(parents):
        if not is_block(fqn):  # a projection right under a block (OPT's fc1) gathers its own input instead
            styles[fqn] = ("gather_seq", GatherSequence(seq_dim))
    for fqn, (name, style) in plan.styles.items():
        fused = getattr(style, "fused", None)
        if not in_blocks(fqn):
            styles[fqn] = (name, style)
        elif fqn.rpartition(".")[0] in parents and is_block(fqn.rpartition(".")[0]) and name in gathered:
            styles[fqn] = (name, _sequence_parallel_style(name, modules[fqn], fused, gather_input=True,
                                                          seq_dim=seq_dim))
        else:
            styles[fqn] = (name, _sequence_parallel_style(name, modules[fqn], fused, seq_dim=seq_dim))
    replicated, full = [], []
    if blocks is not None:
        # a block's part that the plan leaves whole (DeepSeek-V3's attention, replicated experts) runs on the
        # gathered sequence; norms run on shards
        for fqn, module in modules.items():
            if not is_block(fqn.rpartition(".")[0]) or not any(True for _ in module.parameters()):
                continue
            if any(f == fqn or f.startswith(fqn + ".") for f in styles):
                continue
            if list(module.children()) or not all(p.dim() == 1 for p in module.parameters(recurse=False)):
                styles[fqn] = ("full_sequence", FullSequence(seq_dim))
        # every other module with parameters of its own that sees sequence shards (not under a module that
        # gathers them: routers, replicated experts beside shared ones, norms) gets its gradient summed over tp
        full = [f for f, (name, _) in styles.items() if name in ("gather_seq", "full_sequence") or
                (f.rpartition(".")[0] in parents and is_block(f.rpartition(".")[0]) and name in gathered)]
        for fqn, module in modules.items():
            own = list(module.parameters(recurse=False))
            if (not own or not in_blocks(fqn) or fqn in styles
                    or any(fqn == f or fqn.startswith(f + ".") for f in full)):
                continue
            norm = all(p.dim() == 1 for p in own)
            styles[fqn] = ("norm", _sequence_parallel_style("norm", module, seq_dim=seq_dim)) if norm else (
                "replicate_sum_grad", style_from_name("replicate_sum_grad", module))
    for fqn in plan.replicated:
        module = modules[fqn]
        if not in_blocks(fqn) or fqn in styles or any(fqn.startswith(f + ".") for f in full):
            if fqn not in styles:
                replicated.append(fqn)
        elif isinstance(module, nn.Embedding):
            styles[fqn] = ("position", ShardSequenceOutput())
        elif all(p.dim() == 1 for p in module.parameters(recurse=False)):
            styles[fqn] = ("norm", _sequence_parallel_style("norm", module, seq_dim=seq_dim))
        else:
            replicated.append(fqn)
    plan.styles = styles
    plan.replicated = replicated
    plan.sequence_parallel = True


def _validate(plan: TensorParallelPlan, modules: dict[str, nn.Module]) -> None:
    tp = plan.tp_size
    # attention modules: the parents of sharded q/k/v projections must have divisible head counts
    for fqn, (name, _) in plan.styles.items():
        parent_fqn, _, leaf = fqn.rpartition(".")
        if name in ("colwise", "qkv") and (leaf in Q_NAMES or leaf in KV_NAMES) and parent_fqn in modules:
            parent = modules[parent_fqn]
            counts = _head_counts(parent)
            for attr, value in counts.items():
                is_kv = attr.split(".")[-1] in KV_HEAD_ATTRS
                _check_divides(
                    tp, "num_kv_heads" if is_kv else "num_heads", value, parent_fqn,
                    "; every rank needs whole (key/value) heads: choose a tensor_parallel_size that divides it.",
                )
            # every count it holds or reads from its config, and the widths it reshapes by, become this rank's
            local = {a: (v, v // tp) for a, v in counts.items()}
            local.update(_local_widths(parent, counts, tp))
            if local:
                plan.local_heads[parent_fqn] = local
    for fqn, (name, style) in plan.styles.items():
        module = modules[fqn]
        if name == "custom":
            continue
        if name == "experts":
            _check_experts(tp, fqn, module)
            continue
        if isinstance(module, nn.Embedding):
            dim_size = module.num_embeddings if name in ("vocab", "rowwise") else module.embedding_dim
            what = "vocab_size" if name in ("vocab", "rowwise") else "embedding_dim"
            _check_divides(tp, what, dim_size, fqn, _vocab_fix(tp, dim_size) if what == "vocab_size" else "")
            continue
        if not _is_linear(module):
            if name in ("colwise", "rowwise", "vocab", "colwise_rep", "qkv", "gate_up"):
                raise ParallelConfigError(
                    f"tp_plan style {name!r} for module {fqn} needs an nn.Linear/Conv1D/nn.Embedding, got "
                    f"{type(module).__name__}; pass a DTensor ParallelStyle object for it instead."
                )
            continue
        in_f, out_f = _features(module)
        if name == "shared_rope_key":
            continue  # whole on every rank
        if name == "rowwise":
            _check_divides(tp, "in_features", in_f, fqn)
        elif name == "vocab":
            _check_divides(tp, "vocab_size (out_features)", out_f, fqn, _vocab_fix(tp, out_f))
        elif name in ("qkv", "gate_up"):
            fused = style.fused
            if isinstance(fused, int) and out_f % fused:
                raise ParallelConfigError(
                    f"tp_plan style {name!r} for module {fqn} splits its {out_f} output features into {fused} equal "
                    "parts, which they are not; pass a DTensor ParallelStyle object for it (e.g. "
                    "lightning_npu.parallel.tensor_parallel.styles.Colwise(fused=(q, k, v)) with the parts' sizes)."
                )
            for i, size in enumerate(part_sizes(fused, out_f)):
                _check_divides(tp, f"out_features of part {i} of {len(part_sizes(fused, out_f))}", size, fqn)
        else:
            _check_divides(tp, "out_features", out_f, fqn)


def _check_experts(tp: int, fqn: str, module: nn.Module) -> None:
    params = dict(module.named_parameters(recurse=False))
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        raise ParallelConfigError(
            f"tp_plan style 'experts' for module {fqn} ({type(module).__name__}) needs transformers' 3-D expert "
            "parameters gate_up_proj [experts, 2 x intermediate, hidden] and down_proj [experts, hidden, "
            f"intermediate], got {sorted(params)}; keep it whole with 'replicate'.")
    _check_divides(tp, "the experts' intermediate size", down.shape[2], fqn,
                   "; every rank holds whole columns of each expert's gate and up projections.")


def _vocab_fix(tp: int, vocab: int) -> str:
    padded = -(-vocab // tp) * tp
    return (f"; the vocabulary is not padded automatically: pad it to a multiple of {tp} "
            f"(e.g. vocab_size={padded}; padded token ids never occur as targets) or choose another tp size.")


# ---- applying the plan (needs the tp mesh) ---------------------------------------------------
def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan) -> TensorParallelPlan:
    """Shard `model` in place over `tp_mesh` with DTensor's parallelize_module; returns the plan as report."""
    if plan.applied or not plan.styles:
        return plan
    if tp_mesh.size() != plan.tp_size:
        raise ParallelConfigError(f"the tp mesh has {tp_mesh.size()} ranks but the plan was made for {plan.tp_size}.")
    # tied weights (GPT-2's lm_head.weight is wte.weight): remember the holders to re-tie after sharding
    holders: dict[int, list[tuple[str, str]]] = {}
    for mod_fqn, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            holders.setdefault(id(p), []).append((mod_fqn, pname))
    tied = [h for h in holders.values() if len(h) > 1]
    parallelize_module(model, tp_mesh, {fqn: style for fqn, (_, style) in plan.styles.items()})
    for group in tied:
        _retie(model, group)
    for fqn in plan.styles:
        _plain_buffers(model.get_submodule(fqn))
    local_configs: dict[int, Any] = {}  # one local copy per config object, shared as the original was
    for fqn, attrs in plan.local_heads.items():
        module = model.get_submodule(fqn)
        for attr, (_, local) in attrs.items():
            if not attr.startswith("config."):
                setattr(module, attr, local)
        config_attrs = {a[len("config."):]: v for a, (_, v) in attrs.items() if a.startswith("config.")}
        if config_attrs:
            if id(module.config) not in local_configs:
                local = copy.copy(module.config)
                for attr, value in config_attrs.items():
                    setattr(local, attr, value)
                local_configs[id(module.config)] = local
            module.config = local_configs[id(module.config)]
    plan.applied = True
    return plan


def _retie(model: nn.Module, group: list[tuple[str, str]]) -> None:
    """One parameter held by several modules (GPT-2's lm_head.weight is wte.weight; BERT's prediction bias is its
    decoder's) is one object again after sharding: the sharded DTensor. Layers that apply it must agree on its
    layout; a container that only holds it (BertLMPredictionHead.bias) holds the DTensor too."""
    held = [(m, n, getattr(model.get_submodule(m), n)) for m, n in group]
    sharded = [(m, n, p) for m, n, p in held if isinstance(p, DTensor)]
    if not sharded:
        return
    first_mod, first_name, keep = sharded[0]
    for mod_fqn, pname, other in held:
        if other is keep:
            continue
        applies = _is_linear(model.get_submodule(mod_fqn)) or isinstance(model.get_submodule(mod_fqn), nn.Embedding)
        if (isinstance(other, DTensor) and other.placements != keep.placements) or (
                not isinstance(other, DTensor) and applies):
            raise ParallelConfigError(
                f"tied parameters {first_mod}.{first_name} and {mod_fqn}.{pname} got different tensor-parallel "
                "layouts; shard both the same way (e.g. 'vocab' for the embedding and the LM head) or untie them."
            )
        model.get_submodule(mod_fqn).register_parameter(pname, keep)


def _plain_buffers(module: nn.Module) -> None:
    """DTensor's styles replicate a sharded module's buffers as DTensors (Gemma-3's scaled embedding's
    ``embed_scale``); DDP's buffer broadcast and ordinary code then meet a DTensor among plain tensors. A replicated
    buffer is the same everywhere: keep it plain (DTensor ops take a 0-dim plain tensor as replicated)."""
    for name, buf in list(module._buffers.items()):
        if isinstance(buf, DTensor) and all(p.is_replicate() for p in buf.placements):
            module._buffers[name] = buf.to_local()


# ---- sequence parallelism under FSDP2 -----------------------------------------------------------------
def tp_replicated_modules(model: nn.Module) -> list[nn.Module]:
    """Modules holding DTensor parameters replicated over tp: the sequence-parallel norms (``SequenceParallel``).

    They see sequence-sharded inputs, so each tp rank computes only a partial sum of their weight
    gradients (a ``Partial`` DTensor). Under FSDP2 that sum is all-reduced over tp in the dtype the
    parameters were gathered in, before FSDP's ``reduce_dtype`` applies; the caller uses this list to
    gather these (tiny) parameters in fp32 so that the tp reduction of their gradients is fp32 too.
    """
    return [
        m for m in model.modules()
        if any(isinstance(p, DTensor) and all(pl.is_replicate() for pl in p.placements)
               for p in m.parameters(recurse=False))
    ]


# ---- vocab-parallel cross-entropy --------------------------------------------------------------
def _class_sharded(t: Any) -> bool:
    if not isinstance(t, DTensor):
        return False
    class_dim = 1 if t.dim() >= 2 else 0
    return any(isinstance(p, Shard) and p.dim % t.dim() == class_dim for p in t.placements)


class _VocabParallelCrossEntropy(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        logits = (args[0] if args else kwargs.get("input")) if func is F.cross_entropy else None
        if logits is not None and _class_sharded(unwrap_logits(logits)):
            # the head's VocabParallelLogits: its DTensor, never gathered
            if args:
                args = (unwrap_logits(logits), *args[1:])
            else:
                kwargs = {**kwargs, "input": unwrap_logits(logits)}
            out = func(*args, **kwargs)  # vocab_parallel_cross_entropy() has loss_parallel active around us
            # the loss is Replicate over tp: its local value is the whole loss, and to_local is differentiable
            return out.to_local() if isinstance(out, DTensor) else out
        return func(*args, **kwargs)


@contextlib.contextmanager
def vocab_parallel_cross_entropy() -> Iterator[None]:
    """``F.cross_entropy`` on vocab-sharded logits (the head's VocabParallelLogits, or a DTensor) runs vocab-parallel
    and returns a plain tensor.

    DTensor's ``loss_parallel`` computes the log-softmax from per-shard maxima and sums (fp32 when
    the logits are fp32, as ``.float()`` in the loss makes them) and picks each target's logit on the
    rank that owns it, so the full logits are never gathered; ``ignore_index`` and all reductions
    are supported. Also enter it around ``backward`` (the strategy does).
    """
    with _VocabParallelCrossEntropy(), loss_parallel():
        yield
