"""Ascend dispatch: the fused ``torch_npu`` kernels behind the same signatures as the CPU ops.

Imported only when a tensor actually lives on an NPU, so CPU/CUDA installs never touch
``torch_npu``. Untested on hardware in this repository's CI (no NPU there); signatures follow
the torch_npu API reference.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_npu.device import import_torch_npu
from lightning_npu.ops import reference


def add_layer_norm(x: Tensor, residual: Optional[Tensor], weight, bias, eps: float) -> tuple[Tensor, Tensor]:
    if residual is None or weight is None or bias is None:
        return reference.add_layer_norm(x, residual, weight, bias, eps)
    tnpu = import_torch_npu()
    y, _mean, _rstd, h = tnpu.npu_add_layer_norm(x, residual, weight, bias, eps, additional_output=True)
    return y, h


def add_rms_norm(x: Tensor, residual: Optional[Tensor], weight, eps: Optional[float]) -> tuple[Tensor, Tensor]:
    if weight is None:
        return reference.add_rms_norm(x, residual, weight, eps)
    tnpu = import_torch_npu()
    h = x if residual is None else x + residual
    eps = torch.finfo(h.dtype).eps if eps is None else eps
    y, _rstd = tnpu.npu_rms_norm(h, weight, epsilon=eps)
    return y, h


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    # npu_swiglu splits its input in two along `dim` and returns silu(first) * second
    return import_torch_npu().npu_swiglu(torch.cat([gate, up], dim=-1), dim=-1)


def scale_mask_softmax(scores: Tensor, scale: float, causal: bool, mask: Optional[Tensor]) -> Tensor:
    if scores.dim() != 4:
        return reference.scale_mask_softmax(scores, scale, causal, mask)
    tnpu = import_torch_npu()
    drop = torch.zeros(1, 1, scores.size(-2), scores.size(-1), dtype=torch.bool, device=scores.device)
    if mask is not None:
        drop = drop | mask
    # npu_scaled_masked_softmax: True in `mask` = masked out (same as masked_fill)
    return tnpu.npu_scaled_masked_softmax(scores, drop.expand_as(scores), scale, fixed_triu_mask=causal)


def fusion_attention(q: Tensor, k: Tensor, v: Tensor, keep_mask: Optional[Tensor], causal: bool, scale: float) -> Tensor:
    """SDPA semantics (`keep_mask` True = attend) on `npu_fusion_attention`, layout BNSD.

    npu_fusion_attention's `atten_mask` has the inverted convention: True/1 = masked *out*,
    so the SDPA-style mask is negated here; the causal case passes the upper triangle.
    """
    tnpu = import_torch_npu()
    tq, tk = q.size(-2), k.size(-2)
    drop = None if keep_mask is None else ~keep_mask
    if causal:
        tri = reference.causal_mask(tq, tk, q.device)
        drop = tri if drop is None else (drop | tri)
    out = tnpu.npu_fusion_attention(
        q, k, v, q.size(1), input_layout="BNSD", atten_mask=drop, scale=scale, keep_prob=1.0,
        sparse_mode=0,
    )
    return out[0]
