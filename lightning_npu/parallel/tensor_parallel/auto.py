"""The automatic tensor-parallel plan (``tp_plan="auto"``, or the style ``"auto"`` in a dict plan).

One style name per module that holds parameters, or a refusal with its reason:

* inside a ``transformers`` model that ships a tp plan (``model.tp_plan`` in transformers 5, built from
  ``config.base_model_tp_plan``; Llama, Qwen, Mistral, Gemma, Phi-3, GPT-NeoX, ...) that plan decides, its style
  names mapped onto this package's DTensor styles (`TRANSFORMERS_STYLES`), except that the output embedding (the LM
  head) stays vocab-sharded for the vocab-parallel cross-entropy where transformers gathers its logits; modules
  the plan does not name stay replicated, as transformers keeps them;
* elsewhere (GPT-2, OPT, Falcon, BERT, ViT, CLIP, nanoGPT-style models) name rules: the projection names of
  `styles`, with fused projections split by their parts (Phi-3-style ``qkv_proj``: q/k/v sizes from the
  attention's config; GPT-NeoX's and Falcon's ``query_key_value``: interleaved per head or kv group, a plain
  column split; Falcon's multi-query attention: gathered, since one k/v head cannot be split).

No process group and no ``transformers`` import: models are recognised by their classes' names and attributes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.nn as nn

from lightning_npu.parallel.tensor_parallel.styles import (
    COLWISE_NAMES,
    FUSED_NAMES,
    HEAD_NAMES,
    INTERLEAVED_QKV_MODEL_TYPES,
    INTERLEAVED_QKV_NAMES,
    KV_NAMES,
    Q_NAMES,
    REPLICATED_LINEAR_NAMES,
    REPLICATED_PARENT_NAMES,
    ROWWISE_NAMES,
    VOCAB_EMBEDDING_NAMES,
    Fused,
    _features,
    _is_linear,
)

# transformers' style names -> this package's (`styles.style_from_name`); the LM head is "vocab" whatever it says
TRANSFORMERS_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_rep": "colwise_rep",
    "colwise_gather_output": "colwise_rep",
    "rowwise_rep": "rowwise_rep",
    "rowwise_split_input": "rowwise_rep",
    "embedding_rowwise": "vocab",
    "embedding_colwise": "colwise_rep",
    "packed_colwise": "gate_up",
    "replicated_with_grad_allreduce": "replicate_sum_grad",
    "moe_tp_experts": "experts",
    "mla_kv_a_proj": "shared_rope_key",
    "replicate": "replicate",
}
_EXPERT_STYLES = ("moe", "ep_", "grouped_gemm", "packed_rowwise")
# the parameter entries transformers gives an experts module whose style is "moe_tp_experts"
_EXPERT_PARAMS = {("gate_up_proj", "packed_colwise"), ("down_proj", "rowwise")}


@dataclass
class AutoPlan:
    """What the automatic plan chose: a style name per module (None where it cannot choose, `reasons` says why),
    the parts of fused projections, and where the choices came from (for the plan's report)."""

    styles: dict[str, Optional[str]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    fused: dict[str, Fused] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    # how the name rules read fused projections (part-major 'qkv'/'gate_up', interleaved 'colwise'), whatever
    # plan decides: what an explicit style for them is checked against
    layouts: dict[str, Optional[str]] = field(default_factory=dict)


def is_transformers_model(module: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
               for c in type(module).__mro__)


def _outermost_transformers_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []
    for fqn, module in model.named_modules():
        if any(p == "" or fqn == p or fqn.startswith(p + ".") for p, _ in found):
            continue
        if is_transformers_model(module):
            found.append((fqn, module))
    return found


def transformers_tp_plan(hf: nn.Module, kind: str = "tp") -> dict[str, str]:
    """The model's own tp (or `kind`: ep) plan: ``{generic module or parameter name: transformers style}`` (``*`` for
    layer numbers), empty when it has none. transformers 5 merges it on the instance (``tp_plan``); 4.x keeps
    ``_tp_plan`` there, and ``config.base_model_tp_plan`` names the base model's modules."""
    plan = getattr(hf, f"{kind}_plan", None)
    if not isinstance(plan, dict) or not plan:
        plan = getattr(hf, f"_{kind}_plan", None)
    if isinstance(plan, dict) and plan:
        return dict(plan)
    base = getattr(getattr(hf, "config", None), f"base_model_{kind}_plan", None) or {}
    prefix = getattr(hf, "base_model_prefix", "") or ""
    inner = getattr(hf, prefix, None) if prefix else None
    pre = f"{prefix}." if isinstance(inner, nn.Module) and inner is not hf else ""
    return {f"{pre}{k}": v for k, v in base.items()}


def _generic(name: str) -> str:
    """transformers' plan keys: layer numbers between dots are ``*``."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def _embeddings(hf: nn.Module, prefix: str, getter: str) -> set[str]:
    try:
        module = getattr(hf, getter)()
    except (AttributeError, NotImplementedError, TypeError):
        return set()
    if not isinstance(module, nn.Module):
        return set()
    return {(prefix + "." if prefix else "") + f for f, m in hf.named_modules() if m is module}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def auto_plan(model: nn.Module, modules: dict[str, nn.Module]) -> AutoPlan:
    """The automatic style of every module of `model` that holds parameters itself (see the module docstring)."""
    out = AutoPlan()
    heads: set[str] = set()
    inputs: set[str] = set()
    planned: dict[str, str] = {}  # fqn -> transformers style, inside models with a plan
    covered: list[str] = []  # prefixes of the transformers models whose plan decides
    for prefix, hf in _outermost_transformers_models(model):
        heads |= _embeddings(hf, prefix, "get_output_embeddings")
        inputs |= _embeddings(hf, prefix, "get_input_embeddings")
        plan = transformers_tp_plan(hf)
        if not plan:
            continue
        covered.append(prefix)
        out.sources.append(f"{_join(prefix, '') or type(model).__name__}: transformers' tp_plan of {type(hf).__name__}")
        experts = {k for k, v in transformers_tp_plan(hf, "ep").items() if v == "ep_dispatch_experts"}
        for name, module in hf.named_modules():
            style = plan.get(_generic(name)) if name else None
            if style is None and name and _generic(name) in experts:
                # transformers >= 5.2x dropped `moe_tp_experts` from its tp plans (its experts go to ep only): the
                # experts its ep plan names are split over tp as before, Megatron's expert tensor parallelism
                style = "moe_tp_experts"
            if style == "mla_kv_a_proj":
                rope = getattr(getattr(hf, "config", None), "qk_rope_head_dim", None)
                width = getattr(module, "out_features", None)
                if isinstance(rope, int) and isinstance(width, int) and 0 < rope < width:
                    out.fused[_join(prefix, name)] = (width - rope, rope)
                else:
                    out.reasons[_join(prefix, name)] = (
                        "transformers' tp_plan style 'mla_kv_a_proj' needs an nn.Linear and the config's "
                        f"qk_rope_head_dim (got {rope!r})")
            if style is not None:
                planned[_join(prefix, name)] = style
            for pname, _ in module.named_parameters(recurse=False):  # entries for a parameter (MoE experts)
                pstyle = plan.get(_generic(_join(name, pname)))
                if style == "moe_tp_experts" and (pname, pstyle) in _EXPERT_PARAMS:
                    continue  # what the experts style does with them
                if pstyle is not None and pstyle != "replicate":
                    expert = "expert" in type(module).__name__.lower() or pstyle.startswith(_EXPERT_STYLES)
                    out.reasons.setdefault(_join(prefix, name), (
                        f"transformers' tp_plan shards its parameter {pname!r} as {pstyle!r}"
                        + ("; MoE experts are not tensor-parallel here yet" if expert else "")))
    vocab_sizes = {m.num_embeddings for f, m in modules.items() if isinstance(m, nn.Embedding)
                   and (f in inputs or f.rsplit(".", 1)[-1] in VOCAB_EMBEDDING_NAMES)}
    blocks = {f"{f}.{c}" for f, m in modules.items() if isinstance(m, nn.ModuleList) for c, _ in m.named_children()}
    rules = _NameRules(modules, vocab_sizes, heads, inputs, blocks)
    if len(covered) < len(_outermost_transformers_models(model)) or not covered:
        out.sources.append("name rules (lightning_npu.parallel.tensor_parallel.styles)")
    for fqn, module in modules.items():
        if _is_linear(module) and fqn.rsplit(".", 1)[-1] in set(FUSED_NAMES) | INTERLEAVED_QKV_NAMES:
            out.layouts[fqn] = rules.style(fqn, module)[0]
        if not fqn or not any(True for _ in module.parameters(recurse=False)):
            continue
        if any(p == "" or fqn == p or fqn.startswith(p + ".") for p in covered):
            if fqn in out.reasons:
                out.styles[fqn] = None
                continue
            style, reason = _from_transformers(fqn, module, planned.get(fqn), heads)
            if style in ("gate_up",):
                out.fused[fqn] = 2
        elif any(p.dim() >= 2 for p in module.parameters(recurse=False)):
            style, reason, fused = rules.style(fqn, module)
            if fused is not None:
                out.fused[fqn] = fused
        else:
            style, reason = "replicate", None  # norms and other 1-D parameters stay replicated
        out.styles[fqn] = style
        if reason is not None:
            out.reasons[fqn] = reason
    return out


def _from_transformers(fqn: str, module: nn.Module, style: Optional[str],
                       heads: set[str]) -> tuple[Optional[str], Optional[str]]:
    if style is None:
        return "replicate", None  # not in the plan: transformers keeps it whole too
    if fqn in heads and style in ("colwise", "colwise_rep", "colwise_gather_output"):
        return "vocab", None  # logits stay vocab-sharded: the loss is vocab-parallel, never gathered
    if style == "embedding_rowwise" and not isinstance(module, nn.Embedding):
        return None, f"transformers' tp_plan style 'embedding_rowwise' on a {type(module).__name__}"
    mapped = TRANSFORMERS_STYLES.get(style)
    if mapped is not None:
        return mapped, None
    what = "MoE experts are not tensor-parallel here yet" if style.startswith(_EXPERT_STYLES) else "not supported"
    return None, f"transformers' tp_plan style {style!r} ({what})"


class _NameRules:
    """The name rules for modules outside a transformers plan: (style, reason it cannot choose, fused parts)."""

    def __init__(self, modules: dict[str, nn.Module], vocab_sizes: set[int], heads: set[str], inputs: set[str],
                 blocks: set[str]) -> None:
        self.modules, self.vocab_sizes, self.heads, self.inputs, self.blocks = (
            modules, vocab_sizes, heads, inputs, blocks)

    def in_block(self, fqn: str) -> bool:
        return any(fqn == b or fqn.startswith(b + ".") for b in self.blocks)

    def style(self, fqn: str, module: nn.Module) -> tuple[Optional[str], Optional[str], Optional[Fused]]:
        parent_fqn, _, leaf = fqn.rpartition(".")
        parent_leaf = parent_fqn.rpartition(".")[2]
        if isinstance(module, nn.Embedding):
            if fqn in self.inputs or leaf in VOCAB_EMBEDDING_NAMES:
                return "vocab", None, None
            return "replicate", None, None  # positions, token types: small, read by every rank
        if not _is_linear(module):
            if self.in_block(fqn):
                return None, f"no tensor-parallel layout is known for a {type(module).__name__} in a block", None
            return "replicate", None, None  # patch embeddings (Conv2d), class tokens, ...: no layout to split
        in_f, out_f = _features(module)
        if fqn in self.heads or (leaf in HEAD_NAMES and not self.in_block(fqn)):
            if not self.vocab_sizes or out_f in self.vocab_sizes:
                return "vocab", None, None
        if leaf in FUSED_NAMES:
            return self._fused(fqn, leaf, module, in_f, out_f)
        if leaf in INTERLEAVED_QKV_NAMES:
            style, reason = self._interleaved(parent_fqn)
            return style, reason, None
        if leaf in COLWISE_NAMES:
            return "colwise", None, None
        if leaf in ROWWISE_NAMES:
            return "rowwise", None, None
        if leaf == "dense":
            return (*self._dense(parent_fqn, parent_leaf), None)
        if leaf in REPLICATED_LINEAR_NAMES or parent_leaf in REPLICATED_PARENT_NAMES:
            return "replicate", None, None
        return None, None, None

    def _fused(self, fqn: str, leaf: str, module: nn.Module, in_f: int,
               out_f: int) -> tuple[Optional[str], Optional[str], Optional[Fused]]:
        if FUSED_NAMES[leaf] == 2:
            return "gate_up", None, 2
        if leaf == "c_attn" and out_f != 3 * in_f:
            return None, "a c_attn that is not q|k|v (cross-attention's k|v)", None
        parts = qkv_parts(self.modules.get(fqn.rpartition(".")[0]), out_f)
        return "qkv", None, parts

    def _interleaved(self, parent_fqn: str) -> tuple[Optional[str], Optional[str]]:
        """GPT-NeoX / Falcon ``query_key_value``: whole heads (or kv groups) lie together, so a column split hands
        each rank its heads; one k/v head for all queries (Falcon's multi-query) or ALiBi (biases made for every
        head by the parent model) cannot be split: the attention stays whole (gathered)."""
        attention = self.modules.get(parent_fqn)
        config = getattr(attention, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type not in INTERLEAVED_QKV_MODEL_TYPES:
            return None, (f"the q/k/v layout of a query_key_value in a {model_type or 'unknown'} model is not known "
                          "('colwise' if q/k/v are interleaved per head, 'qkv' if they are [q | k | v] blocks, "
                          "'colwise_rep' with 'rowwise_rep' on the output projection to keep attention whole)")
        return ("colwise_rep" if _gathered_attention(attention) else "colwise"), None

    def _dense(self, parent_fqn: str, parent_leaf: str) -> tuple[Optional[str], Optional[str]]:
        """``dense`` is named by its place: BERT's intermediate.dense (up) and output.dense (down), GPT-NeoX's and
        Falcon's attention.dense (after query_key_value), poolers' and prediction transforms' (replicated)."""
        if parent_leaf == "intermediate":
            return "colwise", None
        if parent_leaf == "output":
            return "rowwise", None
        parent = self.modules.get(parent_fqn)
        siblings = {name for name, _ in parent.named_children()} if parent is not None else set()
        if siblings & INTERLEAVED_QKV_NAMES:
            style, reason = self._interleaved(parent_fqn)
            return ("rowwise_rep" if style == "colwise_rep" else "rowwise" if style else None), reason
        if siblings & (Q_NAMES | KV_NAMES):
            return "rowwise", None
        if parent_leaf in REPLICATED_PARENT_NAMES:
            return "replicate", None
        return None, None


def _gathered_attention(attention: Any) -> bool:
    config = getattr(attention, "config", None)
    multi_query = getattr(attention, "multi_query", False) and not getattr(attention, "new_decoder_architecture", False)
    return bool(multi_query or getattr(config, "alibi", False))


def qkv_parts(attention: Optional[nn.Module], out_f: int) -> Fused:
    """q|k|v sizes of a part-major fused projection: from the attention's config where k/v have their own head count
    (Phi-3 with grouped kv heads: q 32 | k 16 | v 16), else equal thirds."""
    config = getattr(attention, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None)
    head_dim = getattr(attention, "head_dim", None) or getattr(config, "head_dim", None)
    if head_dim is None and isinstance(heads, int) and isinstance(getattr(config, "hidden_size", None), int):
        head_dim = config.hidden_size // heads
    if all(isinstance(v, int) for v in (heads, kv, head_dim)) and (heads + 2 * kv) * head_dim == out_f and kv != heads:
        return (heads * head_dim, kv * head_dim, kv * head_dim)
    return 3
