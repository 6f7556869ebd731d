"""The C++ kernels as ``torch.library`` custom ops (namespace ``lightning_npu``).

Custom ops with fake kernels and registered autograd are opaque but well-typed to
``torch.compile`` (no graph breaks, the backward ops appear in the backward graph) and they
compose with autograd like any aten op. The impls make inputs contiguous, because the
kernels walk rows of a dense buffer; the backward ops are custom ops too, so a compiled
backward calls the same kernels. Optional outputs are returned as empty tensors because
custom-op schemas cannot return None.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_npu.ops import extension

_EMPTY_SHAPE = (0,)


def _k():
    mod = extension.load()
    if mod is None:  # the functional layer never routes here without the extension
        raise RuntimeError(f"lightning_npu fused kernels are not built: {extension.load_error()}")
    return mod


def _c(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.contiguous()


def _or_empty(t: Optional[Tensor], like: Tensor) -> Tensor:
    return t if t is not None else like.new_empty(_EMPTY_SHAPE)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- bias + GELU ------------------------------------------------------------------------
@torch.library.custom_op("lightning_npu::bias_gelu", mutates_args=(), device_types="cpu")
def bias_gelu(x: Tensor, bias: Optional[Tensor], tanh: bool) -> Tensor:
    return _k().bias_gelu_forward(x.contiguous(), _c(bias), tanh)


@bias_gelu.register_fake
def _(x, bias, tanh):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("lightning_npu::bias_gelu_backward", mutates_args=(), device_types="cpu")
def bias_gelu_backward(grad: Tensor, x: Tensor, bias: Optional[Tensor], tanh: bool) -> tuple[Tensor, Tensor]:
    gx, gb = _k().bias_gelu_backward(grad.contiguous(), x.contiguous(), _c(bias), tanh)
    return gx, _or_empty(gb, x)


@bias_gelu_backward.register_fake
def _(grad, x, bias, tanh):
    gb = torch.empty_like(bias) if bias is not None else x.new_empty(_EMPTY_SHAPE)
    return torch.empty_like(x, memory_format=torch.contiguous_format), gb


def _bias_gelu_setup(ctx, inputs, output):
    x, bias, tanh = inputs
    ctx.save_for_backward(x, bias)
    ctx.tanh = tanh


def _bias_gelu_bwd(ctx, grad):
    x, bias = ctx.saved_tensors
    gx, gb = bias_gelu_backward(grad, x, bias, ctx.tanh)
    return gx, (gb if bias is not None else None), None


bias_gelu.register_autograd(_bias_gelu_bwd, setup_context=_bias_gelu_setup)


# ---- bias + dropout + residual ------------------------------------------------------------
@torch.library.custom_op("lightning_npu::bias_dropout_add", mutates_args=(), device_types="cpu")
def bias_dropout_add(x: Tensor, bias: Optional[Tensor], residual: Tensor, p: float, seed: Tensor) -> Tensor:
    return _k().bias_dropout_add_forward(x.contiguous(), _c(bias), residual.contiguous(), p, int(seed.item()))


@bias_dropout_add.register_fake
def _(x, bias, residual, p, seed):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("lightning_npu::bias_dropout_add_backward", mutates_args=(), device_types="cpu")
def bias_dropout_add_backward(grad: Tensor, p: float, seed: Tensor, need_bias: bool) -> tuple[Tensor, Tensor]:
    gx, gb = _k().bias_dropout_add_backward(grad.contiguous(), p, int(seed.item()), need_bias)
    return gx, _or_empty(gb, grad)


@bias_dropout_add_backward.register_fake
def _(grad, p, seed, need_bias):
    gb = grad.new_empty((grad.shape[-1],) if need_bias else _EMPTY_SHAPE)
    return torch.empty_like(grad, memory_format=torch.contiguous_format), gb


def _bda_setup(ctx, inputs, output):
    x, bias, residual, p, seed = inputs
    ctx.save_for_backward(seed)
    ctx.p, ctx.has_bias = p, bias is not None


def _bda_bwd(ctx, grad):
    (seed,) = ctx.saved_tensors
    gx, gb = bias_dropout_add_backward(grad, ctx.p, seed, ctx.has_bias)
    return gx, (gb if ctx.has_bias else None), grad, None, None


bias_dropout_add.register_autograd(_bda_bwd, setup_context=_bda_setup)


# ---- residual add + LayerNorm / RMSNorm -----------------------------------------------------
@torch.library.custom_op("lightning_npu::add_norm", mutates_args=(), device_types="cpu")
def add_norm(
    x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], eps: float, rms: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (y, h, mean, rstd); h = x + residual (empty without residual), mean empty for RMS."""
    y, h, mean, rstd = _k().add_norm_forward(x.contiguous(), _c(residual), _c(weight), _c(bias), eps, rms)
    return y, _or_empty(h, x), _or_empty(mean, rstd), rstd


@add_norm.register_fake
def _(x, residual, weight, bias, eps, rms):
    rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 1
    acc = _acc_dtype(x.dtype)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    h = torch.empty_like(y) if residual is not None else x.new_empty(_EMPTY_SHAPE)
    mean = x.new_empty(_EMPTY_SHAPE if rms else (rows,), dtype=acc)
    return y, h, mean, x.new_empty((rows,), dtype=acc)


