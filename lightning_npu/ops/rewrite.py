"""The module-rewrite pass: find fusable patterns and swap fused forwards onto them in place.

A pattern is only rewritten when it is provably the computation we fuse: norms and activations
by exact class, composite modules (MLP, pre-norm block, causal softmax) by comparing the AST of
their ``forward`` with the known form. Anything that merely looks similar is left alone and
reported with the reason, because a silently different forward would change the model.
Which matched patterns are actually rewritten depends on the device type (``ops.verdicts``):
only those measured faster there, so ``fuse_ops`` never slows a run down.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Union

import torch
import torch.nn as nn

from lightning_npu import device as dev
from lightning_npu.ops import extension, verdicts
from lightning_npu.ops import modules as fm


@dataclass
class Replacement:
    name: str
    original: str
    fused: str
    kernel: str
    why: str = ""


@dataclass
class Skipped:
    name: str
    original: str
    reason: str


@dataclass
class FusionReport:
    device: str
    backend: str
    replaced: list[Replacement] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    patterns: list[str] = field(default_factory=list)  # the patterns this pass was allowed to rewrite

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.replaced:
            out[r.kernel] = out.get(r.kernel, 0) + 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "backend": self.backend,
            "replaced": [vars(r) for r in self.replaced],
            "skipped": [vars(s) for s in self.skipped],
            "patterns": list(self.patterns),
        }

    def __str__(self) -> str:
        lines = [f"fusion on {self.device} via {self.backend}: {len(self.replaced)} replaced, {len(self.skipped)} skipped"]
        lines += [f"  + {r.name or '<root>'}: {r.original} -> {r.fused} [{r.kernel}] {r.why}" for r in self.replaced]
        lines += [f"  - {s.name or '<root>'}: {s.original}: {s.reason}" for s in self.skipped]
        return "\n".join(lines)


# ---- matching helpers -------------------------------------------------------------------------
_body_cache: dict[Any, Optional[str]] = {}


def _body_dump(fn: Callable) -> Optional[str]:
    """AST of a function body without its docstring (formatting and comments ignored)."""
    key = getattr(fn, "__code__", fn)
    if key not in _body_cache:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
            body = tree.body[0].body  # type: ignore[attr-defined]
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                body = body[1:]
            _body_cache[key] = ast.dump(ast.Module(body=body, type_ignores=[]))
        except (OSError, TypeError, SyntaxError, IndexError, AttributeError):
            _body_cache[key] = None
    return _body_cache[key]


def _known(src: str) -> str:
    return ast.dump(ast.Module(body=ast.parse(textwrap.dedent(src)).body, type_ignores=[]))


_GPT_MLP = _known("return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))")
_PRE_NORM_BLOCK = _known("x = x + self.attn(self.ln_1(x))\nreturn x + self.mlp(self.ln_2(x))")
_CAUSAL_SOFTMAX = _known(
    """
    t = scores.size(-1)
    mask = torch.ones(t, t, dtype=torch.bool, device=scores.device).triu(1)
    return torch.softmax((scores * self.scale).masked_fill(mask, float("-inf")), dim=-1)
    """
)
_CAUSAL_SDPA = _known(
    "return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)"
)
_SWIGLU_MLP = _known(
    "down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))\nreturn down_proj"
)
_HF_RMSNORM = _known(
    """
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
    """
)


def _forward_is(m: nn.Module, body: str) -> bool:
    return _body_dump(type(m).forward) == body


def _own_forward(m: nn.Module, base: type) -> bool:
    return type(m).forward is base.forward


def _hf_activation(m: nn.Module) -> Optional[str]:
    if type(m).__module__ != "transformers.activations":
        return None
    return type(m).__name__


def _is_silu(m: Any) -> bool:
    return type(m) is nn.SiLU or _hf_activation(m) == "SiLUActivation"


def _gelu_form(m: nn.Module) -> Union[str, None, Skipped]:
    """"none"/"tanh" for a GELU we fuse exactly, None if not a GELU, Skipped if a GELU we don't."""
    if isinstance(m, nn.GELU) and _own_forward(m, nn.GELU):
        return m.approximate
    name = _hf_activation(m)
    if name == "GELUActivation":
        return "none"
    if name in ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh"):
        return "tanh"
    if name is not None and "GELU" in name:
        return Skipped("", name, "a different GELU approximation than the erf/tanh forms the kernel computes")
    return None


Rule = tuple[type, str, dict[str, Any]]  # (mixin, kernel name, instance attributes to set)


