"""Fused ops as plain functions, dispatched per device at call time.

CPU tensors go to the C++ kernels (eager fallbacks if they could not be built), NPU tensors to
``torch_npu``'s fused kernels, anything else (CUDA, ...) to PyTorch's own fused kernels
(F.layer_norm, F.rms_norm, softmax). DTensor inputs under tensor parallelism run the kernels on
their local shards when the op is shard-local (row ops need the last dim unsharded); any other
placement takes the eager path, which DTensor supports natively.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from lightning_npu import device as dev
from lightning_npu.ops import extension, reference

_EXT_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
_lib = None


@torch.compiler.assume_constant_result
def _ext_ready() -> bool:
    return extension.available()


def _library():
    global _lib
    if _lib is None:
        from lightning_npu.ops import library

        _lib = library
    return _lib


def backend_for(x: Tensor) -> str:
    """"ext" (our C++ kernels), "npu" (torch_npu) or "eager" (PyTorch's kernels)."""
    kind = x.device.type
    if kind == dev.CPU:
        return "ext" if x.dtype in _EXT_DTYPES and _ext_ready() else "eager"
    if kind == dev.NPU:
        return "npu"
    return "eager"


# ---- DTensor: run on local shards when that is exact ------------------------------------------
def _dtensor_cls():
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def _localize(
    x: Tensor, same: Sequence[Optional[Tensor]], vectors: Sequence[Optional[Tensor]], rowwise: bool
) -> Optional[tuple[Tensor, list, list, Callable[[Tensor], Tensor]]]:
    """Local views of x, same-shaped tensors and [hidden] vectors, plus a re-wrapper for outputs.

    Returns None when the placements make a shard-local computation wrong (sharded hidden dim
    for a row op, Partial, mismatched placements): the caller then runs the eager op on DTensors.
    """
    DTensor = _dtensor_cls()
    if DTensor is None:
        return x, list(same), list(vectors), lambda t: t
    if not isinstance(x, DTensor):
        # plain activations (use_local_output=True) with DTensor parameters: use their local shards
        def loc(t):
            return t.to_local() if isinstance(t, DTensor) else t

        return x, [loc(t) for t in same], [loc(t) for t in vectors], lambda t: t
    from torch.distributed.tensor import Replicate, Shard

    last = x.ndim - 1
    vec_placements = []
    for p in x.placements:
        if p.is_partial():
            return None
        hidden_sharded = p.is_shard() and p.dim % x.ndim == last
        if hidden_sharded and rowwise:
            return None
        vec_placements.append(Shard(0) if hidden_sharded else Replicate())
    same_l, vec_l = [], []
    for t in same:
        if t is None or (isinstance(t, DTensor) and tuple(t.placements) == tuple(x.placements)):
            same_l.append(None if t is None else t.to_local())
        else:
            return None
    for t in vectors:
        if t is None or (isinstance(t, DTensor) and tuple(t.placements) == tuple(vec_placements)):
            vec_l.append(None if t is None else t.to_local())
        else:
            return None
    mesh, placements, shape = x.device_mesh, x.placements, x.shape
    stride = torch.empty(0).new_empty(shape, device="meta").stride()

    def wrap(t: Tensor) -> Tensor:
        return DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)

    return x.to_local(), same_l, vec_l, wrap


def _gather_hidden(x: Tensor, *others: Optional[Tensor]):
    """For a row op whose hidden dim is sharded (or Partial): redistribute so every rank holds
    whole rows, run locally, and put the outputs back in x's layout with `restore`."""
    DTensor = _dtensor_cls()
    from torch.distributed.tensor import Replicate

    def fix(t):
        if not isinstance(t, DTensor):
            return t
        keep = [
            Replicate() if p.is_partial() or (p.is_shard() and p.dim % t.ndim == t.ndim - 1) else p
            for p in t.placements
        ]
        if t.ndim == 1:  # parameters: replicate
            keep = [Replicate()] * len(keep)
        return t.redistribute(t.device_mesh, keep)

    placements = x.placements

    def restore(t: Tensor) -> Tensor:
        return t.redistribute(t.device_mesh, placements)

    return fix(x), [fix(t) for t in others], restore


