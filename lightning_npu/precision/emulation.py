"""bf16 matmuls as fp32 kernels on bf16-rounded operands, for CPUs without bf16 instructions (where torch's
bf16 GEMM is a scalar fallback, ~30x slower than fp32)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

_MATMUL_FUNCS = {
    F.linear, torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.mm, Tensor.mm, torch.bmm, Tensor.bmm,
    torch.addmm, torch.baddbmm, F.scaled_dot_product_attention,
}


class EmulatedBF16MatmulMode(TorchFunctionMode):
    """bf16 matmuls and attention on a CPU without bf16 instructions (`dev.fast_bf16`), as fp32 kernels on the
    bf16-rounded operands with the result rounded to bf16: what a bf16 GEMM with fp32 accumulation computes, in
    another summation order, about 10x faster in the example GPT's step. Only where bf16 is what would run:
    under bf16 autocast, or with every floating operand bf16 (``bf16-true``)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func not in _MATMUL_FUNCS:
            return func(*args, **kwargs)
        floats = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and t.is_floating_point()]
        autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        if (not floats or any(t.device.type != "cpu" for t in floats)
                or not (autocast or all(t.dtype == torch.bfloat16 for t in floats))):
            return func(*args, **kwargs)
        args, kwargs = tree_map(_bf16_rounded, args), tree_map(_bf16_rounded, kwargs)
        with torch.autocast("cpu", enabled=False):
            return func(*args, **kwargs).to(torch.bfloat16)


def _bf16_rounded(x: Any) -> Any:
    return x.to(torch.bfloat16).float() if isinstance(x, Tensor) and x.is_floating_point() else x