def _match(m: nn.Module) -> Union[Rule, Skipped, None]:
    cls = type(m).__name__
    if isinstance(m, nn.LayerNorm):
        if not _own_forward(m, nn.LayerNorm):
            return Skipped("", cls, "LayerNorm subclass with its own forward")
        if len(m.normalized_shape) != 1:
            return Skipped("", cls, f"normalizes over {len(m.normalized_shape)} dims (kernel handles the last dim)")
        return fm.LayerNormFusion, "layer_norm", {}
    if hasattr(nn, "RMSNorm") and isinstance(m, nn.RMSNorm):
        if not _own_forward(m, nn.RMSNorm) or len(m.normalized_shape) != 1:
            return Skipped("", cls, "RMSNorm subclass with its own forward or a multi-dim normalized_shape")
        return fm.RMSNormFusion, "rms_norm", {}
    if cls.endswith("RMSNorm"):
        if _forward_is(m, _HF_RMSNORM) and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 1:
            return fm.RMSNormFusion, "rms_norm", {}
        return Skipped("", cls, "forward is not the recognised Llama-style RMSNorm (e.g. (1 + weight) scaling)")
    form = _gelu_form(m)
    if isinstance(form, Skipped):
        return form
    if form is not None:
        return fm.GELUFusion, f"gelu[{form}]", {"_lnpu_approximate": form}
    if isinstance(m, nn.Softmax) and _own_forward(m, nn.Softmax):
        if m.dim not in (-1,):
            return Skipped("", cls, f"softmax over dim={m.dim}; only dim=-1 (keys) is fused")
        return fm.SoftmaxFusion, "softmax", {}
    if _forward_is(m, _CAUSAL_SOFTMAX) and isinstance(getattr(m, "scale", None), float):
        return fm.CausalSoftmaxFusion, "scale_causal_softmax", {}
    if _forward_is(m, _CAUSAL_SDPA) and isinstance(getattr(m, "dropout", None), float):
        return fm.FusionAttentionSDPA, "fusion_attention", {}
    if _forward_is(m, _GPT_MLP):
        if isinstance(getattr(m, "c_fc", None), nn.Linear) and _gelu_form(m.gelu) in ("none", "tanh"):
            return fm.BiasGELUMLPFusion, "linear+bias_gelu", {}
        return Skipped("", cls, "c_fc is not an nn.Linear or the activation is not an exact GELU")
    if _forward_is(m, _SWIGLU_MLP):
        if _is_silu(getattr(m, "act_fn", None)):
            return fm.SwiGLUMLPFusion, "swiglu", {}
        return Skipped("", cls, f"gated MLP with {type(getattr(m, 'act_fn', None)).__name__}, not SiLU")
    if _forward_is(m, _PRE_NORM_BLOCK):
        ln = getattr(m, "ln_2", None)
        if isinstance(ln, nn.LayerNorm) and len(ln.normalized_shape) == 1:
            return fm.PreNormBlockFusion, "residual_add+layer_norm", {}
        return Skipped("", cls, "ln_2 is not a 1-D LayerNorm")
    # reported so users see what was considered and why it stayed eager
    if cls.endswith(("Block", "DecoderLayer", "EncoderLayer")) and any(
        "norm" in type(c).__name__.lower() for c in m.children()
    ):
        return Skipped("", cls, "residual+norm left unfused: forward is not the recognised pre-norm form")
    if cls.endswith("MLP"):
        return Skipped("", cls, "forward is not a recognised Linear->GELU or SwiGLU form")
    if cls.endswith("Attention") and type(m).__module__.startswith("transformers."):
        return Skipped("", cls, "softmax runs inside transformers' attention function; choose attn_implementation")
    if "softmax" in cls.lower():
        return Skipped("", cls, "unrecognised softmax forward")
    return None


def _backend(device_type: str) -> str:
    if device_type == dev.CPU:
        return "cpu: lightning_npu C++ kernels" if extension.available() else "cpu: eager fallback (no C++ build)"
    if device_type == dev.NPU:
        return "npu: torch_npu fused kernels"
    return f"{device_type}: PyTorch fused kernels"


def _device_type(device: Union[torch.device, str]) -> str:
    """The type of a device or device string; a string need not name a registered backend ("npu" on a CUDA box)."""
    return device.type if isinstance(device, torch.device) else str(device).split(":")[0]


def rewrite_modules(
    model: nn.Module,
    device: Union[torch.device, str, None] = None,
    patterns: Union[str, Iterable[str], None] = None,
) -> FusionReport:
    """Swap fused forwards onto the fusable modules of `model` in place; returns the report.

    `device` selects the kernels the report announces and the patterns rewritten by default:
    those measured faster on that device type (``ops.verdicts``; none on CUDA). `patterns`
    overrides that: kernel names from ``verdicts.PATTERNS`` or "all", e.g. to measure a
    device's table. At run time each op dispatches on its inputs' device, so a model moved
    later still runs correctly. Parameters, buffers, hooks and ``state_dict`` keys are
    untouched, so checkpoints load with or without fusion.
    """
    if device is None:
        p = next(model.parameters(), None)
        device = p.device if p is not None else torch.device(dev.CPU)
    device_type = _device_type(device)
    enabled = verdicts.default_patterns(device_type) if patterns is None else verdicts.check_patterns(patterns)
    report = FusionReport(device=str(device), backend=_backend(device_type), patterns=sorted(enabled))
    folded: set[str] = set()
    for name, m in model.named_modules():
        if isinstance(m, fm.FusedModule):
            if isinstance(m, fm.BiasGELUMLPFusion):  # second pass: its GELU stays folded
                folded.add(f"{name}.gelu" if name else "gelu")
            continue
        if name in folded:
            report.skipped.append(Skipped(name, type(m).__name__, "folded into its parent's fused forward"))
            continue
        found = _match(m)
        if found is None:
            continue
        if isinstance(found, Skipped):
            found.name = name
            report.skipped.append(found)
            continue
        mixin, kernel, attrs = found
        verdict = verdicts.verdict(device_type, kernel)
        if kernel not in enabled:
            why = verdict.why() if patterns is None else "not in the `patterns` passed to rewrite_modules"
            report.skipped.append(Skipped(name, type(m).__name__, f"{kernel} kept eager on {device_type}: {why}"))
            continue
        original = type(m)
        m.__class__ = fm.fused_class(original, mixin)
        for k, v in attrs.items():
            setattr(m, k, v)
        report.replaced.append(Replacement(name, original.__name__, m.__class__.__name__, kernel, verdict.why()))
        if mixin is fm.BiasGELUMLPFusion:
            folded.add(f"{name}.gelu" if name else "gelu")
    return report


__all__ = ["FusionReport", "Replacement", "Skipped", "rewrite_modules"]