def _acc(t: Optional[Tensor], like: Tensor) -> Optional[Tensor]:
    """Norm parameters enter the kernels in the accumulation dtype (fp32 for fp32/bf16 inputs)."""
    if t is None:
        return None
    want = torch.float64 if like.dtype == torch.float64 else torch.float32
    return t if t.dtype == want else t.to(want)


# ---- public functions -----------------------------------------------------------------------
def bias_gelu(x: Tensor, bias: Optional[Tensor] = None, approximate: str = "none") -> Tensor:
    """gelu(x + bias); `approximate` is "none" (erf) or "tanh", as in F.gelu."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"`approximate={approximate!r}` must be 'none' or 'tanh' (as in torch.nn.functional.gelu).")
    loc = _localize(x, (), (bias,), rowwise=False)
    if loc is None:
        return reference.bias_gelu(x, bias, approximate)
    xl, _, (bl,), wrap = loc
    if backend_for(xl) != "ext":
        return wrap(reference.bias_gelu(xl, bl, approximate))
    if bl is not None and bl.dtype != xl.dtype:
        bl = bl.to(xl.dtype)
    return wrap(_library().bias_gelu(xl, bl, approximate == "tanh"))


def bias_dropout_add(
    x: Tensor, bias: Optional[Tensor], residual: Tensor, p: float, training: bool = True
) -> Tensor:
    """residual + dropout(x + bias, p); the CPU kernel's mask is a function of a seed drawn
    from torch's default generator (reproducible under torch.manual_seed), never stored."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability `p={p}` must be in [0, 1].")
    if not training or p == 0.0:
        return residual + (x if bias is None else x + bias)
    loc = _localize(x, (residual,), (bias,), rowwise=False)
    if loc is None:
        return reference.bias_dropout_add(x, bias, residual, p, training)
    xl, (rl,), (bl,), wrap = loc
    if backend_for(xl) != "ext":
        return wrap(reference.bias_dropout_add(xl, bl, rl, p, training))
    if bl is not None and bl.dtype != xl.dtype:
        bl = bl.to(xl.dtype)
    seed = torch.randint(0, 2**62, (), dtype=torch.int64)
    return wrap(_library().bias_dropout_add(xl, bl, rl.to(xl.dtype), p, seed))


def add_layer_norm(
    x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], eps: float = 1e-5
) -> tuple[Tensor, Tensor]:
    """(layer_norm(x + residual), x + residual): the sum feeds the next residual of a pre-norm block."""
    loc = _localize(x, (residual,), (weight, bias), rowwise=True)
    if loc is None:
        xg, (rg, wg, bg), restore = _gather_hidden(x, residual, weight, bias)
        if _localize(xg, (rg,), (wg, bg), rowwise=True) is None:  # placements we cannot localise
            return reference.add_layer_norm(x, residual, weight, bias, eps)
        y, h = add_layer_norm(xg, rg, wg, bg, eps)
        return restore(y), (x if residual is None else restore(h))
    xl, (rl,), (wl, bl), wrap = loc
    route = backend_for(xl)
    if route == "npu":
        y, h = _npu().add_layer_norm(xl, rl, wl, bl, eps)
    elif route == "ext" and (rl is None or rl.dtype == xl.dtype):
        y, h, _, _ = _library().add_norm(xl, rl, _acc(wl, xl), _acc(bl, xl), float(eps), False)
        if rl is None:
            h = xl
    else:
        y, h = reference.add_layer_norm(xl, rl, wl, bl, eps)
    return wrap(y), (x if residual is None else wrap(h))


def layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float = 1e-5) -> Tensor:
    return add_layer_norm(x, None, weight, bias, eps)[0]


