"""Ascend dispatch: the fused ``torch_npu`` kernels behind the same signatures as the CPU ops.

Imported only when a tensor actually lives on an NPU, so CPU/CUDA installs never touch
``torch_npu``. No NPU runs in this repository's CI: every call below is checked against a stub
``torch_npu`` (tests/stubs) whose signatures come from op-plugin's ``op_plugin_functions.yaml``
and which enforces the documented limits, so the kernel rules each function respects are
written next to the call. Where a call falls outside a kernel's rules the reference math runs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_npu.device import import_torch_npu
from lightning_npu.ops import reference

# npu_scaled_masked_softmax: x viewed as NCHW needs 32 <= H, W <= 4096 and H, W divisible by 32
_SOFTMAX_MIN, _SOFTMAX_MAX, _SOFTMAX_MULTIPLE = 32, 4096, 32
# npu_rms_norm (Atlas A2/A3) accepts these (x, gamma) dtype pairs only
_RMS_NORM_DTYPES = {
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
}


def add_layer_norm(x: Tensor, residual: Optional[Tensor], weight, bias, eps: float) -> tuple[Tensor, Tensor]:
    if residual is None or weight is None or bias is None or residual.dtype != x.dtype:
        return reference.add_layer_norm(x, residual, weight, bias, eps)
    tnpu = import_torch_npu()
    w, b = weight.to(x.dtype), bias.to(x.dtype)  # gamma/beta share x1's dtype in the kernel's table
    y, _mean, _rstd, h = tnpu.npu_add_layer_norm(x, residual, w, b, eps, additional_output=True)
    return y, h


def add_rms_norm(x: Tensor, residual: Optional[Tensor], weight, eps: Optional[float]) -> tuple[Tensor, Tensor]:
    if weight is None:
        return reference.add_rms_norm(x, residual, weight, eps)
    h = x if residual is None else x + residual
    if (h.dtype, weight.dtype) not in _RMS_NORM_DTYPES:
        # e.g. fp32 activations with 16-bit gamma under bf16-true: cast gamma like the CPU path does
        weight = weight.to(torch.float32 if h.dtype == torch.float32 else h.dtype)
    if (h.dtype, weight.dtype) not in _RMS_NORM_DTYPES:  # fp64 and friends
        return reference.add_rms_norm(x, residual, weight, eps)
    eps = reference.rms_eps(h.dtype) if eps is None else eps
    y, _rstd = import_torch_npu().npu_rms_norm(h, weight, epsilon=eps)
    return y, h


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    # npu_swiglu splits its input in two along `dim` and returns silu(first) * second
    return import_torch_npu().npu_swiglu(torch.cat([gate, up], dim=-1), dim=-1)


def softmax_shape_ok(scores: Tensor) -> bool:
    """The documented shape rule of ``npu_scaled_masked_softmax`` (4-D, last two dims in [32, 4096], /32)."""
    if scores.dim() != 4 or scores.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    return all(_SOFTMAX_MIN <= n <= _SOFTMAX_MAX and n % _SOFTMAX_MULTIPLE == 0 for n in scores.shape[-2:])


def scale_mask_softmax(scores: Tensor, scale: float, causal: bool, mask: Optional[Tensor]) -> Tensor:
    """Rows with every key masked come out as zeros (the kernel fills masked logits with a finite
    value, so such rows would be uniform); shapes outside the kernel's rule take the reference."""
    drop = None if mask is None else mask.to(torch.bool)
    if causal:
        tri = reference.causal_mask(scores.size(-2), scores.size(-1), scores.device)
        drop = tri if drop is None else (drop | tri)
    if not softmax_shape_ok(scores):
        out = reference.scale_mask_softmax(scores, scale, False, drop)
    else:
        if drop is None:
            drop = torch.zeros(1, 1, scores.size(-2), scores.size(-1), dtype=torch.bool, device=scores.device)
        while drop.dim() < 4:
            drop = drop.unsqueeze(0)
        # True in `mask` = masked out; fixed_triu_mask is reserved (only False is supported): the causal
        # triangle is already in `drop`
        out = import_torch_npu().npu_scaled_masked_softmax(scores, drop, scale, fixed_triu_mask=False)
    if drop is None:
        return out
    return out.masked_fill(drop.all(dim=-1, keepdim=True), 0.0)


def fusion_attention(
    q: Tensor, k: Tensor, v: Tensor, keep_mask: Optional[Tensor], causal: bool, scale: float, keep_prob: float = 1.0
) -> Tensor:
    """SDPA semantics (`keep_mask` True = attend, dropout p = 1 - keep_prob) on `npu_fusion_attention`, BNSD.

    npu_fusion_attention's `atten_mask` has the inverted convention: True/1 = masked *out*,
    so the SDPA-style mask is negated here; the causal case passes the upper triangle.
    """
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError(f"`keep_prob={keep_prob}` must be in (0, 1] (npu_fusion_attention's dropout keep ratio).")
    tnpu = import_torch_npu()
    tq, tk = q.size(-2), k.size(-2)
    drop = None if keep_mask is None else ~keep_mask
    if causal:
        tri = reference.causal_mask(tq, tk, q.device)
        drop = tri if drop is None else (drop | tri)
    out = tnpu.npu_fusion_attention(
        q, k, v, q.size(1), "BNSD", atten_mask=drop, scale=scale, keep_prob=keep_prob, sparse_mode=0,
    )
    return out[0]
