"""Fused forwards that the rewrite pass swaps onto existing modules.

A matched module keeps its identity, parameters, buffers, hooks and ``state_dict`` keys; only
its class changes to ``Fused<Original>``, a subclass of the original built from one of the
mixins below (so ``isinstance`` checks in TP plans and precision code still hold). Fused
instances pickle and deepcopy as the same fused class, rebuilt from the original class.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_npu.ops import functional as fx

_classes: dict[tuple[type, type], type] = {}


def fused_class(original: type, mixin: type) -> type:
    key = (original, mixin)
    if key not in _classes:
        _classes[key] = type(
            f"Fused{original.__name__}",
            (mixin, original),
            {"_lnpu_original": original, "_lnpu_mixin": mixin, "__module__": __name__},
        )
    return _classes[key]


def _restore(original: type, mixin: type, state: dict[str, Any]) -> nn.Module:
    obj = original.__new__(original)
    obj.__setstate__(state) if hasattr(obj, "__setstate__") else obj.__dict__.update(state)
    obj.__class__ = fused_class(original, mixin)
    return obj


class FusedModule:
    """Marker base of every fused mixin."""

    _lnpu_original: type
    _lnpu_mixin: type

    def __reduce_ex__(self, protocol):  # dynamic classes are not importable by name: rebuild them
        return (_restore, (self._lnpu_original, self._lnpu_mixin, self.__dict__.copy()))


def _hooked(m: nn.Module) -> bool:
    """A module with hooks must really be called (e.g. TP input/output redistribution)."""
    return bool(m._forward_hooks or m._forward_pre_hooks)


class LayerNormFusion(FusedModule):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fx.layer_norm(x, self.weight, self.bias, self.eps)


class RMSNormFusion(FusedModule):
    """torch.nn.RMSNorm (eps may be None) and transformers' Llama-style RMSNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.variance_epsilon if hasattr(self, "variance_epsilon") else self.eps
        y = fx.rms_norm(x, self.weight, eps)
        if hasattr(self, "variance_epsilon") and self.weight.dtype != x.dtype:
            y = y.to(torch.promote_types(self.weight.dtype, x.dtype))  # transformers' output dtype
        return y


class GELUFusion(FusedModule):
    _lnpu_approximate: str = "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fx.bias_gelu(x, None, self._lnpu_approximate)


class SoftmaxFusion(FusedModule):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dim in (-1, x.dim() - 1):
            return fx.scale_mask_softmax(x)
        return torch.softmax(x, self.dim)


class CausalSoftmaxFusion(FusedModule):
    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        return fx.scale_mask_softmax(scores, self.scale, causal=True)


class BiasGELUMLPFusion(FusedModule):
    """c_fc -> GELU -> c_proj -> dropout with c_fc's bias folded into the GELU kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc, approximate = self.c_fc, getattr(self.gelu, "approximate", "none")
        if _hooked(fc) or fc.bias is None:
            h = fx.bias_gelu(fc(x), None, approximate)
        else:
            h = fx.bias_gelu(F.linear(x, fc.weight), fc.bias, approximate)
        return self.dropout(self.c_proj(h))


class SwiGLUMLPFusion(FusedModule):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fx.swiglu(self.gate_proj(x), self.up_proj(x)))


class PreNormBlockFusion(FusedModule):
    """x + attn(ln_1(x)) and ln_2 of that sum in one kernel, which also returns the sum."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attn(self.ln_1(x))
        ln = self.ln_2
        if _hooked(ln):
            x = x + a
            return x + self.mlp(ln(x))
        y, h = fx.add_layer_norm(a, x, ln.weight, ln.bias, ln.eps)
        return h + self.mlp(y)


class FusionAttentionSDPA(FusedModule):
    """Causal ``F.scaled_dot_product_attention`` (BNSD) on ``npu_fusion_attention`` when the
    inputs live on an NPU; dropout keeps its meaning (p = 1 - keep_prob, training only)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        return fx.causal_attention(q, k, v, p)