def add_rms_norm(
    x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], eps: Optional[float] = None
) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual); eps=None means F.rms_norm's default (``reference.rms_eps``)."""
    loc = _localize(x, (residual,), (weight,), rowwise=True)
    if loc is None:
        xg, (rg, wg), restore = _gather_hidden(x, residual, weight)
        if _localize(xg, (rg,), (wg,), rowwise=True) is None:
            return reference.add_rms_norm(x, residual, weight, eps)
        y, h = add_rms_norm(xg, rg, wg, eps)
        return restore(y), (x if residual is None else restore(h))
    xl, (rl,), (wl,), wrap = loc
    route = backend_for(xl)
    if route == "npu":
        y, h = _npu().add_rms_norm(xl, rl, wl, eps)
    elif route == "ext" and (rl is None or rl.dtype == xl.dtype):
        e = reference.rms_eps(xl.dtype) if eps is None else float(eps)
        y, h, _, _ = _library().add_norm(xl, rl, _acc(wl, xl), None, e, True)
        if rl is None:
            h = xl
    else:
        y, h = reference.add_rms_norm(xl, rl, wl, eps)
    return wrap(y), (x if residual is None else wrap(h))


def rms_norm(x: Tensor, weight: Optional[Tensor], eps: Optional[float] = None) -> Tensor:
    return add_rms_norm(x, None, weight, eps)[0]


def scale_mask_softmax(
    scores: Tensor, scale: float = 1.0, causal: bool = False, mask: Optional[Tensor] = None
) -> Tensor:
    """softmax(scale * scores) over the last dim with a causal and/or boolean mask (True = drop,
    broadcastable to the scores). Rows with every key masked return zeros (eager gives NaN)."""
    if causal and scores.dim() < 2:
        raise ValueError("`causal=True` needs scores of shape [..., queries, keys].")
    DTensor = _dtensor_cls()
    if DTensor is not None and isinstance(scores, DTensor) and mask is not None:
        return reference.scale_mask_softmax(scores, scale, causal, mask)  # mask broadcast is global
    loc = _localize(scores, (), (), rowwise=True)
    if loc is None:
        sg, _, restore = _gather_hidden(scores)
        return restore(scale_mask_softmax(sg, scale, causal, mask))
    xl, _, _, wrap = loc
    if DTensor is not None and isinstance(mask, DTensor):
        mask = mask.to_local()
    route = backend_for(xl)
    if route == "ext":
        return wrap(_library().scale_mask_softmax(xl, float(scale), bool(causal), mask))
    if route == "npu":
        return wrap(_npu().scale_mask_softmax(xl, scale, causal, mask))
    return wrap(reference.scale_mask_softmax(xl, scale, causal, mask))


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up."""
    loc = _localize(gate, (up,), (), rowwise=False)
    if loc is None:
        return reference.swiglu(gate, up)
    gl, (ul,), _, wrap = loc
    route = backend_for(gl)
    if route == "ext" and ul.dtype == gl.dtype and ul.shape == gl.shape:
        return wrap(_library().swiglu(gl, ul))
    if route == "npu" and ul.shape == gl.shape:
        return wrap(_npu().swiglu(gl, ul))
    return wrap(reference.swiglu(gl, ul))


def _npu():
    from lightning_npu.ops import npu

    return npu


def causal_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0) -> Tensor:
    """Causal attention, q/k/v [batch, heads, seq, head_dim]: `npu_fusion_attention` on NPU,
    ``F.scaled_dot_product_attention`` (PyTorch's fused kernels) everywhere else."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"`dropout_p={dropout_p}` must be in [0, 1) for attention.")
    DTensor = _dtensor_cls()
    plain = DTensor is None or not any(isinstance(t, DTensor) for t in (q, k, v))
    if plain and backend_for(q) == "npu" and q.dim() == 4:
        return _npu().fusion_attention(q, k, v, None, True, q.size(-1) ** -0.5, keep_prob=1.0 - dropout_p)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
