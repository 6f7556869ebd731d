"""fp32 islands: norms, softmax and losses compute in fp32 whatever the autocast dtype (modules by hooks,
functions by a torch function mode)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_npu.parallel.state import module_state

_HALF = (torch.bfloat16, torch.float16)

# ---------------------------------------------------------------------------------------------
# fp32 islands: norm and softmax modules
# ---------------------------------------------------------------------------------------------
_NORM_TYPES: tuple[type, ...] = tuple(
    t for t in (nn.LayerNorm, getattr(nn, "RMSNorm", None), nn.GroupNorm) if t is not None
)
_NORM_SUFFIXES = ("LayerNorm", "RMSNorm", "RmsNorm")
_SOFTMAX_TYPES: tuple[type, ...] = (nn.Softmax, nn.LogSoftmax)
_SOFTMAX_SUFFIXES = ("Softmax",)


def _class_names(module: nn.Module) -> list[str]:
    return [c.__name__ for c in type(module).__mro__]


def is_fp32_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or any(n.endswith(_NORM_SUFFIXES) for n in _class_names(module))


def is_fp32_softmax(module: nn.Module) -> bool:
    return isinstance(module, _SOFTMAX_TYPES) or any(
        n.endswith(_SOFTMAX_SUFFIXES) and n != "Module" for n in _class_names(module)
    )


def _upcast(x: Any) -> Any:
    return x.float() if isinstance(x, Tensor) and x.dtype in _HALF else x


def _first_float_tensor(tree: Any) -> Optional[Tensor]:
    found: list[Tensor] = []

    def visit(x: Any) -> Any:
        if not found and isinstance(x, Tensor) and x.is_floating_point():
            found.append(x)
        return x

    tree_map(visit, tree)
    return found[0] if found else None


def _island_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    x = _first_float_tensor((args, kwargs))
    stack = module_state(module).fp32_stack
    if x is None:
        stack.append((None, None))
        return args, kwargs
    ctx = contextlib.ExitStack()
    ctx.enter_context(torch.autocast(x.device.type, enabled=False))
    ctx.enter_context(FP32FunctionMode())  # 16-bit weights (bf16-true) join the fp32 math too
    stack.append((ctx, x.dtype))
    return tree_map(_upcast, args), tree_map(_upcast, kwargs)


def _island_post_hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    stack = getattr(module_state(module, create=False), "fp32_stack", None)
    if not stack:
        return output
    ctx, dtype = stack.pop()
    if ctx is not None:
        ctx.close()
    if dtype in _HALF:
        return tree_map(lambda t: t.to(dtype) if isinstance(t, Tensor) and t.dtype == torch.float32 else t, output)
    return output


def install_fp32_islands(module: nn.Module) -> list[str]:
    """Make every norm and softmax submodule of `module` compute in fp32 (idempotent).

    Returns the qualified names of the modules that got the hooks.
    """
    names = []
    for name, m in module.named_modules():
        if not (is_fp32_norm(m) or is_fp32_softmax(m)):
            continue
        names.append(name)
        if module_state(m).fp32_island:
            continue
        m.register_forward_pre_hook(_island_pre_hook, with_kwargs=True)
        m.register_forward_hook(_island_post_hook, with_kwargs=True, always_call=True)
        module_state(m).fp32_island = True
    return names
# ---------------------------------------------------------------------------------------------
# fp32 islands: functional calls
# ---------------------------------------------------------------------------------------------
_SOFTMAX_FUNCS = {
    torch.softmax, F.softmax, Tensor.softmax, torch.log_softmax, F.log_softmax, Tensor.log_softmax,
}
_NORM_FUNCS = {F.layer_norm, F.group_norm, torch.layer_norm, torch.group_norm}
if hasattr(F, "rms_norm"):
    _NORM_FUNCS |= {F.rms_norm}
_LOSS_FUNCS = {F.cross_entropy, F.nll_loss}


class FP32FunctionMode(TorchFunctionMode):
    """Runs softmax, norm and loss functions in fp32 with autocast off (see the module docstring)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        is_softmax = func in _SOFTMAX_FUNCS
        if not (is_softmax or func in _NORM_FUNCS or func in _LOSS_FUNCS):
            return func(*args, **kwargs)
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, Tensor):
            return func(*args, **kwargs)
        # softmax: a 16-bit input; norms and losses: any 16-bit tensor argument (input, weight, bias)
        half_args = [t for t in (args, kwargs) for t in tree_flatten(t)[0] if isinstance(t, Tensor) and t.dtype in _HALF]
        if not half_args or (is_softmax and x.dtype not in _HALF):
            return func(*args, **kwargs)
        in_dtype = x.dtype
        args, kwargs = tree_map(_upcast, args), tree_map(_upcast, kwargs)
        with torch.autocast(x.device.type, enabled=False):
            out = func(*args, **kwargs)
        if func in _LOSS_FUNCS:
            return out
        explicit_dtype = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)
        if is_softmax and explicit_dtype:
            return out
        return out.to(in_dtype) if isinstance(out, Tensor) else out
