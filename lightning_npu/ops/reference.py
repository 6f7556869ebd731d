"""Eager PyTorch versions of every fused op.

They are the fallback when the C++ kernels cannot be built, the path for devices with no
dedicated kernel, and (run in fp64) the tests' ground truth. Each mirrors exactly what the
unfused modules compute, so a fused model on the fallback path is bit-identical to eager.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def bias_gelu(x: Tensor, bias: Optional[Tensor] = None, approximate: str = "none") -> Tensor:
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def bias_dropout_add(
    x: Tensor, bias: Optional[Tensor], residual: Tensor, p: float, training: bool = True, mask: Optional[Tensor] = None
) -> Tensor:
    """`mask` (1 keep / 0 drop) reproduces a given draw; without it the eager dropout RNG draws one."""
    h = x if bias is None else x + bias
    if mask is not None:
        return residual + h * mask / (1.0 - p) if p < 1.0 else residual + h * 0
    return residual + F.dropout(h, p, training)


def add_layer_norm(
    x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], eps: float
) -> tuple[Tensor, Tensor]:
    """Returns (norm(h), h) with h = x + residual (h = x without a residual)."""
    h = x if residual is None else x + residual
    return F.layer_norm(h, (h.shape[-1],), weight, bias, eps), h


def rms_eps(dtype: torch.dtype) -> float:
    """F.rms_norm's eps=None: the machine epsilon of the dtype it accumulates in (fp32 for 16-bit inputs)."""
    return torch.finfo(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype).eps


def add_rms_norm(
    x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], eps: Optional[float]
) -> tuple[Tensor, Tensor]:
    h = x if residual is None else x + residual
    return F.rms_norm(h, (h.shape[-1],), weight, eps), h


def causal_mask(tq: int, tk: int, device: torch.device) -> Tensor:
    """True above the (bottom-right aligned) diagonal: the positions a causal query may not see."""
    return torch.ones(tq, tk, dtype=torch.bool, device=device).triu(tk - tq + 1)


def scale_mask_softmax(
    scores: Tensor, scale: float = 1.0, causal: bool = False, mask: Optional[Tensor] = None
) -> Tensor:
    """`mask` is boolean, broadcastable to the scores, True = drop (Tensor.masked_fill convention)."""
    z = scores * scale
    if causal:
        z = z.masked_fill(causal_mask(z.size(-2), z.size(-1), z.device), float("-inf"))
    if mask is not None:
        z = z.masked_fill(mask, float("-inf"))
    return torch.softmax(z, dim=-1)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up