@torch.library.custom_op("lightning_npu::add_norm_backward", mutates_args=(), device_types="cpu")
def add_norm_backward(
    grad: Tensor,
    grad_h: Optional[Tensor],
    h: Tensor,
    weight: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    eps: float,
    rms: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    gx, gw, gb = _k().add_norm_backward(
        grad.contiguous(), h.contiguous(), _c(weight), None if rms else mean, rstd, _c(grad_h), eps, rms, need_weight,
        need_bias,
    )
    return gx, _or_empty(gw, rstd), _or_empty(gb, rstd)


@add_norm_backward.register_fake
def _(grad, grad_h, h, weight, mean, rstd, eps, rms, need_weight, need_bias):
    width = (h.shape[-1],)
    return (
        torch.empty_like(h, memory_format=torch.contiguous_format),
        rstd.new_empty(width if need_weight else _EMPTY_SHAPE),
        rstd.new_empty(width if need_bias else _EMPTY_SHAPE),
    )


def _add_norm_setup(ctx, inputs, output):
    x, residual, weight, bias, eps, rms = inputs
    y, h, mean, rstd = output
    ctx.save_for_backward(h if residual is not None else x, weight, mean, rstd)
    ctx.rms, ctx.eps, ctx.has_residual = rms, eps, residual is not None
    ctx.need_weight = weight is not None and ctx.needs_input_grad[2]
    ctx.need_bias = bias is not None and ctx.needs_input_grad[3]
    ctx.has_weight, ctx.has_bias = weight is not None, bias is not None


def _add_norm_bwd(ctx, gy, gh, _gmean, _grstd):
    h, weight, mean, rstd = ctx.saved_tensors
    extra = gh if ctx.has_residual and gh is not None and gh.numel() else None
    gx, gw, gb = add_norm_backward(gy, extra, h, weight, mean, rstd, ctx.eps, ctx.rms, ctx.need_weight, ctx.need_bias)
    return (
        gx,
        gx if ctx.has_residual else None,
        gw if ctx.need_weight else None,
        gb if ctx.need_bias else None,
        None,
        None,
    )


add_norm.register_autograd(_add_norm_bwd, setup_context=_add_norm_setup)


# ---- scale + mask + softmax -----------------------------------------------------------------
def _expand_mask(mask: Tensor, shape: torch.Size) -> Tensor:
    if mask.dtype != torch.bool:
        mask = mask.bool()
    if mask.size(-1) != 1 and mask.stride(-1) != 1:
        mask = mask.contiguous()
    return mask.expand(shape)


@torch.library.custom_op("lightning_npu::scale_mask_softmax", mutates_args=(), device_types="cpu")
def scale_mask_softmax(x: Tensor, scale: float, causal: bool, mask: Optional[Tensor]) -> Tensor:
    x = x.contiguous()
    m = None if mask is None else _expand_mask(mask, x.shape)
    return _k().scale_mask_softmax_forward(x, scale, causal, m)


@scale_mask_softmax.register_fake
def _(x, scale, causal, mask):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("lightning_npu::scale_mask_softmax_backward", mutates_args=(), device_types="cpu")
def scale_mask_softmax_backward(grad: Tensor, y: Tensor, scale: float, causal: bool) -> Tensor:
    return _k().scale_mask_softmax_backward(grad.contiguous(), y.contiguous(), scale, causal)


@scale_mask_softmax_backward.register_fake
def _(grad, y, scale, causal):
    return torch.empty_like(y, memory_format=torch.contiguous_format)


def _sms_setup(ctx, inputs, output):
    x, scale, causal, mask = inputs
    ctx.save_for_backward(output)
    ctx.scale, ctx.causal = scale, causal


def _sms_bwd(ctx, grad):
    (y,) = ctx.saved_tensors
    return scale_mask_softmax_backward(grad, y, ctx.scale, ctx.causal), None, None, None


scale_mask_softmax.register_autograd(_sms_bwd, setup_context=_sms_setup)


# ---- SwiGLU ---------------------------------------------------------------------------------
@torch.library.custom_op("lightning_npu::swiglu", mutates_args=(), device_types="cpu")
def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return _k().swiglu_forward(gate.contiguous(), up.contiguous())


@swiglu.register_fake
def _(gate, up):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op("lightning_npu::swiglu_backward", mutates_args=(), device_types="cpu")
def swiglu_backward(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    gg, gu = _k().swiglu_backward(grad.contiguous(), gate.contiguous(), up.contiguous())
    return gg, gu


@swiglu_backward.register_fake
def _(grad, gate, up):
    return (
        torch.empty_like(gate, memory_format=torch.contiguous_format),
        torch.empty_like(up, memory_format=torch.contiguous_format),
    )


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_bwd(ctx, grad):
    gate, up = ctx.saved_tensors
    return swiglu_backward(grad, gate, up)


swiglu.register_autograd(_swiglu_bwd, setup_context=_swiglu_setup)
